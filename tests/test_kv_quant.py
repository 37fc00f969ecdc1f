"""Quantized KV cache (int8, int4, int3: MLX-affine rows, groups of 64 or 32): smaller
pools, and the same logits as mlx-lm's own QuantizedKVCache with the same bits and groups."""

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.kv.cache import KV_QUANT_BITS, rotation
from macinfer.sampling_params import SamplingParams
from tests.helpers import chunked_logits, generate, make_mlx_lm_model, save_model_dir, tiny_model_dir
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
    return chunked_logits(model, tokens, chunks, cache)


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


def _roundtrip_logits(model, tokens: list[int], chunks: list[int], bits: tuple[int, int], rot: mx.array,
                      start: int = 0) -> np.ndarray:
    """A float reference with the quantization: mlx-lm's forward whose caches keep each K/V
    row as dequantize(quantize(row @ R)) @ R^T (K and V at their own bits), attended in
    full precision; the rows of the first `start` positions kept as they are."""
    from mlx_lm.models.cache import KVCache

    def roundtrip(x: mx.array, b: int, offset: int) -> mx.array:
        q = mx.quantize((x @ rot).reshape(-1, x.shape[-1]), group_size=64, bits=b)
        y = (mx.dequantize(*q, group_size=64, bits=b) @ rot.T).reshape(x.shape).astype(x.dtype)
        keep = (mx.arange(x.shape[2]) + offset < start)[None, None, :, None]  # [B, kvh, n, d]: n positions
        return mx.where(keep, x, y)

    class RotatedQuantCache(KVCache):
        def update_and_fetch(self, keys, values):
            at = self.offset
            return super().update_and_fetch(roundtrip(keys, bits[0], at), roundtrip(values, bits[1], at))

    cache = [RotatedQuantCache() for _ in model.layers]
    return chunked_logits(model, tokens, chunks, cache)


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
@pytest.mark.parametrize("dtype", ["int8", "int4", "int4c"])
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
                       (["--kv-bits", "4", "--kv-group-size", "128"], "divisible by 128"),
                       (["--kv-quant-start", "8"], "--kv-quant-start keeps")]:
        r = CliRunner().invoke(main, ["generate", head64[0], "-p", "hi", "-n", "2", "--kv-cache-gb", "0.01", *args])
        assert r.exit_code != 0 and says in r.output, r.output


@pytest.mark.parametrize("dtype,start", [("int4", 20), ("int3r", 16), ("k8v4", 37)])
def test_first_tokens_kept_full_precision_compute_their_float_reference(head64, dtype, start):
    """`--kv-quant-start N`: the first N tokens of each sequence are kept at full precision
    (a group of their own, `FirstTokens`), the rest quantized; the prompt chunks and the
    decodes (plain, then speculating rows) read keys below N from there. Each equals the
    float reference that round-trips only the rows from position N on; a prompt shorter
    than N computes what the full-precision cache does."""
    path, model = head64
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype, kv_quant_start=start))
    kinds = [g["kind"] for g in engine.cache_groups()]
    assert kinds == ["full attention", f"first {start} tokens at full precision"], kinds
    rot = rotation(64, mx.float32) if dtype.endswith("r") else mx.eye(64)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(3, 250, size=n).tolist() for n in (40, 30, 12)]
    full = LLMEngine(engine.loaded, EngineConfig(kv_cache_gb=0.01))
    for group, chunks in (([seqs[0], seqs[1]], [17, 8, 1, 1, 1, 1, 1]), ([seqs[2]], [7, 3, 1, 1])):
        for s, got, plain in zip(group, engine.score(group, chunks), full.score(group, chunks)):
            want = _roundtrip_logits(model, s, chunks, KV_QUANT_BITS[dtype], rot, start)
            scale = np.abs(want).max()
            assert np.abs(got - want).max() < 1e-4 * scale
            if len(s) > start:  # (every row quantized differs)
                every = _roundtrip_logits(model, s, chunks, KV_QUANT_BITS[dtype], rot)
                assert np.abs(got - every).max() > 1e-4 * scale
            else:
                assert np.abs(got - plain).max() < 1e-5 * scale
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = generate(engine, seqs, params)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_first_tokens_hold_through_speculation_prefix_hits_and_preemption(head64):
    """The first tokens' group rides every path a sequence takes: speculating rows (prompt
    lookup drafts read the first tokens as decodes do), a prefix hit of a finished request
    (both groups' blocks), and preemption with too few blocks: the same greedy tokens as
    one request at a time on a roomy cache."""
    path, _ = head64
    cfg = dict(kv_cache_dtype="int4", kv_quant_start=24)
    rng = np.random.default_rng(9)
    stem = rng.integers(3, 250, size=20).tolist()
    prompts = [stem * 2 + rng.integers(3, 250, size=n).tolist() for n in (5, 13, 30)] + [stem[:9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, enable_prefix_caching=False, **cfg))
    want = [generate(alone, [p], params)[0].token_ids for p in prompts]
    spec = LLMEngine(alone.loaded, EngineConfig(kv_cache_gb=0.01, num_speculative_tokens=3,
                                                speculative_max_batch=8, **cfg))
    assert [o.token_ids for o in generate(spec, prompts, params)] == want
    assert spec.stats["spec_accepted_tokens"] > 0
    again = generate(spec, prompts[:2], params)
    assert [o.token_ids for o in again] == want[:2] and min(o.num_cached_tokens for o in again) >= 32
    tight = LLMEngine(alone.loaded, EngineConfig(num_kv_blocks=9, max_num_batched_tokens=32, **cfg))
    assert [o.token_ids for o in generate(tight, prompts, params)] == want
    assert tight.scheduler.num_preemptions > 0


