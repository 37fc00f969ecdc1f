"""Images on the engine: each vision family that runs gives mlx-vlm's own greedy tokens on
the same tiny weights and picture (and other tokens for another picture); image and text
requests batch together as they run alone; a block's hash holds its images' content; the
same image in the next turn hits the prefix cache and is not encoded again."""

from __future__ import annotations

import numpy as np
import pytest

from macinfer import LLM
from macinfer.engine.block_manager import BlockManager
from macinfer.sampling_params import SamplingParams
from macinfer.vision.support import FAMILIES
from tests.vision_models import (ANYRES, BOTH_WAYS, BUILDERS, LEAD_FIRST, MINICPMV_MOE, PALIGEMMA_2, PROMPT_ONLY, REFERENCE_TEXT,
                                 TEXT_FIXED, anyres_greedy, both_ways_greedy, gemma3n_greedy, lead_first_greedy,
                                 mlx_vlm_greedy, mlx_vlm_prompt, picture, prompt_logprobs, tiny_vlm_dir)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("vlm")
    return {family: tiny_vlm_dir(base, family) for family in BUILDERS}


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen3_5", "qwen3_vl"])
def llava(vlm_dirs, request):
    """A loaded vision model: LLaVA (images spliced only), Qwen2-VL (multimodal RoPE too), Qwen3.5
    (and recurrent layers), Qwen3-VL (and DeepStack)."""
    llm = LLM(vlm_dirs[request.param], kv_cache_gb=0.01, max_model_len=512, num_kv_blocks=64)
    yield llm
    llm.close()


def _ask(text: str, *images) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_family_gives_mlx_vlm_tokens_and_uses_the_image(vlm_dirs, family):
    assert FAMILIES[family] is None  # listed as running
    llm = LLM(vlm_dirs[family], kv_cache_gb=0.01, max_model_len=1024)  # (LLaVA-Bunny: 729 rows an image)
    try:
        messages = _ask("what is it", picture(0))
        rendered = mlx_vlm_prompt(vlm_dirs[family], "what is it", 1) if family in PROMPT_ONLY else \
            llm.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                            {"type": "text", "text": "what is it"}]}])
        rendered = REFERENCE_TEXT.get(family, lambda r: r)(rendered)
        ours = llm.chat(messages, GREEDY).token_ids
        reference = both_ways_greedy if family in BOTH_WAYS else anyres_greedy if family in ANYRES else \
            gemma3n_greedy if family in TEXT_FIXED else lead_first_greedy if family in LEAD_FIRST else mlx_vlm_greedy
        tokens, logprobs = reference(vlm_dirs[family], rendered, [picture(0)], 8)
        assert ours == tokens
        # the image is used: another picture moves the first token's distribution
        first = [llm.chat(_ask("what is it", picture(i)), FIRST).logprobs[0].top for i in (0, 1)]
        assert first[0] != first[1]
        assert max(abs(lp - logprobs[t]) for t, lp in first[0]) < 1e-4  # and mlx-vlm's, to float32 rounding
    finally:
        llm.close()


def _as_mlx_vlm(llm: LLM, path: str, rendered: str, pictures: list) -> None:
    """The engine's greedy tokens are mlx-vlm's for `pictures` (the prompt as `rendered` for
    mlx-vlm's processor), and its first-token logprobs to float32 rounding."""
    conv = _ask("what is it", *pictures)
    ours = llm.chat(conv, GREEDY).token_ids
    first = llm.chat(conv, FIRST).logprobs[0].top
    tokens, logprobs = mlx_vlm_greedy(path, rendered, pictures, 8)
    assert ours == tokens
    assert max(abs(lp - logprobs[t]) for t, lp in first) < 1e-4


