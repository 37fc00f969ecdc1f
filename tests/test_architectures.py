"""The parity matrix: every family in the registry, run through mlx-lm's own
classes on the paged cache, against mlx-lm itself on the same random weights.

For each family (tiny configs, 2 layers): logits through chunked prefill and
batched decodes; greedy tokens alone and batched with requests joining at
different steps; prefix caching with a forced preemption. Windowed families
use a window of 8 so the 40-token contexts cross it."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.models import ARCHITECTURES, UnsupportedArchitectureError, build_model
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, generate_joining, make_mlx_lm_model, save_model_dir
from tests.test_model_parity import _reference_logits

BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-5, vocab_size=300, max_position_embeddings=2048, rope_theta=10000.0,
            tie_word_embeddings=False, eos_token_id=2)
WINDOW = 8
FAMILIES = {
    "llama": {},
    "mistral": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma": {},
    "gemma2": {"query_pre_attn_scalar": 16.0, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    "gemma3_text": {"query_pre_attn_scalar": 16.0, "sliding_window": WINDOW, "sliding_window_pattern": 2,
                    "rope_local_base_freq": 10000.0},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"], "intermediate_size": 64},
    "phi3": {"partial_rotary_factor": 0.5},
    "granite": {"logits_scaling": 2.0, "attention_multiplier": 0.2, "embedding_multiplier": 3.0,
                "residual_multiplier": 0.5, "attention_bias": False, "mlp_bias": False},
    "olmo2": {},
    "glm4": {"attention_bias": True, "partial_rotary_factor": 0.5},
    "starcoder2": {"norm_epsilon": 1e-5},
}
TOKENS = [list(range(5, 45)), list(range(100, 140)), [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]]
CHUNKS = [9, 13, 1, 1, 1, 6]  # chunked prefill, then single-token decodes


def _config(family: str) -> dict:
    return {**BASE, "model_type": family, **FAMILIES[family]}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    config = _config(request.param)
    ref = make_mlx_lm_model(config, seed=7)
    path = save_model_dir(str(tmp_path_factory.mktemp(request.param)), config, ref)
    return request.param, ref, path


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(path, EngineConfig(kv_cache_gb=0.01, model_impl="mlx-lm", **kw))


def _reference_greedy(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return out


def test_registry_lists_every_tested_family():
    assert set(FAMILIES) <= set(ARCHITECTURES)


@pytest.mark.parametrize("explicit_ops,prefill_tile", [(False, None), (True, None), (True, 4)])
def test_logits_match_through_chunked_prefill_and_batched_decodes(family, explicit_ops, prefill_tile):
    """With MLX's fused SDPA (the GPU path), the explicit forms, and causal prefill in
    query tiles of 4 (the CPU path tiles at 128), so the 9- and 13-token chunks are
    split: sinks, soft-capping and windows included."""
    name, ref, path = family
    engine = _engine(path)
    engine.runner.explicit_ops, engine.runner.prefill_tile = explicit_ops, prefill_tile
    seqs = [TOKENS[0][:31], TOKENS[1][:31]]
    ours = engine.score(seqs, CHUNKS)
    for got, toks in zip(ours, seqs):
        want = _reference_logits(ref, toks, CHUNKS)
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4, err_msg=name)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_greedy_alone_and_batched_with_joiners(family):
    name, ref, path = family
    want = [_reference_greedy(ref, p, 12) for p in TOKENS]
    engine = _engine(path, max_num_batched_tokens=24)
    assert generate(engine, [TOKENS[0]], GREEDY)[0].token_ids == want[0], name
    assert generate_joining(engine, TOKENS, GREEDY) == want, name


def test_prefix_cache_and_preemption_give_the_same_tokens(family):
    name, ref, path = family
    want = _reference_greedy(ref, TOKENS[0], 12)
    # 6 blocks of 16 tokens for 3 requests of 52 tokens each: they preempt each other.
    tight = LLMEngine(path, EngineConfig(num_kv_blocks=6, model_impl="mlx-lm", max_num_seqs=3))
    outs = generate(tight, [TOKENS[0]] * 3, GREEDY)
    assert all(o.token_ids == want for o in outs), name
    assert tight.scheduler.num_preemptions > 0
    again = generate(tight, [TOKENS[0]], GREEDY)[0]
    assert again.token_ids == want and again.num_cached_tokens > 0


@pytest.mark.parametrize("model_type,why", [("minimax_m3_vl", "block selection over its own index cache"),
                                            ("baichuan_m1", "convolution over K/V inside attention")])
def test_unsupported_kinds_are_refused_with_the_reason(model_type, why):
    from tests.zoo import tiny_config

    with pytest.raises(UnsupportedArchitectureError, match=f"unsupported architecture '{model_type}': .*{why}"):
        build_model(tiny_config(model_type))
