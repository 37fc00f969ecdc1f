"""8-bit affine KV cache: smaller pool, logits close to the full-precision cache."""

import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, tiny_model_dir


def test_int8_kv_cache_is_smaller_and_close(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=256)
    full = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    int8 = LLMEngine(full.loaded, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int8"))
    assert int8.kv_cache.quantized and int8.block_manager.num_blocks > 3 * full.block_manager.num_blocks
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 300, size=n).tolist() for n in (40, 30)]
    chunks = [17, 8, 1, 1, 1, 1, 1]
    for a, b in zip(full.score(seqs, chunks), int8.score(seqs, chunks)):
        scale = np.abs(a).max()
        assert np.abs(a - b).max() < 0.02 * scale  # 8-bit groups of 64: well under 2% of the logit range
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = generate(int8, seqs, params)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert int8.block_manager.num_free_blocks == int8.block_manager.num_blocks


def test_int8_needs_a_head_size_it_can_group(tiny_llama):
    """head_dim 16 has no 32-value quantization group: refused at load, not at the first step."""
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine

    with pytest.raises(ValueError, match="divisible by 32; layer 0 has 16"):
        LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int8"))