@pytest.mark.parametrize("budget", [512, 11])
def test_gemma3_image_tokens_attend_each_other_both_ways(vlm_dirs, budget):
    """transformers' Gemma 3 rule (mlx-vlm's classes with that mask as the reference): every
    prompt token's logprob matches it, the image tokens' own included, and not the causal run's.
    An 11-token budget would cut the prompt inside the image (its tokens are 9-12): the chunk
    stops before it instead, and the next holds it whole."""
    path = vlm_dirs["gemma3"]
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512, max_num_batched_tokens=budget)
    try:
        ids, images = llm._chat_prompt(_ask("what is it", picture(0)))
        out = llm.generate([(ids, images)], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    finally:
        llm.close()
    ours = np.array([p.logprob for p in out.prompt_logprobs[1:]])
    rendered = "<user><start_of_image>what is it<assistant>"
    both, causal = (prompt_logprobs(path, rendered, [picture(0)], b) for b in (True, False))
    assert np.abs(ours - both).max() < 1e-4
    assert np.abs(both - causal).max() > 1e-2  # the rule matters on this model


@pytest.mark.parametrize("budget", [512, 5])
def test_paligemma_prompt_attends_both_ways_whole(vlm_dirs, budget):
    """PaliGemma is a prefix LM (transformers' token types, mlx-vlm's prefill mask): every
    prompt position reads the whole prompt. A 5-token budget would cut its 35-token prompt: it
    is prefilled whole in one step instead. Each of its blocks depends on the whole prompt, so
    the same picture with other words shares no block, and the same prompt again hits."""
    path = vlm_dirs["paligemma"]
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512, max_num_batched_tokens=budget)
    try:
        ids, images = llm._chat_prompt(_ask("what is in the picture, please?", picture(0)))
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
        out = llm.generate([(ids, images)], params)[0]
        # (prompt logprobs read every position: the repeat asks for none, so the cache may answer)
        plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        once, again = (llm.generate([llm._chat_prompt(_ask("what is in the picture, please?", picture(0)))], plain)[0]
                       for _ in range(2))
        eng, bm = llm.engine, llm.engine.block_manager
        seqs = []
        for words in ("same words here", "same words there"):
            ids, images = llm._chat_prompt(_ask(words, picture(3)))
            rid = eng.add_request(ids, GREEDY, images=images)
            seqs.append(eng.requests[rid].seq)
        ha, hb = (bm._hashes(s, 1) for s in seqs)
        assert seqs[0].token_ids[:bm.block_size] == seqs[1].token_ids[:bm.block_size] and ha != hb
        for s in seqs:
            eng.abort_request(s.request_id)
    finally:
        llm.close()
    assert once.token_ids == again.token_ids == out.token_ids and again.num_cached_tokens > 0
    ours = np.array([p.logprob for p in out.prompt_logprobs[1:]])
    rendered = mlx_vlm_prompt(path, "what is in the picture, please?", 1)
    both, causal = (prompt_logprobs(path, rendered, [picture(0)], False, prefix=b) for b in (True, False))
    assert np.abs(ours - both).max() < 1e-4
    assert np.abs(both - causal).max() > 1e-2  # the rule matters on this model
    assert out.token_ids == mlx_vlm_greedy(path, rendered, [picture(0)], 4)[0]


def test_paligemma_2_gives_mlx_vlm_tokens(tmp_path):
    path = tiny_vlm_dir(tmp_path, "paligemma", text=PALIGEMMA_2)
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512)
    try:
        _as_mlx_vlm(llm, path, mlx_vlm_prompt(path, "what is it", 1), [picture(0)])
    finally:
        llm.close()


def test_deepseek_vl_hybrid_tower_gives_mlx_vlm_tokens(tmp_path):
    """DeepSeek-VL's hybrid tower (SAM at 1024 px beside SigLIP at 384 px, its NumPy resizes
    between them) under the same model type as Janus; two images in one prompt, which
    mlx-vlm's merge cannot take (it keeps one image's text), each grown alone."""
    path = tiny_vlm_dir(tmp_path, "multi_modality", variant="deepseek_vl_hybrid")
    llm = LLM(path, kv_cache_gb=0.02, max_model_len=1536)
    try:
        rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "what is it"}]}])
        _as_mlx_vlm(llm, path, rendered, [picture(0)])
        two = llm.chat(_ask("what is it", picture(0), picture(1)), FIRST)
        assert len(two.prompt_token_ids) == 2 * 576 + len(llm.chat(_ask("what is it"), FIRST).prompt_token_ids)
    finally:
        llm.close()


