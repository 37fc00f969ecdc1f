"""Multi-head latent attention on the paged engine (issue #23): the cache holds the
compressed latent and the rope key, one "head" a token, and the attention reads them in
mlx-lm's absorbed form.

Every MLA family's parity with mlx-lm (chunked prefill, joins, a prefix hit, forced
preemption) is in tests/test_architecture_matrix.py; here the cache's size, the form
without a query LoRA, and the int8 cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, save_model_dir
from tests.test_architecture_matrix import _reference_greedy, _reference_logits
from tests.zoo import tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(5, 45)), list(range(100, 131)), [7, 9, 11, 13, 15]]


def _model(tmp_path, model_type="deepseek_v3", **overrides):
    config = tiny_config(model_type, **overrides)
    model = make_mlx_lm_model(config, seed=5)
    return save_model_dir(str(tmp_path / model_type), config, model), model, config


def test_the_cache_holds_latents_not_expanded_heads(tmp_path):
    """KV bytes a token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, as
    `/status` reports them: no V stored, no per-head K."""
    path, _, config = _model(tmp_path)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    layers, r, rope = config["num_hidden_layers"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    assert all(s.v_in_k and s.num_kv_heads == 1 and s.head_dim == r + rope for s in engine.layer_specs)
    (group,) = engine.cache_groups()
    assert group["bytes_per_token"] == layers * (r + rope) * 4  # float32 weights here
    assert group["bytes"] == engine.kv_cache.nbytes == group["blocks_total"] * 16 * group["bytes_per_token"]
    expanded = layers * config["num_attention_heads"] * (config["qk_nope_head_dim"] + rope + config["v_head_dim"]) * 4
    assert group["bytes_per_token"] * 4 <= expanded  # (DeepSeek V3 shapes: 57x, scripts/kv_memory.py)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_matches_mlx_lm_with_and_without_a_query_lora(tmp_path, q_lora_rank):
    path, model, _ = _model(tmp_path, q_lora_rank=q_lora_rank)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, max_num_batched_tokens=24))
    chunks = [9, 13, 1, 1, 1, 6]
    for got, toks in zip(engine.score([PROMPTS[0][:31], PROMPTS[1]], chunks), [PROMPTS[0][:31], PROMPTS[1]]):
        np.testing.assert_allclose(got, _reference_logits(model, toks, chunks, None), atol=2e-4, rtol=2e-4)
    want = [_reference_greedy(model, p, GREEDY.max_tokens, None) for p in PROMPTS]
    assert [o.token_ids for o in generate(engine, PROMPTS, GREEDY)] == want
    again = generate(engine, [PROMPTS[0]], GREEDY)[0]
    assert again.token_ids == want[0] and again.num_cached_tokens > 0


@pytest.mark.parametrize("dtype,bound", [("int8", 0.05), ("int4c", 0.3)])
def test_quantized_latent_cache_stays_close(tmp_path, dtype, bound):
    """int8 K (the latent and rope key, group-quantized) against float: logits within a few
    hundredths. int4c: the latent stored per channel over a block's tokens, V (its leading
    values) read from those transposed matrices."""
    path, model, _ = _model(tmp_path, kv_lora_rank=48, qk_rope_head_dim=16)  # 64 values a token: int8 groups fit
    full = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    quant = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype))
    a, b = (e.score([PROMPTS[0]], [20, 1, 1, 1]) [0] for e in (full, quant))
    assert 0 < np.abs(a - b).max() < bound * np.abs(a).max()
    assert quant.kv_cache.nbytes < full.kv_cache.nbytes


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_linear"])
def test_speculation_on_latents_gives_the_same_tokens(tmp_path, model_type):
    """Drafts verified as decode rows over the latent cache (and, for Kimi Linear, recurrent
    state rewound on a rejection): the same tokens as without speculation."""
    path, _, _ = _model(tmp_path, model_type)
    prompts = [[7, 8, 9, 10, 11] * 8, list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = generate(LLMEngine(path, EngineConfig(kv_cache_gb=0.01)), prompts, params)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, num_speculative_tokens=3, prompt_lookup_min=1,
                                          speculative_max_batch=4))
    assert [o.token_ids for o in generate(engine, prompts, params)] == [o.token_ids for o in plain]
    assert engine.stats["spec_draft_tokens"] > 0


def test_latent_decode_kernel_in_the_engine_equals_the_reference(tmp_path, monkeypatch):
    """The Metal decode kernel over the paged latents, run from its generated source by the
    CPU emulator inside the engine (decodes and speculative rows): the same logits and
    tokens as the reference path. kv_lora_rank 64 + rope 32: widths the kernel takes."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("the CPU emulator needs g++")
    from macinfer.kernels import paged_attention as paged_kernels

    launched = []
    original = paged_kernels.decode_calls
    monkeypatch.setattr(paged_kernels, "decode_calls", lambda *a, **kw: launched.append(kw.get("v_dim")) or original(*a, **kw))
    path, _, _ = _model(tmp_path, kv_lora_rank=64, qk_rope_head_dim=32)
    prompts = [[7, 8, 9, 10, 11] * 6, list(range(20, 45))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(mode):
        monkeypatch.setenv("MACINFER_KERNELS", mode)
        engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, num_speculative_tokens=2, prompt_lookup_min=1,
                                              speculative_max_batch=4))
        assert engine.paths.decode_attention == mode
        launched.clear()  # the start-up self-check's launches
        logits = engine.score([PROMPTS[0]], [30, 1, 1, 1])[0]
        return logits, [o.token_ids for o in generate(engine, prompts, params)]

    ref_logits, ref_tokens = run("reference")
    assert not launched
    emu_logits, emu_tokens = run("emulate")
    assert launched and set(launched) == {64}  # the latent's width: V read from K's leading columns
    np.testing.assert_allclose(emu_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert emu_tokens == ref_tokens


# The expanded form of prompt chunks: families with one MLA attention a layer, two
# (LongCat), the llama-4 query scale (Mistral 4), and recurrent layers beside (Kimi Linear).
EXPANDED_FAMILIES = ["deepseek_v3", "mistral4", "longcat_flash", "kimi_linear", "glm4_moe_lite"]


@pytest.mark.parametrize("model_type", EXPANDED_FAMILIES)
def test_expanded_prompt_chunks_match_mlx_lm(tmp_path, monkeypatch, model_type):
    """Every prompt chunk of 4 tokens or more in the expanded form (K and V per head from
    the cached latents), the rest of the step absorbed: the parity matrix's run (chunks,
    joins, forced preemption, a prefix hit) gives mlx-lm's logits and greedy tokens."""
    from macinfer.kv import mla
    from tests.test_architecture_matrix import test_runs_like_mlx_lm

    expanded = []
    original = mla._expanded_span
    monkeypatch.setattr(mla, "_expanded_span", lambda *a, **kw: expanded.append(a[4].length) or original(*a, **kw))
    monkeypatch.setenv(mla.ENV, "4")
    test_runs_like_mlx_lm(model_type, tmp_path)
    assert expanded and min(expanded) >= 4


def test_expanded_form_with_quantized_projections(tmp_path, monkeypatch):
    """A 4-bit model (mlx-lm's QuantizedMultiLinear for embed_q / unembed_out): both forms
    give the same logits as each other, close to mlx-lm's on the same quantized weights."""
    import mlx.nn as nn

    config = tiny_config("deepseek_v3", kv_lora_rank=64, q_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32)
    model = make_mlx_lm_model(config, seed=5)
    nn.quantize(model, group_size=32, bits=4)
    config["quantization"] = {"group_size": 32, "bits": 4}
    path = save_model_dir(str(tmp_path / "q4"), config, model)
    chunks = [17, 14, 1, 1]
    runs = {}
    from macinfer.kv import mla

    expanded = []
    original = mla._expanded_span
    monkeypatch.setattr(mla, "_expanded_span", lambda *a, **kw: expanded.append(a[4].length) or original(*a, **kw))
    for form in ("absorbed", "expanded"):
        monkeypatch.setenv("MACINFER_MLA_PREFILL", form)
        engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
        assert type(engine.model.mla_projections[0]).__name__ == "QuantizedMultiLinear"
        runs[form] = engine.score([PROMPTS[0][:33]], chunks)[0]
    assert {14, 17} <= set(expanded)  # both prompt chunks (5: the load-time check against mlx-lm)
    np.testing.assert_allclose(runs["expanded"], runs["absorbed"], atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(runs["expanded"], _reference_logits(model, PROMPTS[0][:33], chunks, None),
                               atol=5e-3, rtol=5e-3)


def test_prompt_form_is_chosen_by_measurement_and_cached(tmp_path, monkeypatch, caplog):
    """The crossover is the shortest timed chunk from which the expanded form stays faster;
    it is measured once per device and shape, read back on the next load, and
    MACINFER_MLA_PREFILL or MACINFER_AUTOTUNE=0 override it."""
    import logging

    from macinfer.kv import mla

    assert mla.crossover({16: (1, 2), 64: (2, 1), 256: (3, 1), 512: (9, 2)}) == 64
    assert mla.crossover({16: (1, 0.5), 64: (2, 3), 256: (3, 1)}) == 256  # a faster short chunk alone is noise
    assert mla.crossover({16: (1, 2), 64: (2, 3)}) is None

    monkeypatch.setenv("MACINFER_CACHE_DIR", str(tmp_path / "cache"))
    path, _, _ = _model(tmp_path)
    calls = []

    def fake(embed_q, unembed, dims, dtype, explicit, tile):
        calls.append(dims)
        return {16: (1.0, 2.0), 64: (2.0, 1.5), 256: (4.0, 1.0), 512: (9.0, 2.0)}

    monkeypatch.setattr(mla, "measure_forms", fake)
    monkeypatch.setattr(mla.choose_expand_from, "__defaults__", (mla.autotune.Tuning(), fake))
    with caplog.at_level(logging.INFO, logger="macinfer"):
        assert LLMEngine(path, EngineConfig(kv_cache_gb=0.01)).runner.mla_expand_from == 64
        assert LLMEngine(path, EngineConfig(kv_cache_gb=0.01)).runner.mla_expand_from == 64
    assert len(calls) == 1 and calls[0]["heads"] == 4  # the second load read the cached verdict
    lines = [r.getMessage() for r in caplog.records if "MLA prompt chunks" in r.getMessage()]
    assert "expanded form from 64 tokens" in lines[0] and "64: 2000/1500 ms" in lines[0] and "(cached)" in lines[1]
    assert (tmp_path / "cache" / "autotune.json").exists()

    monkeypatch.setenv("MACINFER_MLA_PREFILL", "absorbed")
    assert LLMEngine(path, EngineConfig(kv_cache_gb=0.01)).runner.mla_expand_from is None
    monkeypatch.setenv("MACINFER_MLA_PREFILL", "auto")
    monkeypatch.setenv("MACINFER_AUTOTUNE", "0")
    assert LLMEngine(path, EngineConfig(kv_cache_gb=0.01)).runner.mla_expand_from is None
    assert len(calls) == 1
    monkeypatch.setenv("MACINFER_MLA_PREFILL", "sometimes")
    with pytest.raises(ValueError, match="MACINFER_MLA_PREFILL"):
        LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
