"""The paged-attention Metal kernels, run from their exact generated source on the CPU.

MLX generates the full Metal source; the emulator compiles it with g++ against
macinfer/kernels/cpu_shim.h and runs the launch grid (one std::thread per GPU
thread). Results are checked against a float64 numpy reference. On a Mac the
same calls also run on the GPU (`test_metal_gpu_matches_reference`).
"""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from macinfer.kernels.emulator import capture_source, emulate, emulate_calls
from macinfer.kernels.call import launch
from macinfer.kernels.paged_attention import decode_calls
from tests.helpers import PAGED_BS, float64_decode_attention, paged_case

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")

BS = PAGED_BS


def calls_for(case, partition_size, window=None):
    q, kp, vp, tables, lens = case
    return decode_calls(mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables), mx.array(lens),
                        q.shape[-1] ** -0.5, BS, int(lens.max()), partition_size=partition_size, window=window)


GRID = [
    # (B, KVH, GQA, D, context lengths, partition size)
    (1, 1, 1, 64, [1], 512),
    (2, 2, 1, 64, [16, 33], 512),
    (3, 1, 3, 64, [7, 50, 129], 32),
    (2, 2, 4, 128, [17, 100], 512),
    (2, 1, 4, 128, [95, 300], 64),
    (4, 1, 8, 64, [3, 31, 64, 200], 48),
    (1, 2, 8, 128, [257], 128),
]


@pytest.mark.parametrize("B,KVH,GQA,D,lens,part", GRID)
def test_decode_kernel_matches_float64(B, KVH, GQA, D, lens, part):
    case = paged_case(B, KVH, GQA, D, lens)
    calls = calls_for(case, part)
    assert len(calls) == (1 if max(lens) <= part else 2)
    out, _ = emulate_calls(calls)
    assert not np.isnan(out).any(), "an output element was never written"
    np.testing.assert_allclose(out, float64_decode_attention(*case), atol=2e-5, rtol=1e-4)


# Sliding-window layers: the start bound, within one partition and across split-K partitions
# (whole partitions before the window contribute nothing).
WINDOWED = [
    (2, 2, 2, 64, [5, 70], 512, 16),
    (2, 1, 4, 64, [40, 300], 64, 100),
    (1, 2, 1, 128, [257], 32, 33),
]


@pytest.mark.parametrize("B,KVH,GQA,D,lens,part,window", WINDOWED)
def test_decode_kernel_sliding_window(B, KVH, GQA, D, lens, part, window):
    case = paged_case(B, KVH, GQA, D, lens)
    out, _ = emulate_calls(calls_for(case, part, window))
    np.testing.assert_allclose(out, float64_decode_attention(*case, window=window), atol=2e-5, rtol=1e-4)
    assert not np.allclose(out, float64_decode_attention(*case))  # the window changed the answer


# Multi-head latent attention: one KV "head" of latent + rope key (D), V its leading DV
# columns read from the same pool; DeepSeek V3's 512 + 64 puts 2 of its heads in a block.
MLA = [
    # (B, H, latent, rope, context lengths, partition size)
    (2, 16, 64, 32, [20, 90], 512),
    (3, 8, 128, 32, [1, 47, 130], 32),
    (1, 16, 512, 64, [40], 32),
]


@pytest.mark.parametrize("B,H,R,ROPE,lens,part", MLA)
def test_decode_kernel_latent_attention(B, H, R, ROPE, lens, part):
    q, kp, _, tables, lens_ = paged_case(B, 1, H, R + ROPE, lens)
    calls = decode_calls(mx.array(q), mx.array(kp), mx.array(kp), mx.array(tables), mx.array(lens_),
                         0.1, BS, max(lens), partition_size=part, v_dim=R)
    assert calls[0].template[5][1] < H or R < 512  # DeepSeek's width splits the heads into blocks
    out, _ = emulate_calls(calls)
    assert out.shape == (B, H, R) and not np.isnan(out).any()
    np.testing.assert_allclose(out, float64_decode_attention(q, kp, kp[..., :R], tables, lens_, scale=0.1),
                               atol=2e-5, rtol=1e-4)