def test_llava_next_packs_an_image_as_transformers_does_not_as_mlx_vlm(vlm_dirs):
    """LLaVA-NeXT's tiles packed as transformers' `pack_image_features`: a wide picture whose
    padding rows are cut away (2 of 4 grid rows kept) gives the reference's tokens on the engine,
    and mlx-vlm's own merge, which departs from it, gives others."""
    path = vlm_dirs["llava_next"]
    rendered = "<user><image>what is it<assistant>"
    wide = picture(4, (30, 100))
    reference, logprobs = anyres_greedy(path, rendered, [wide], 8)
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512)
    try:
        ids, images = llm._chat_prompt(_ask("what is it", wide))
        out = llm.generate([(ids, images)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                           logprobs=5))[0]
    finally:
        llm.close()
    assert len(images.spans[0].rows) == 16 + 2 * (8 + 1)  # the whole-image tile, then 2 kept rows of 8 and newlines
    assert out.token_ids == reference
    assert max(abs(lp - logprobs[t]) for t, lp in out.logprobs[0].top) < 1e-4
    theirs, _ = mlx_vlm_greedy(path, rendered, [wide], 8)
    assert theirs != reference


def test_gemma4_both_ways_images_and_per_layer_ids_each_matter(vlm_dirs):
    """Gemma 4 matches mlx-vlm (the family test) only with both its rules: an image's tokens
    attend each other both ways, and its per-layer inputs read a placeholder's id as 0. Without
    either, the first token's logprobs move off mlx-vlm's."""
    path = vlm_dirs["gemma4"]
    rendered = "<user><|image|>what is it<assistant>"
    _, reference = mlx_vlm_greedy(path, rendered, [picture(1)], 1)
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512, enable_prefix_caching=False)  # each run computed
    try:
        assert llm.engine.vision.both_ways and llm.engine.model.image_pad_id == 0
        gaps = []
        for off in (None, "both_ways", "pad"):
            if off == "both_ways":
                llm.engine.vision.both_ways = False
            if off == "pad":
                llm.engine.vision.both_ways, llm.engine.model.image_pad_id = True, None
            top = llm.chat(_ask("what is it", picture(1)), FIRST).logprobs[0].top
            gaps.append(max(abs(lp - reference[t]) for t, lp in top))
    finally:
        llm.close()
    assert gaps[0] < 1e-4 and min(gaps[1:]) > 1e-3, gaps


@pytest.mark.parametrize("family", ["mistral3", "qwen3_vl", "minicpmv4_7", "granite4_vision", "nemotron_h_nano_omni"])
def test_an_image_cut_across_prompt_chunks_gives_the_same_tokens(vlm_dirs, family):
    """A 5-token budget cuts the prompt (and each image's placeholders) into many chunks: the
    rows of a partial image, its positions and its DeepStack features follow."""
    conv = _ask("what is it", picture(2), picture(3))
    out = {}
    for budget in (512, 5):
        llm = LLM(vlm_dirs[family], kv_cache_gb=0.01, max_model_len=512, max_num_batched_tokens=budget)
        try:
            out[budget] = llm.chat(conv, FIRST).logprobs[0].top
        finally:
            llm.close()
    assert [t for t, _ in out[512]] == [t for t, _ in out[5]]
    assert max(abs(a[1] - b[1]) for a, b in zip(out[512], out[5])) < 1e-4


def test_image_and_text_requests_batch_as_they_run_alone(llava):
    convs = [_ask(f"picture {i}", picture(i, (30 + 7 * i, 60 - 5 * i))) for i in range(8)]
    convs += [[{"role": "user", "content": f"just text {i}"}] for i in range(8)]
    convs.append(_ask("two pictures", picture(7), picture(8)))
    alone = [llava.chat(c, GREEDY).token_ids for c in convs]
    llava.engine.block_manager.drop_cache()
    together = [o.token_ids for o in llava.chat(convs, GREEDY)]
    assert together == alone


