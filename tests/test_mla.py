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


def test_int8_latent_cache_stays_close(tmp_path):
    """int8 K (the latent and rope key, group-quantized) against float: the same greedy
    tokens on this model, logits within a few hundredths."""
    path, model, _ = _model(tmp_path, kv_lora_rank=48, qk_rope_head_dim=16)  # 64 values a token: int8 groups fit
    full = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    int8 = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int8"))
    a, b = (e.score([PROMPTS[0]], [20, 1, 1, 1]) [0] for e in (full, int8))
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert int8.kv_cache.nbytes < full.kv_cache.nbytes


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_linear"])
def test_speculation_on_latents_gives_the_same_tokens(tmp_path, model_type):
    """Drafts verified as decode rows over the latent cache (and, for Kimi Linear, recurrent
    state rewound on a rejection): the same tokens as without speculation."""
    path, _, _ = _model(tmp_path, model_type)
    prompts = [[7, 8, 9, 10, 11] * 8, list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = generate(LLMEngine(path, EngineConfig(kv_cache_gb=0.01)), prompts, params)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, num_speculative_tokens=3, prompt_lookup_min=1))
    assert [o.token_ids for o in generate(engine, prompts, params)] == [o.token_ids for o in plain]
    assert engine.stats["spec_draft_tokens"] > 0


def test_latent_decode_kernel_in_the_engine_equals_the_reference(tmp_path, monkeypatch):
    """The Metal decode kernel over the paged latents, run from its generated source by the
    CPU emulator inside the engine (decodes and speculative rows): the same logits and
    tokens as the reference path. kv_lora_rank 64 + rope 32: widths the kernel takes."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("the CPU emulator needs g++")
    from macinfer import kernels
    from macinfer.kernels import paged_attention as paged_kernels

    launched = []
    original = paged_kernels.decode_calls
    monkeypatch.setattr(paged_kernels, "decode_calls", lambda *a, **kw: launched.append(kw.get("v_dim")) or original(*a, **kw))
    path, _, _ = _model(tmp_path, kv_lora_rank=64, qk_rope_head_dim=32)
    prompts = [[7, 8, 9, 10, 11] * 6, list(range(20, 45))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(mode):
        monkeypatch.setenv("MACINFER_KERNELS", mode)
        engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, num_speculative_tokens=2, prompt_lookup_min=1))
        assert kernels.mode() == mode
        launched.clear()  # the start-up self-check's launches
        logits = engine.score([PROMPTS[0]], [30, 1, 1, 1])[0]
        return logits, [o.token_ids for o in generate(engine, prompts, params)]

    ref_logits, ref_tokens = run("reference")
    assert not launched
    emu_logits, emu_tokens = run("emulate")
    assert launched and set(launched) == {64}  # the latent's width: V read from K's leading columns
    np.testing.assert_allclose(emu_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert emu_tokens == ref_tokens