def _quantized(pool: np.ndarray, bits: int, group: int):
    """A [num_blocks, kvh, bs, d] pool as the engine's quantized pools hold it (its packed
    (block, head) matrices), and its dequantized values (what the kernel must read)."""
    from macinfer.kv.cache import QuantizedBlocks

    nb, kvh, bs, d = pool.shape
    w, scales, biases = mx.quantize(mx.array(pool.reshape(-1, d)), group_size=group, bits=bits)
    back = np.array(mx.dequantize(w, scales, biases, group_size=group, bits=bits)).reshape(pool.shape)
    blocks = QuantizedBlocks(*(x.reshape(nb * kvh, bs, -1) for x in (w, scales, biases)), group, bits, d)
    return blocks, back.astype(np.float64)


# Quantized pools read in place: K and V bits (8, 4, 3: a 3-bit value straddles words; K8V4),
# their group sizes (8 bits: a row of 128 one group, its default), and the split-K launch
# (partition 32) for long contexts.
QUANTIZED = [
    # (k bits, v bits, k group, v group, B, KVH, GQA, D, context lengths, partition size)
    (8, 8, 64, 64, 2, 2, 2, 64, [16, 33], 512),
    (4, 4, 32, 32, 3, 1, 4, 128, [7, 50, 129], 32),
    (3, 3, 32, 32, 2, 2, 1, 64, [40, 90], 512),
    (8, 4, 128, 64, 2, 1, 4, 128, [95, 300], 64),
]


@pytest.mark.parametrize("kbits,vbits,kgroup,vgroup,B,KVH,GQA,D,lens,part", QUANTIZED)
def test_decode_kernel_reads_quantized_pools(kbits, vbits, kgroup, vgroup, B, KVH, GQA, D, lens, part):
    from macinfer.kernels.paged_attention import quantized_decode_calls

    q, kp, vp, tables, lens_ = paged_case(B, KVH, GQA, D, lens)
    kq, k_back = _quantized(kp, kbits, kgroup)
    vq, v_back = _quantized(vp, vbits, vgroup)
    calls = quantized_decode_calls(mx.array(q), kq, vq, KVH, mx.array(tables), mx.array(lens_), D**-0.5, BS,
                                   max(lens), partition_size=part)
    out, _ = emulate_calls(calls)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, float64_decode_attention(q, k_back, v_back, tables, lens_), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bits,bs,D,lens,part", [(4, 32, 64, [20, 90], 512), (3, 32, 128, [33, 200], 64),
                                                 (4, 64, 64, [70, 129], 64)])
def test_decode_kernel_reads_keys_stored_per_channel(bits, bs, D, lens, part):
    """Keys per channel (`int4c`): each (block, head) matrix [D, bs] packed by channel over
    the block's tokens, V by row; 3 bits straddle words, split-K over 64-token partitions."""
    from macinfer.kernels.paged_attention import quantized_decode_calls
    from macinfer.kv.cache import QuantizedBlocks

    q, kp, vp, tables, lens_ = paged_case(2, 2, 2, D, lens, bs=bs)
    nb = kp.shape[0]
    t = mx.array(kp.transpose(0, 1, 3, 2).reshape(-1, bs))  # a row per (block, head, channel)
    w, s, b = mx.quantize(t, group_size=bs, bits=bits)
    kq = QuantizedBlocks(*(x.reshape(nb * 2, D, -1) for x in (w, s, b)), bs, bits, bs, channels=True)
    k_back = np.array(mx.dequantize(w, s, b, group_size=bs, bits=bits)).reshape(nb, 2, D, bs).transpose(0, 1, 3, 2)
    vq, v_back = _quantized(vp, 4, 32)
    calls = quantized_decode_calls(mx.array(q), kq, vq, 2, mx.array(tables), mx.array(lens_), D**-0.5, bs,
                                   max(lens), partition_size=part)
    out, _ = emulate_calls(calls)
    np.testing.assert_allclose(out, float64_decode_attention(q, k_back.astype(np.float64), v_back, tables, lens_),
                               atol=2e-5, rtol=1e-4)