def test_same_text_other_image_shares_no_block_past_it(llava):
    eng = llava.engine
    a = llava._chat_prompt(_ask("same words here", picture(3)))
    b = llava._chat_prompt(_ask("same words here", picture(4)))
    assert a[0] == b[0]  # the same token ids: only the image differs
    bm: BlockManager = eng.block_manager
    seqs = []
    for ids, images in (a, b):
        rid = eng.add_request(ids, GREEDY, images=images)
        seqs.append(eng.requests[rid].seq)
    n = len(a[0]) // bm.block_size
    ha, hb = bm._hashes(seqs[0], n), bm._hashes(seqs[1], n)
    first_image_block = seqs[0].images.spans[0].offset // bm.block_size
    assert ha[:first_image_block] == hb[:first_image_block]
    assert all(x != y for x, y in zip(ha[first_image_block:], hb[first_image_block:]))
    for s in seqs:
        eng.abort_request(s.request_id)


def test_the_next_turn_hits_past_the_image_and_does_not_encode_it_again(llava):
    eng = llava.engine
    enc = eng.vision.encoder
    turn1 = _ask("describe the picture please", picture(5))
    first = llava.chat(turn1, GREEDY)
    encoded, hits = enc.images_encoded, enc.cache.hits
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and more?"}]
    ids, images = llava._chat_prompt(turn2)
    rid = eng.add_request(ids, GREEDY, images=images)
    seq = eng.requests[rid].seq
    while eng.has_unfinished_requests():
        eng.step()
    assert seq.num_cached_tokens > images.spans[0].end  # the prefix cache held the image's positions
    assert enc.images_encoded == encoded and enc.cache.hits == hits  # neither encoded nor even looked up
    # the same picture in a new conversation (no prefix hit past it): the encoder cache answers
    llava.chat(_ask("a different question entirely", picture(5)), GREEDY)
    assert enc.images_encoded == encoded and enc.cache.hits == hits + 1


def test_generate_command_takes_images(vlm_dirs, tmp_path):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    png, junk = tmp_path / "p.png", tmp_path / "junk.png"
    picture(0).save(png)
    junk.write_bytes(b"not an image at all")
    args = ["generate", vlm_dirs["qwen2_vl"], "-p", "what is it", "--temperature", "0", "-n", "8",
            "--kv-cache-gb", "0.01", "--max-model-len", "256"]
    r = CliRunner().invoke(main, [*args, "--image", str(png)])
    assert r.exit_code == 0, r.output
    llm = LLM(vlm_dirs["qwen2_vl"], kv_cache_gb=0.01, max_model_len=256)
    try:
        expected = llm.chat(_ask("what is it", picture(0)), SamplingParams(temperature=0, max_tokens=8)).text
    finally:
        llm.close()
    assert r.stdout.startswith(expected)
    bad = CliRunner().invoke(main, [*args, "--image", str(junk)])
    assert bad.exit_code == 1 and "not an image" in bad.output and "Traceback" not in bad.output


def test_every_vision_family_runs_or_says_why():
    """`macinfer models architectures --vision`: every mlx-vlm model type with a vision tower,
    with a reason for each that does not run; each that runs is one this file builds and checks."""
    from click.testing import CliRunner

    from macinfer.cli.main import main
    from macinfer.vision.support import vision_model_types, vision_table

    table = vision_table()
    assert set(table) == set(vision_model_types()) and len(table) > 50
    assert {t for t, v in table.items() if v == "runs"} == set(BUILDERS)
    assert all(v == "runs" or len(v) > 20 for v in table.values())
    r = CliRunner().invoke(main, ["models", "architectures", "--vision"])
    assert r.exit_code == 0 and f"{len(BUILDERS)} of {len(table)} model types run with images" in r.output


