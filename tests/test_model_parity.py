"""Logits of our model files against mlx-lm's own classes, same random weights."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from tests.helpers import tiny_model_dir

CASES = [
    ("llama", True, None),
    ("llama", False, None),
    ("llama3", True, None),
    ("mistral", False, None),
    ("qwen2", True, None),
    ("qwen3", True, None),
    ("llama", False, {"group_size": 32, "bits": 4}),
    ("qwen2", True, {"group_size": 64, "bits": 8}),
]


def _reference_logits(model, tokens: list[int], chunks: list[int]) -> np.ndarray:
    """mlx-lm: feed `tokens` in the given chunk sizes through its KV cache."""
    cache = make_prompt_cache(model)
    outs, pos = [], 0
    for n in chunks:
        outs.append(model(mx.array([tokens[pos : pos + n]]), cache=cache)[0])
        pos += n
    return np.array(mx.concatenate(outs, axis=0).astype(mx.float32))


@pytest.mark.parametrize("explicit_ops", [True, False], ids=["explicit", "fused"])
@pytest.mark.parametrize("family,tie,quant", CASES, ids=[f"{f}-tie{int(t)}-{q['bits'] if q else 'f32'}" for f, t, q in CASES])
def test_logits_match_mlx_lm(tmp_path, family, tie, quant, explicit_ops):
    """Through the explicit op forms the CPU uses (RoPE tables, exp2 softmax) and
    MLX's fast ops, which are fused kernels on the GPU."""
    path, ref_model = tiny_model_dir(tmp_path, family, tie, quant)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, block_size=16))
    engine.runner.explicit_ops = explicit_ops
    rng = np.random.default_rng(0)
    a = rng.integers(3, 300, size=40).tolist()
    b = rng.integers(3, 300, size=40).tolist()
    # A prefill that ends mid-block, a second chunk, then single-token decodes.
    chunks = [21, 12, 1, 1, 1, 1, 1, 1, 1]
    ours_a, ours_b = engine.score([a, b], chunks)
    ref_a = _reference_logits(ref_model, a, chunks)
    ref_b = _reference_logits(ref_model, b, chunks)
    tol = 1e-4 if quant is None else 1e-3
    np.testing.assert_allclose(ours_a, ref_a, atol=tol, rtol=tol)
    np.testing.assert_allclose(ours_b, ref_b, atol=tol, rtol=tol)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
