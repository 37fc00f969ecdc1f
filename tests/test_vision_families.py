"""Each vision family's own rules on the engine, against mlx-vlm's classes (or, where mlx-vlm
departs from the published model, a reference of the published rule): attention masks
(Gemma 3, PaliGemma, Gemma 4), packing (LLaVA-NeXT, Granite 4 Vision), a large picture's
tiles and crops, string-only templates, prompts that put images first (Molmo 1)."""

from __future__ import annotations

import numpy as np
import pytest

from macinfer import LLM
from macinfer.sampling_params import SamplingParams
from tests.vision_models import (FIRST, GREEDY, MINICPMV_MOE, PALIGEMMA_2, REFERENCE_TEXT, anyres_greedy, as_mlx_vlm, ask,
                                 lead_first_greedy, mlx_vlm_greedy, mlx_vlm_prompt, picture, prompt_logprobs,
                                 tiny_vlm_dir)


@pytest.mark.parametrize("budget", [512, 11])
def test_gemma3_image_tokens_attend_each_other_both_ways(vlm_dirs, budget):
    """transformers' Gemma 3 rule (mlx-vlm's classes with that mask as the reference): every
    prompt token's logprob matches it, the image tokens' own included, and not the causal run's.
    An 11-token budget would cut the prompt inside the image (its tokens are 9-12): the chunk
    stops before it instead, and the next holds it whole."""
    path = vlm_dirs["gemma3"]
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512, max_num_batched_tokens=budget)
    try:
        ids, images = llm._chat_prompt(ask("what is it", picture(0)))
        out = llm.generate([(ids, images)], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    finally:
        llm.close()
    ours = np.array([p.logprob for p in out.prompt_logprobs[1:]])
    rendered = "<user><start_of_image>what is it<assistant>"
    both, causal = (prompt_logprobs(path, rendered, [picture(0)], b) for b in (True, False))
    assert np.abs(ours - both).max() < 1e-4
    assert np.abs(both - causal).max() > 1e-2  # the rule matters on this model


@pytest.mark.parametrize("budget", [1024, 64])
def test_moondream2_prefix_of_bos_and_its_image_attends_both_ways(vlm_dirs, budget):
    """Moondream 2's published rule: BOS and the image's 729 rows attend to each other both ways
    (mlx-vlm's generation drops that mask: the reference is its classes with it), under a chunk
    budget smaller than the prefix too (the prefix goes in one chunk); a prompt holds one image
    (a second is refused), and a prompt without one starts with BOS."""
    from macinfer.vision.images import ImageError

    path = vlm_dirs["moondream2"]
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=1024, max_num_batched_tokens=budget)
    try:
        ids, images = llm._chat_prompt(ask("what is it", picture(0)))
        (span,) = images.spans
        assert (span.offset, len(span.rows)) == (0, 730) and ids[0] == llm.tokenizer.bos_token_id == 0
        out = llm.generate([(ids, images)], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        with pytest.raises(ImageError, match="more than 1 images"):
            llm._chat_prompt(ask("which differs", picture(0), picture(1)))
        text_only = llm._chat_prompt([{"role": "user", "content": "what is it"}])
        assert text_only[0] == 0 and text_only[1:] == ids[730:]
    finally:
        llm.close()
    ours = np.array([p.logprob for p in out.prompt_logprobs[1:]])
    both, causal = (prompt_logprobs(path, "what is it", [picture(0)], b) for b in (True, False))
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
        ids, images = llm._chat_prompt(ask("what is in the picture, please?", picture(0)))
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
        out = llm.generate([(ids, images)], params)[0]
        # (prompt logprobs read every position: the repeat asks for none, so the cache may answer)
        plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        once, again = (llm.generate([llm._chat_prompt(ask("what is in the picture, please?", picture(0)))], plain)[0]
                       for _ in range(2))
        eng, bm = llm.engine, llm.engine.block_manager
        seqs = []
        for words in ("same words here", "same words there"):
            ids, images = llm._chat_prompt(ask(words, picture(3)))
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
        as_mlx_vlm(llm, path, mlx_vlm_prompt(path, "what is it", 1), [picture(0)])
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
        as_mlx_vlm(llm, path, rendered, [picture(0)])
        two = llm.chat(ask("what is it", picture(0), picture(1)), FIRST)
        assert len(two.prompt_token_ids) == 2 * 576 + len(llm.chat(ask("what is it"), FIRST).prompt_token_ids)
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
        ids, images = llm._chat_prompt(ask("what is it", wide))
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
            top = llm.chat(ask("what is it", picture(1)), FIRST).logprobs[0].top
            gaps.append(max(abs(lp - reference[t]) for t, lp in top))
    finally:
        llm.close()
    assert gaps[0] < 1e-4 and min(gaps[1:]) > 1e-3, gaps


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
        ids, images = llm._chat_prompt(ask("what is it", big))
        assert len(images.spans) == 1 and len(images.spans[0].rows) > 16  # more than one view's rows
        as_mlx_vlm(llm, path, "<user><image>what is it<assistant>", [big])
    finally:
        llm.close()


def test_granite4_vision_packs_a_tall_picture_and_feeds_each_mapped_layer_as_mlx_vlm(vlm_dirs):
    """Granite 4 Vision on a picture that takes two high-resolution tiles (anyres, unpadded, a
    newline after each row): tokens and first-token logprobs are mlx-vlm's; its rows carry an
    input row and one entry for each later layer its projectors feed (layers 1 and 2)."""
    tall = picture(4, (100, 60))
    llm = LLM(vlm_dirs["granite4_vision"], kv_cache_gb=0.01, max_model_len=1024)
    try:
        ids, images = llm._chat_prompt(ask("what is it", tall))
        (span,) = images.spans
        assert len(span.rows) > 16  # the whole view's 16 and the tiles'
        assert llm.engine.vision.deepstack == (0, 1)
        as_mlx_vlm(llm, vlm_dirs["granite4_vision"], "<user><image>what is it<assistant>", [tall])
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
        ours = llm.chat(ask("what is it", big), GREEDY).token_ids
        top = llm.chat(ask("what is it", big), FIRST).logprobs[0].top
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
        ids, images = llm._chat_prompt(ask("what is it", big))
        assert len(images.spans) == 1 and len(images.spans[0].rows) == 4 * 81 + 169  # 2 x 2 crops, the view
        as_mlx_vlm(llm, vlm_dirs["step3p7"], "<user><im_patch>what is it<assistant>", [big])
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
        as_mlx_vlm(llm, path, mlx_vlm_prompt(path, "what is it", 1), [picture(0)])
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
        as_mlx_vlm(llm, path, mlx_vlm_prompt(path, "what is it", 1) + " ", [picture(0, size)])
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
        as_mlx_vlm(llm, path, "<user><|image|>what is it<assistant>", [picture(3, (500, 800))])
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
        ids, images = llm._chat_prompt(ask("what is it", big))
        assert len(images.spans[0].rows) > 2 * 144  # more than one tile and the global view
        as_mlx_vlm(llm, path, "<|user|><|image_1|> what is it<|end|><|assistant|>", [big])  # (REFERENCE_TEXT)
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
            ids, images = llm._chat_prompt(ask("what is it", *pictures))
            assert len(pictures) > 1 or len(images.spans[0].rows) > 4  # the whole view's 4 rows and slices
            assert ids == np.asarray(processor(text=[rendered], images=pictures)["input_ids"]).reshape(-1).tolist()
            as_mlx_vlm(llm, path, rendered, pictures)
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
        ids, images = llm._chat_prompt(ask("what is it", wide))
        span = images.spans[0]
        assert len(span.rows) == 12 and np.asarray(span.pixels["pixel_values"]).shape[0] == 3  # 4 rows a tile
        as_mlx_vlm(llm, path, "<user><|image|>what is it<assistant>", [wide])
    finally:
        llm.close()


def test_unlimited_ocr_reads_the_prompt_and_a_window_of_its_output(vlm_dirs):
    """Unlimited-OCR's decoder (R-SWA): each output position reads the whole prompt and the last
    8 positions (the tiny config's window) after it. 40 greedy tokens are mlx-vlm's (its ring
    cache), also when the pool is so small that rows are preempted and recomputed (the prompt
    length stays the request's) and with prompt-lookup drafts verified; scored again as one
    prompt (causal over all of it), the output's later tokens get other logprobs: the window
    is applied. The output's blocks behind the window are given back as it runs: a sequence
    holds its prompt's blocks and the window's, not all of its own."""
    from macinfer.kv.spec import PromptAndWindow

    path = vlm_dirs["unlimited_ocr"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    conv = ask("what is it", picture(0))
    llm = LLM(path, kv_cache_gb=0.05, max_model_len=2048)
    try:
        assert {s.kind for s in llm.engine.layer_specs} == {PromptAndWindow(8)}
        rendered = REFERENCE_TEXT["unlimited_ocr"](llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}]))
        pool, most = llm.engine.block_manager.kv_groups[0].pool, []
        take = pool.take
        pool.take = lambda: (take(), most.append(pool.num_used))[0]
        out = llm.chat(conv, params)
        tokens, _ = mlx_vlm_greedy(path, rendered, [picture(0)], 40)
        assert out.token_ids == tokens
        ids, images = llm._chat_prompt(conv)
        bs = llm.engine.config.block_size  # (a 301-token prompt: 19 blocks; its output ends in a 22nd)
        assert max(most) == -(-len(ids) // bs) + 2 < -(-(len(ids) + 40) // bs)
        scored = llm.generate([(ids + out.token_ids, images)],
                              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        causal = np.array([p.logprob for p in scored.prompt_logprobs[len(ids) + 1:]])
        windowed = np.array([lp.logprob for lp in out.logprobs[1:]])
        assert np.abs(causal[:8] - windowed[:8]).max() < 1e-4  # (before the window binds: the same)
        assert np.abs(causal[8:] - windowed[8:]).max() > 1e-3
    finally:
        llm.close()
    spec = LLM(path, kv_cache_gb=0.05, max_model_len=2048, num_speculative_tokens=3, prompt_lookup_min=1)
    try:  # drafts verified as decode rows, each row with the hole
        assert spec.chat(conv, params).token_ids == tokens
        assert spec.engine.stats["spec_draft_tokens"] > 0
    finally:
        spec.close()
    tight = LLM(path, kv_cache_gb=None, num_kv_blocks=40, max_num_seqs=4, max_model_len=2048,
                enable_prefix_caching=False)  # (301 prompt tokens: two fit, and grow into each other)
    try:
        outs = tight.chat([conv] * 4, params)
        assert tight.engine.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outs] == [tokens] * 4
        for o in outs:  # (the recomputed rows' K/V past the window as they were: the same logprobs)
            assert np.abs(np.array([lp.logprob for lp in o.logprobs]) - np.array([lp.logprob for lp in out.logprobs])
                          ).max() < 1e-4
    finally:
        tight.close()