def test_images_are_encoded_a_steps_worth_at_a_time_while_text_decodes(vlm_dirs):
    """With a 12-token step, images of 6 placeholders are encoded two a step at most (an image
    is encoded when a scheduled prompt chunk first reaches it, before that step's forward: a
    step encodes at most its token budget's worth), and a text request already decoding gets a
    token in every step meanwhile. The answers are the ones of one big step."""
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine

    def run(budget):
        eng = LLMEngine(vlm_dirs["qwen2_vl"], EngineConfig(kv_cache_gb=0.01, max_model_len=512,
                                                           max_num_batched_tokens=budget))
        text = eng.add_request(eng.tokenizer.encode("<user>hi<assistant>"), SamplingParams(temperature=0, max_tokens=40,
                                                                                          ignore_eos=True))
        eng.step()  # its prompt; it decodes from here on
        rids, per_step, text_tokens, done = [], [], [], {}
        for i in range(6):
            ids = eng.tokenizer.encode_chat([{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": f"picture {i}"}]}])
            ids, images = eng.prepare_images(ids, [picture(20 + i)])
            assert [len(s.rows) for s in images.spans] == [6]
            rids.append(eng.add_request(ids, GREEDY, images=images))
        while eng.has_unfinished_requests():
            before = eng.vision.encoder.images_encoded
            outs = eng.step()
            per_step.append(eng.vision.encoder.images_encoded - before)
            text_tokens.append(sum(len(o.token_ids) for o in outs if o.request_id == text))
            done.update({o.request_id: o.token_ids for o in outs if o.finished})
        return per_step, text_tokens, [done[r] for r in rids]

    per_step, text_tokens, small = run(12)
    assert max(per_step) <= 2 and sum(per_step) == 6
    first_images = next(i for i, n in enumerate(per_step) if n)
    assert all(n > 0 for n in text_tokens[: first_images + 3])  # the text request never waited a step
    assert small == run(512)[2]


def test_requests_with_images_preempted_and_recomputed_give_the_same_tokens(vlm_dirs):
    """A KV pool too small for all at once: requests are preempted and recomputed from their
    tokens, their images' rows and multimodal positions with them (Qwen2-VL)."""
    convs = [_ask(f"picture number {i}", picture(40 + i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    out = {}
    for blocks in (256, 12):
        llm = LLM(vlm_dirs["qwen2_vl"], kv_cache_gb=0.01, max_model_len=256, num_kv_blocks=blocks)
        try:
            out[blocks] = [o.token_ids for o in llm.chat(convs, params)]
            preemptions = llm.engine.scheduler.num_preemptions
        finally:
            llm.close()
        assert (preemptions > 0) == (blocks == 12)
    assert out[12] == out[256]


def test_a_vision_checkpoint_whose_processor_is_broken_serves_text_and_says_why(tmp_path):
    import os
    import shutil

    path = tiny_vlm_dir(tmp_path, "llava")
    broken = str(tmp_path / "broken")
    shutil.copytree(path, broken)
    os.remove(os.path.join(broken, "processor_config.json"))
    with open(os.path.join(broken, "preprocessor_config.json"), "w") as f:
        f.write("{not json")
    llm = LLM(broken, kv_cache_gb=0.01, max_model_len=256)
    try:
        assert llm.engine.vision is None and "could not be loaded" in llm.engine.vision_refusal
        assert llm.chat([{"role": "user", "content": "hi"}], GREEDY).token_ids  # the text runs
        with pytest.raises(ValueError, match="takes no images: its processor or vision tower"):
            llm.chat(_ask("what is it", picture(0)), GREEDY)
    finally:
        llm.close()


def test_llm_chat_takes_a_pil_image_a_path_bytes_and_a_data_url(llava, tmp_path):
    import base64
    import io

    png = tmp_path / "p.png"
    picture(6).save(png)
    data = png.read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = [picture(6), str(png), data, io.BytesIO(data).getvalue()]
    answers = {tuple(llava.chat(_ask("same question", f), GREEDY).token_ids) for f in forms}
    answers.add(tuple(llava.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                {"type": "text", "text": "same question"}]}],
                                 GREEDY).token_ids))
    assert len(answers) == 1


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_same_size_images_encoded_in_one_call_equal_one_by_one(vlm_dirs, family):
    """`encode_many` (one call for images whose inputs stack) gives each image the rows it
    gets alone, in every family that runs (a family where it did not would encode one by one)."""
    import mlx.core as mx

    llm = LLM(vlm_dirs[family], kv_cache_gb=0.01, max_model_len=512)
    try:
        eng = llm.engine
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": [
            {"type": "image"}, {"type": "image"}, {"type": "image"}, {"type": "text", "text": "x"}]}])
        spans = eng.prepare_images(ids, [picture(60 + i) for i in range(3)])[1].spans
        enc = eng.vision.encoder

        def both():  # on the engine's thread (MLX streams are per thread)
            alone = []
            for s in spans:
                enc.cache.clear()
                alone.append(enc.encode(s))
            enc.cache.clear()
            return alone, enc.encode_many(spans)

        alone, together = llm._call(both)
    finally:
        llm.close()
    for a, b in zip(alone, together):
        assert a.shape == b.shape and float(mx.abs(a - b).max()) < 1e-4