def _roundtrip_model_logits(model, tokens: list[int], chunks: list[int], bits: int, group: int,
                            start: int) -> np.ndarray:
    """mlx-lm's forward with its own caches, every K/V row round-tripped through `bits`-bit
    groups except, in the full-attention caches, those of the first `start` positions."""
    from mlx_lm.models.cache import KVCache

    def roundtrip(x: mx.array, offset: int, keep_below: int) -> mx.array:
        q = mx.quantize(x.reshape(-1, x.shape[-1]), group_size=group, bits=bits)
        y = mx.dequantize(*q, group_size=group, bits=bits).reshape(x.shape).astype(x.dtype)
        return mx.where((mx.arange(x.shape[2]) + offset < keep_below)[None, None, :, None], x, y)

    cache = model.make_cache()
    for c in cache:
        if hasattr(c, "update_and_fetch"):
            keep = start if type(c) is KVCache else 0  # (a window's cache keeps none apart)

            def update(k, v, c=c, keep=keep, update=c.update_and_fetch):
                at = c.offset
                return update(roundtrip(k, at, keep), roundtrip(v, at, keep))

            c.update_and_fetch = update
    return chunked_logits(model, tokens, chunks, cache)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next", "deepseek_v3"])
def test_first_tokens_for_each_cache_kind(tmp_path_factory, model_type):
    """Sliding windows + full attention (Gemma 3: only the full layers keep first tokens
    apart), a hybrid's attention layers, and MLA latents (written as one row of latent
    and rope key): each computes its float reference with the same quantization (MLA: a
    start past the prompt computes what the full-precision cache does)."""
    mla = model_type == "deepseek_v3"
    config = tiny_config(model_type, **(dict(kv_lora_rank=48, qk_rope_head_dim=16) if mla else dict(head_dim=32)))
    model = make_mlx_lm_model(config, seed=3)
    path = save_model_dir(str(tmp_path_factory.mktemp(model_type)), config, model)
    start = 64 if mla else 24
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int8", kv_quant_start=start))
    first = [g for g in engine.cache_groups() if "first_tokens" in g]
    assert len(first) == 1 and first[0]["layers"] == [g for g in engine.cache_groups()
                                                       if g["kind"] == "full attention"][0]["layers"]
    seq = np.random.default_rng(1).integers(3, 250, size=40).tolist()
    chunks = [17, 8, 1, 1, 1, 1, 1]
    got = engine.score([seq], chunks)[0]
    if mla:
        want = LLMEngine(engine.loaded, EngineConfig(kv_cache_gb=0.01)).score([seq], chunks)[0]
    else:
        want = _roundtrip_model_logits(model, seq, chunks, 8, 32, start)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = (generate(engine, [seq], params)[0] for _ in range(2))
    assert a.token_ids == b.token_ids and b.num_cached_tokens > 0


def test_kv_quant_start_needs_a_quantized_cache_and_full_attention(head64, tmp_path):
    with pytest.raises(ValueError, match="--kv-quant-start.*--kv-cache-dtype"):
        LLMEngine(head64[0], EngineConfig(kv_cache_gb=0.01, kv_quant_start=8))
    # no full-attention cache to keep first tokens of (Mamba-2: recurrent state only): refused, not ignored
    config = tiny_config("mamba2")
    path = save_model_dir(str(tmp_path / "mamba2"), config, make_mlx_lm_model(config, seed=1))
    with pytest.raises(ValueError, match="--kv-quant-start keeps the first tokens of full-attention caches"):
        LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int8", kv_quant_start=8))