def test_decode_kernel_reads_quantized_latents():
    """MLA over a quantized latent pool: K = [latent, rope key] packed, V its leading columns."""
    from macinfer.kernels.paged_attention import quantized_decode_calls

    R, ROPE = 64, 32
    q, kp, _, tables, lens_ = paged_case(2, 1, 8, R + ROPE, [20, 90])
    kq, k_back = _quantized(kp, 8, 32)
    out, _ = emulate_calls(quantized_decode_calls(mx.array(q), kq, kq, 1, mx.array(tables), mx.array(lens_), 0.1, BS,
                                                  90, partition_size=32, v_dim=R))
    np.testing.assert_allclose(out, float64_decode_attention(q, k_back, k_back[..., :R], tables, lens_, scale=0.1),
                               atol=2e-5, rtol=1e-4)


def test_decode_kernel_float16():
    case = paged_case(2, 2, 4, 64, [40, 90], dtype=np.float16)
    out, _ = emulate_calls(calls_for(case, 32))
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), float64_decode_attention(*case), atol=5e-3, rtol=5e-3)


def test_clean_under_address_sanitizer():
    case = paged_case(2, 1, 4, 64, [20, 70])
    out, stderr = emulate_calls(calls_for(case, 32), sanitize="address")
    assert "AddressSanitizer" not in stderr
    np.testing.assert_allclose(out, float64_decode_attention(*case), atol=2e-5, rtol=1e-4)


def test_thread_sanitizer_is_clean_and_catches_a_missing_barrier():
    case = paged_case(1, 1, 2, 64, [40])
    call = calls_for(case, 512)[0]
    src = capture_source(call)
    clean = emulate(call, sanitize="thread", source=src)
    assert "ThreadSanitizer" not in clean.stderr
    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    assert barrier in src
    broken = emulate(call, sanitize="thread", source=src.replace(barrier, ""))
    assert "WARNING: ThreadSanitizer: data race" in broken.stderr


@pytest.mark.parametrize("kv", ["auto", "k8v4r", "int4c"])
def test_engine_output_with_emulated_kernels_equals_reference(tmp_path, monkeypatch, kv):
    """The whole engine with the decode kernel run by the emulator, over full-precision and
    quantized (rotated, keys per channel) KV pools, gives the reference path's logits and tokens."""
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=256)
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 60))]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)

    def run(mode):
        monkeypatch.setenv("MACINFER_KERNELS", mode)
        engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, max_num_batched_tokens=16, kv_cache_dtype=kv))
        logits = engine.score([list(range(30, 70)), list(range(3, 43))], [21, 12, 1, 1, 1])
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return logits, [done[i] for i in ids]

    ref_logits, ref_tokens = run("reference")
    emu_logits, emu_tokens = run("emulate")
    for a, b in zip(ref_logits, emu_logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    assert emu_tokens == ref_tokens


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal GPU (the emulated twin above runs everywhere)")
@pytest.mark.parametrize("B,H,R,ROPE,lens,part", MLA)
def test_metal_gpu_latent_attention(B, H, R, ROPE, lens, part):
    q, kp, _, tables, lens_ = paged_case(B, 1, H, R + ROPE, lens)
    out = np.array(launch(decode_calls(mx.array(q), mx.array(kp), mx.array(kp), mx.array(tables), mx.array(lens_),
                                       0.1, BS, max(lens), partition_size=part, v_dim=R)))
    np.testing.assert_allclose(out, float64_decode_attention(q, kp, kp[..., :R], tables, lens_, scale=0.1),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal GPU (the emulated twin above runs everywhere)")
@pytest.mark.parametrize("B,KVH,GQA,D,lens,part,window", [(*g, None) for g in GRID] + WINDOWED)
def test_metal_gpu_matches_reference(B, KVH, GQA, D, lens, part, window):
    case = paged_case(B, KVH, GQA, D, lens)
    out = np.array(launch(calls_for(case, part, window)))
    np.testing.assert_allclose(out, float64_decode_attention(*case, window=window), atol=2e-5, rtol=1e-4)
