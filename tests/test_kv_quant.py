"""Quantized KV cache (int8, int4, int3: MLX-affine rows, groups of 64 or 32): smaller
pools, and the same logits as mlx-lm's own QuantizedKVCache with the same bits and groups."""

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.kv.cache import KV_QUANT_BITS
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, save_model_dir, tiny_model_dir
from tests.zoo import tiny_config


@pytest.fixture(scope="module")
def head64(tmp_path_factory):
    """head_dim 64: a quantization group of 64, as mlx-lm's default."""
    return tiny_model_dir(tmp_path_factory.mktemp("head64"), "llama", hidden_size=128, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=256)


def _mlx_lm_logits(model, tokens: list[int], chunks: list[int], bits: int, group: int = 64) -> np.ndarray:
    """mlx-lm's forward over `tokens` in `chunks`, its caches QuantizedKVCache from the first token."""
    from mlx_lm.models.cache import QuantizedKVCache

    cache = [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]
    out, pos = [], 0
    for n in chunks:
        out.append(np.array(model(mx.array([tokens[pos:pos + n]]), cache=cache)[0].astype(mx.float32)))
        pos += n
    return np.concatenate(out)


@pytest.mark.parametrize("dtype,group", [("int8", 64), ("int4", 64), ("int3", 64), ("int4", 32)])
def test_quantized_kv_is_smaller_and_computes_what_mlx_lm_does(head64, dtype, group):
    path, model = head64
    bits = KV_QUANT_BITS[dtype][0]
    full = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    quant = LLMEngine(full.loaded, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype,
                                                kv_group_size=None if group == 64 else group))
    # fp32 rows of 64 values: 256 bytes; quantized: 64 * bits / 8 + a scale and a bias per group.
    per_token = [e.cache_groups()[0]["bytes_per_token"] for e in (full, quant)]
    assert quant.kv_cache.quantized and per_token[0] / per_token[1] == 256 / (64 * bits / 8 + 8 * 64 // group)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 250, size=n).tolist() for n in (40, 30)]
    chunks = [17, 8, 1, 1, 1, 1, 1]
    for s, a, b in zip(seqs, full.score(seqs, chunks), quant.score(seqs, chunks)):
        want = _mlx_lm_logits(model, s, chunks, bits, group)
        scale = np.abs(want).max()
        assert np.abs(b - want).max() < 1e-4 * scale  # the same quantization, the same attention
        assert np.abs(a - want).max() > 1e-4 * scale  # (and not the full-precision cache's logits)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = generate(quant, seqs, params)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert quant.block_manager.num_free_blocks == quant.block_manager.num_blocks


def _roundtrip_logits(model, tokens: list[int], chunks: list[int], bits: tuple[int, int], rot: mx.array) -> np.ndarray:
    """A float reference with the quantization: mlx-lm's forward whose caches keep each K/V
    row as dequantize(quantize(row @ R)) @ R^T (K and V at their own bits), attended in
    full precision."""
    from mlx_lm.models.cache import KVCache

    def roundtrip(x: mx.array, b: int) -> mx.array:
        q = mx.quantize((x @ rot).reshape(-1, x.shape[-1]), group_size=64, bits=b)
        return (mx.dequantize(*q, group_size=64, bits=b) @ rot.T).reshape(x.shape).astype(x.dtype)

    class RotatedQuantCache(KVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(roundtrip(keys, bits[0]), roundtrip(values, bits[1]))

    cache = [RotatedQuantCache() for _ in model.layers]
    out, pos = [], 0
    for n in chunks:
        out.append(np.array(model(mx.array([tokens[pos:pos + n]]), cache=cache)[0].astype(mx.float32)))
        pos += n
    return np.concatenate(out)


@pytest.mark.parametrize("dtype", ["int4r", "int3r", "k8v4", "k8v4r"])
def test_rotated_and_mixed_kv_compute_their_float_reference(head64, dtype):
    """int4r/int3r: K and V rows turned by the Hadamard matrix before they are quantized; the
    prompt reads them dequantized and turned back, a decode reads them packed with its query
    turned alike and its output turned back. k8v4: 8-bit keys, 4-bit values. Each equals a
    float reference that keeps every row as dequantize(quantize(row @ R)) @ R^T."""
    from macinfer.kv.cache import rotation

    path, model = head64
    rot = rotation(64, mx.float32) if dtype.endswith("r") else mx.eye(64)
    assert np.allclose(np.array(rot @ rot.T), np.eye(64), atol=1e-6)
    if dtype.startswith("k8v4"):  # 2 layers of 8-bit K rows, 4-bit V rows, an fp32 scale and bias per 64
        assert LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype)).cache_groups()[0][
            "bytes_per_token"] == 2 * ((64 + 8) + (32 + 8))
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype))
    seqs = [np.random.default_rng(2).integers(3, 250, size=n).tolist() for n in (40, 30)]
    chunks = [17, 8, 1, 1, 1, 1, 1]
    for s, got in zip(seqs, engine.score(seqs, chunks)):
        want = _roundtrip_logits(model, s, chunks, KV_QUANT_BITS[dtype], rot)
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("bits", [4, 3])
def test_rotation_keeps_outlier_channels_from_spoiling_the_groups(bits):
    """K rows with a few huge channels (as real models' keys have): one scale per group
    fits the outliers and rounds the rest away; turned first, the outliers spread over the
    whole row and the rows come back about twice as close (10x outliers: 0.26 -> 0.12 of
    a unit at 4 bits, 0.51 -> 0.25 at 3)."""
    from macinfer.kv.cache import LayerPool, kv_rows
    from macinfer.kv.spec import FullAttention, LayerKV

    spec = LayerKV(FullAttention(), num_kv_heads=2, head_dim=64, v_head_dim=64)
    rng = np.random.default_rng(0)
    k = rng.normal(size=(32, 2, 64)).astype(np.float32)
    k[..., [3, 40]] *= 10.0  # two outlier channels
    err = {}
    for rotated in (False, True):
        pool = LayerPool(0, spec, 4, 16, mx.float32, (bits, bits), None, rotated)
        rows = mx.array(kv_rows(np.arange(32), 2, 16), dtype=mx.int32)  # tokens 0-31: blocks 0 and 1
        pool.write(rows, mx.array(k), mx.array(k))
        back, _ = pool.gather(mx.array([0, 1]))  # [kvh, 32, d]
        normal = np.ones(64, bool)
        normal[[3, 40]] = False
        err[rotated] = np.abs(np.array(back).transpose(1, 0, 2) - k)[..., normal].mean()
    assert err[True] < 0.6 * err[False], err


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_sliding_window_and_hybrid_caches_take_quantized_kv(tmp_path_factory, model_type, dtype):
    """A sliding-window + full group model and a hybrid's attention layers (its recurrent
    state stays full precision) run on quantized pools. Their logits are only loosely
    bounded here (random tiny Gemma 3's outlier K/V make 4-bit groups coarse: ~30% mean
    error, where the same-quantization comparison with mlx-lm above holds to 1e-4)."""
    config = tiny_config(model_type, head_dim=32)
    path = save_model_dir(str(tmp_path_factory.mktemp(model_type)), config, make_mlx_lm_model(config, seed=3))
    full = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    # (the group given explicitly: the load-time layout check's float pools must drop it)
    quant = LLMEngine(full.loaded, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype, kv_group_size=32))
    seqs = [np.random.default_rng(1).integers(3, 250, size=40).tolist()]
    chunks = [20, 10, 1, 1, 1]
    a, b = full.score(seqs, chunks)[0], quant.score(seqs, chunks)[0]
    # Random tiny weights have outlier K/V a 4-bit group smears: the mean error is what holds.
    assert 0 < np.abs(a - b).mean() < (0.05 if dtype == "int8" else 0.4) * np.abs(a).mean(), np.abs(a - b).mean()
    outs = generate(quant, seqs, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(outs[0].token_ids) == 20


@pytest.mark.parametrize("dtype", list(KV_QUANT_BITS))
def test_a_head_size_it_cannot_group_is_refused_at_load(tiny_llama, dtype):
    """head_dim 16 has no 32-value quantization group: refused at load, not at the first step."""
    with pytest.raises(ValueError, match=f"{dtype} needs head sizes divisible by 32.*layer 0 has 16"):
        LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype))


def test_a_group_size_that_does_not_divide_the_head_is_refused(head64, tiny_llama):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    with pytest.raises(ValueError, match="divisible by 128.*layer 0 has 64.*--kv-group-size 32"):
        LLMEngine(head64[0], EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int4", kv_group_size=128))
    with pytest.raises(ValueError, match="applies to a quantized KV cache"):  # (the Python API too)
        LLMEngine(head64[0], EngineConfig(kv_cache_gb=0.01, kv_group_size=32))
    with pytest.raises(ValueError, match="groups of 32, 64, 128"):
        LLMEngine(head64[0], EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int4", kv_group_size=48))
    for args, says in [(["--kv-bits", "4", "--kv-cache-dtype", "int8"], "disagree"),
                       (["--kv-group-size", "32"], "applies to a quantized KV cache"),
                       (["--kv-bits", "4", "--kv-group-size", "128"], "divisible by 128")]:
        r = CliRunner().invoke(main, ["generate", head64[0], "-p", "hi", "-n", "2", "--kv-cache-gb", "0.01", *args])
        assert r.exit_code != 0 and says in r.output, r.output