def test_an_image_that_fails_to_encode_ends_its_request_alone(vlm_dirs, monkeypatch):
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.vision import encoder as encoder_mod

    eng = LLMEngine(vlm_dirs["llava"], EngineConfig(kv_cache_gb=0.01, max_model_len=256))
    prompts = []
    for i in range(3):
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}])
        prompts.append(eng.prepare_images(ids, [picture(80 + i)]))
    bad = prompts[1][1].spans[0].digest
    real = encoder_mod.VisionEncoder._encode_group

    def flaky(self, spans):
        if any(s.digest == bad for s in spans):
            raise ValueError("a broken image")
        return real(self, spans)

    monkeypatch.setattr(encoder_mod.VisionEncoder, "_encode_group", flaky)
    rids = [eng.add_request(ids, GREEDY, images=images) for ids, images in prompts]
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert [done[r].finish_reason for r in rids] == ["length", "error", "length"]
    assert "a broken image" in done[rids[1]].error


def test_lfm2_vl_tiles_a_large_picture_as_mlx_vlm_does(vlm_dirs, tmp_path):
    """LFM2-VL's processor cuts a picture past its token budget into tiles and a thumbnail,
    with row/column markers between them: the engine's tokens and first-token logprobs are
    mlx-vlm's on a 300 x 400 picture (the family test's picture goes whole)."""
    import json
    import shutil

    path = str(tmp_path / "lfm2_vl-tiles")
    shutil.copytree(vlm_dirs["lfm2_vl"], path)
    with open(f"{path}/processor_config.json") as f:
        config = json.load(f)
    config["image_processor"].update(do_image_splitting=True, tile_size=64, min_tiles=2, max_tiles=4,
                                     use_thumbnail=True)
    with open(f"{path}/processor_config.json", "w") as f:
        json.dump(config, f)
    big = picture(3, (300, 400))
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=1024)
    try:
        ids, images = llm._chat_prompt(_ask("what is it", big))
        assert len(images.spans) == 1 and len(images.spans[0].rows) > 16  # more than one view's rows
        _as_mlx_vlm(llm, path, "<user><image>what is it<assistant>", [big])
    finally:
        llm.close()


def test_granite4_vision_packs_a_tall_picture_and_feeds_each_mapped_layer_as_mlx_vlm(vlm_dirs):
    """Granite 4 Vision on a picture that takes two high-resolution tiles (anyres, unpadded, a
    newline after each row): tokens and first-token logprobs are mlx-vlm's; its rows carry an
    input row and one entry for each later layer its projectors feed (layers 1 and 2)."""
    tall = picture(4, (100, 60))
    llm = LLM(vlm_dirs["granite4_vision"], kv_cache_gb=0.01, max_model_len=1024)
    try:
        ids, images = llm._chat_prompt(_ask("what is it", tall))
        (span,) = images.spans
        assert len(span.rows) > 16  # the whole view's 16 and the tiles'
        assert llm.engine.vision.deepstack == (0, 1)
        _as_mlx_vlm(llm, vlm_dirs["granite4_vision"], "<user><image>what is it<assistant>", [tall])
    finally:
        llm.close()


def test_molmo_puts_images_first_after_its_lead_token_and_crops_a_large_picture(vlm_dirs):
    """Molmo 1: the images go before the prompt's text, after BOS (its published processor's
    rule; mlx-vlm's leaves BOS out), whatever the message's order, one after another; a large
    picture in overlapping crops gives the published reference's tokens and first logprobs."""
    path = vlm_dirs["molmo"]
    big = picture(5, (200, 300))
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=1024)
    try:
        ids, images = llm._chat_prompt([{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                                                     {"type": "image", "image": picture(0)},
                                                                     {"type": "image", "image": big}]}])
        first, second = images.spans
        assert ids[0] == llm.tokenizer.bos_token_id and first.offset == 1 and second.offset == first.end
        assert second.length > first.length  # the crops' tokens besides the whole view's
        rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "what is it"}])
        ours = llm.chat(_ask("what is it", big), GREEDY).token_ids
        top = llm.chat(_ask("what is it", big), FIRST).logprobs[0].top
        tokens, logprobs = lead_first_greedy(path, rendered, [big], 8)
        assert ours == tokens
        assert max(abs(lp - logprobs[t]) for t, lp in top) < 1e-4
    finally:
        llm.close()


