"""Images on the engine: each vision family that runs gives mlx-vlm's own greedy tokens on
the same tiny weights and picture (and other tokens for another picture); image and text
requests batch together as they run alone; a block's hash holds its images' content; the
same image in the next turn hits the prefix cache and is not encoded again. A family's own
rules (masks, tiles and crops, prompt formats) are `test_vision_families.py`'s."""

from __future__ import annotations

import pytest

from macinfer import LLM
from macinfer.engine.block_manager import BlockManager
from macinfer.sampling_params import SamplingParams
from macinfer.vision.families import FAMILIES
from tests.vision_models import (ANYRES, BOTH_WAYS, BUILDERS, FIRST, GREEDY, LEAD_FIRST, PROMPT_ONLY, REFERENCE_TEXT,
                                 TEXT_FIXED, anyres_greedy, ask, both_ways_greedy, gemma3n_greedy, lead_first_greedy,
                                 mlx_vlm_greedy, mlx_vlm_prompt, picture, tiny_vlm_dir)


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen3_5", "qwen3_vl"])
def llava(vlm_dirs, request):
    """A loaded vision model: LLaVA (images spliced only), Qwen2-VL (multimodal RoPE too), Qwen3.5
    (and recurrent layers), Qwen3-VL (and DeepStack)."""
    llm = LLM(vlm_dirs[request.param], kv_cache_gb=0.01, max_model_len=512, num_kv_blocks=64)
    yield llm
    llm.close()


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_family_gives_mlx_vlm_tokens_and_uses_the_image(vlm_dirs, family):
    assert FAMILIES[family] is None  # listed as running
    llm = LLM(vlm_dirs[family], kv_cache_gb=0.01, max_model_len=1024)  # (LLaVA-Bunny: 729 rows an image)
    try:
        messages = ask("what is it", picture(0))
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
        first = [llm.chat(ask("what is it", picture(i)), FIRST).logprobs[0].top for i in (0, 1)]
        assert first[0] != first[1]
        assert max(abs(lp - logprobs[t]) for t, lp in first[0]) < 1e-4  # and mlx-vlm's, to float32 rounding
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["mistral3", "qwen3_vl", "minicpmv4_7", "granite4_vision", "nemotron_h_nano_omni",
                                    "hunyuan_vl"])
def test_an_image_cut_across_prompt_chunks_gives_the_same_tokens(vlm_dirs, family):
    """A 5-token budget cuts the prompt (and each image's placeholders) into many chunks: the
    rows of a partial image, its positions and its DeepStack features follow."""
    conv = ask("what is it", picture(2), picture(3))
    out = {}
    for budget in (512, 5):
        # (HunyuanOCR's processor as mlx-vlm loads it: 512 x 512 px at least, ~290 tokens a picture)
        llm = LLM(vlm_dirs[family], kv_cache_gb=0.01, max_model_len=1024, max_num_batched_tokens=budget)
        try:
            out[budget] = llm.chat(conv, FIRST).logprobs[0].top
        finally:
            llm.close()
    assert [t for t, _ in out[512]] == [t for t, _ in out[5]]
    assert max(abs(a[1] - b[1]) for a, b in zip(out[512], out[5])) < 1e-4


def test_image_and_text_requests_batch_as_they_run_alone(llava):
    convs = [ask(f"picture {i}", picture(i, (30 + 7 * i, 60 - 5 * i))) for i in range(8)]
    convs += [[{"role": "user", "content": f"just text {i}"}] for i in range(8)]
    convs.append(ask("two pictures", picture(7), picture(8)))
    alone = [llava.chat(c, GREEDY).token_ids for c in convs]
    llava.engine.block_manager.drop_cache()
    together = [o.token_ids for o in llava.chat(convs, GREEDY)]
    assert together == alone


def test_same_text_other_image_shares_no_block_past_it(llava):
    eng = llava.engine
    a = llava._chat_prompt(ask("same words here", picture(3)))
    b = llava._chat_prompt(ask("same words here", picture(4)))
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
    turn1 = ask("describe the picture please", picture(5))
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
    llava.chat(ask("a different question entirely", picture(5)), GREEDY)
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
        expected = llm.chat(ask("what is it", picture(0)), SamplingParams(temperature=0, max_tokens=8)).text
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
    from macinfer.vision.families import UNVERIFIED, vision_model_types, vision_table

    table = vision_table()
    assert set(table) == set(vision_model_types()) and len(table) > 50
    assert {t for t, v in table.items() if v == "runs"} == set(BUILDERS)
    assert all(v == "runs" or len(v) > 20 for v in table.values())
    assert [t for t, v in table.items() if v == UNVERIFIED] == []  # each refused with a reason of its own
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
    convs = [ask(f"picture number {i}", picture(40 + i)) for i in range(4)]
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
            llm.chat(ask("what is it", picture(0)), GREEDY)
    finally:
        llm.close()


def test_a_qwen2_vl_decoder_runs_on_the_engines_own_graph(vlm_dirs, monkeypatch):
    """Qwen2-VL's language model alone on the engine's Llama/Qwen2 graph (its images spliced in,
    its multimodal RoPE by the step's positions) gives what mlx-lm's class gives, image or not;
    where its language model cannot be read alone (no mlx-vlm), mlx-lm's class serves it."""
    from macinfer.models.llama import Model as OwnGraph
    from macinfer.models.mlx_lm_adapter import MlxLmModel

    path, out = vlm_dirs["qwen2_vl"], {}
    convs = [ask("what is it", picture(4)), [{"role": "user", "content": "hello there"}]]
    for impl in ("auto", "mlx-lm"):
        llm = LLM(path, kv_cache_gb=0.01, max_model_len=512, model_impl=impl)
        try:
            assert isinstance(llm.engine.model, OwnGraph if impl == "auto" else MlxLmModel)
            out[impl] = [o.token_ids for o in llm.chat(convs, GREEDY)]
        finally:
            llm.close()
    assert out["auto"] == out["mlx-lm"]

    def no_mlx_vlm(_path):
        raise ValueError("mlx-vlm is not installed")

    monkeypatch.setattr("macinfer.vision.text_model.language_model", no_mlx_vlm)
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512)
    try:
        assert isinstance(llm.engine.model, MlxLmModel)
        assert [o.token_ids for o in llm.chat(convs[1:], GREEDY)] == out["auto"][1:]
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
    answers = {tuple(llava.chat(ask("same question", f), GREEDY).token_ids) for f in forms}
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
        n = min(3, eng.vision.limits.max_images)  # (Moondream's prompt takes one)
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": [
            *[{"type": "image"}] * n, {"type": "text", "text": "x"}]}])
        spans = eng.prepare_images(ids, [picture(60 + i) for i in range(n)])[1].spans
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