def test_step3p7_crops_a_large_picture_as_mlx_vlm_does(vlm_dirs):
    """Step 3.7's processor cuts a picture past 728 px into 504 px crops (81 rows each, between
    crop markers, newlines after each row of crops) before its whole view (169 rows): the
    engine's tokens and first-token logprobs are mlx-vlm's on an 1100 x 1100 picture."""
    big = picture(4, (1100, 1100))
    llm = LLM(vlm_dirs["step3p7"], kv_cache_gb=0.02, max_model_len=1024)
    try:
        ids, images = llm._chat_prompt(_ask("what is it", big))
        assert len(images.spans) == 1 and len(images.spans[0].rows) == 4 * 81 + 169  # 2 x 2 crops, the view
        _as_mlx_vlm(llm, vlm_dirs["step3p7"], "<user><im_patch>what is it<assistant>", [big])
    finally:
        llm.close()


@pytest.mark.parametrize("family,marker", [("llava_bunny", "<image>\n"), ("step3p7", "<im_patch>")])
def test_a_string_only_template_takes_images_as_mlx_vlm_writes_them(vlm_dirs, tmp_path, family, marker):
    """nanoLLaVA's and Step 3.7's published chat templates read string content only: each image
    part becomes the text mlx-vlm's prompt format writes for the family, and the tokens are
    mlx-vlm's own on the prompt its `apply_chat_template` builds."""
    import shutil

    path = str(tmp_path / f"{family}-string-template")
    shutil.copytree(vlm_dirs[family], path)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    llm = LLM(path, kv_cache_gb=0.02, max_model_len=2048)
    try:
        assert llm.engine.vision.processor.inline_marker == marker
        _as_mlx_vlm(llm, path, mlx_vlm_prompt(path, "what is it", 1), [picture(0)])
    finally:
        llm.close()


@pytest.mark.parametrize("family,size", [("deepseekocr", (700, 900)), ("deepseekocr_2", (900, 1000))])
def test_deepseek_ocr_tiles_a_large_picture_under_its_string_template(vlm_dirs, tmp_path, family, size):
    """DeepSeek-OCR (1 and 2) under its processor's own chat template (string content only:
    images go in as mlx-vlm's `<image>\n`): a large picture is a 1024 px global view and tiles
    (640 px, each row of features closed by a newline row; 768 px for 2); tokens and first-token
    logprobs are mlx-vlm's (whose processor drops the prompt's last token: its reference prompt
    has one more)."""
    import shutil

    from mlx_vlm.models.deepseekocr.processing_deepseekocr import DeepseekOCRProcessor

    path = str(tmp_path / f"{family}-own-template")
    shutil.copytree(vlm_dirs[family], path)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(DeepseekOCRProcessor.default_chat_template.fget(None))
    llm = LLM(path, kv_cache_gb=0.05, max_model_len=2048)
    try:
        assert llm.engine.vision.processor.inline_marker == "<image>\n"
        _as_mlx_vlm(llm, path, mlx_vlm_prompt(path, "what is it", 1) + " ", [picture(0, size)])
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["molmo2", "jina_vlm"])
def test_molmo2_crops_a_large_picture_and_takes_its_image_tokens_past_the_head(vlm_dirs, family):
    """Molmo 2, Jina-VLM: a 500 x 800 picture is a whole view and overlapping 378 px crops
    (tokens and first-token logprobs are mlx-vlm's); the image tokens are embedding rows past
    the output head's, which a prompt may hold (up to the embedding's rows) and no logit bias
    may name."""
    path = vlm_dirs[family]
    llm = LLM(path, kv_cache_gb=0.05, max_model_len=4096)
    try:
        _as_mlx_vlm(llm, path, "<user><|image|>what is it<assistant>", [picture(3, (500, 800))])
        assert (llm.engine.model.args.vocab_size, llm.engine.model.args.input_vocab_size) == (300, 316)
        assert len(llm.generate([[5, 6, 310]], GREEDY)[0].token_ids) == 8
        with pytest.raises(ValueError, match="in \\[0, 316\\)"):
            llm.generate([[5, 6, 316]], GREEDY)
        with pytest.raises(ValueError, match="logit_bias"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={305: 1.0}))
    finally:
        llm.close()


def test_phi3_v_tiles_a_large_picture_under_its_published_template(vlm_dirs, tmp_path):
    """Phi-3.5 Vision's published chat template reads string content only: images go in as
    mlx-vlm's numbered tags (`<|image_1|>`), and a 700 x 500 picture is cut into 336 px tiles
    plus its global view (HD transform): tokens and first-token logprobs are mlx-vlm's."""
    import shutil

    path = str(tmp_path / "phi3_v-published-template")
    shutil.copytree(vlm_dirs["phi3_v"], path)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    big = picture(5, (500, 700))
    llm = LLM(path, kv_cache_gb=0.05, max_model_len=4096)
    try:
        assert llm.engine.vision.processor.inline_marker == "<|image_1|>"
        ids, images = llm._chat_prompt(_ask("what is it", big))
        assert len(images.spans[0].rows) > 2 * 144  # more than one tile and the global view
        _as_mlx_vlm(llm, path, "<|user|><|image_1|> what is it<|end|><|assistant|>", [big])  # (REFERENCE_TEXT)
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["minicpmv4_6", "minicpmv4_7", "minicpmv4_7-moe"])
def test_minicpmv_slices_a_large_picture_and_numbers_each_image_as_mlx_vlm_does(vlm_dirs, tmp_path, family):
    """MiniCPM-V cuts a large picture into slices after its whole view, and writes each image's
    number before it (counted over the prompt; the engine expands an image alone, so its
    processor's rule renumbers it); 4.7 lays the views on a canvas of multimodal RoPE positions
    (and has an MoE form): the prompt is the processor's own and the tokens and first-token
    logprobs mlx-vlm's, for a 300 x 400 picture and for two pictures."""
    from mlx_vlm import load

    path = tiny_vlm_dir(tmp_path, "minicpmv4_7", text=MINICPMV_MOE) if family.endswith("-moe") else vlm_dirs[family]
    _, processor = load(path)
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=1024)
    try:
        for pictures in ([picture(3, (300, 400))], [picture(0), picture(1)]):
            rendered = "<user>" + "<image>./</image>" * len(pictures) + "what is it<assistant>"
            ids, images = llm._chat_prompt(_ask("what is it", *pictures))
            assert len(pictures) > 1 or len(images.spans[0].rows) > 4  # the whole view's 4 rows and slices
            assert ids == np.asarray(processor(text=[rendered], images=pictures)["input_ids"]).reshape(-1).tolist()
            _as_mlx_vlm(llm, path, rendered, pictures)
        assert len(images.spans) == 2
    finally:
        llm.close()


def test_llama4_tiles_a_wide_picture_with_its_global_tile(vlm_dirs):
    """Llama 4's prompt gives a picture cut into tiles one more tile's placeholders (the global
    tile, as transformers' processor makes it); mlx-vlm's image processor left that tile out,
    so a tiled picture's features fell short of its placeholders. Mended, a 60 x 130 picture
    goes as 2 tiles and the global one, and the tokens are mlx-vlm's classes' on those inputs."""
    path = vlm_dirs["llama4"]
    wide = picture(0, (60, 130))
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=1024)
    try:
        ids, images = llm._chat_prompt(_ask("what is it", wide))
        span = images.spans[0]
        assert len(span.rows) == 12 and np.asarray(span.pixels["pixel_values"]).shape[0] == 3  # 4 rows a tile
        _as_mlx_vlm(llm, path, "<user><|image|>what is it<assistant>", [wide])
    finally:
        llm.close()
