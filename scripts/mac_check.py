#!/usr/bin/env python
"""On a Mac: run macinfer's Metal kernels on the GPU, check them against the
reference path, print their bandwidth beside the chip's peak, and the timing table of
the paths chosen by measurement at load (`kernels/autotune.py`).

    make mac-check          # or: python scripts/mac_check.py

This cannot run on Linux (no Metal); there the same kernels are verified by
the CPU emulator in the test suite. Bandwidth counts the bytes a kernel must
read (K/V rows or quantized weights) once; a kernel near the chip's peak is
memory-bound as it should be.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Unified-memory bandwidth, GB/s, from Apple's published specifications.
PEAK_GBPS = {
    "M1": 68, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800, "M2": 100, "M2 Pro": 200, "M2 Max": 400,
    "M2 Ultra": 800, "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M3 Ultra": 819, "M4": 120, "M4 Pro": 273,
    "M4 Max": 546,
}


def chip_peak() -> tuple[str, float | None]:
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    name = str(info.get("device_name", "unknown"))
    best = max((k for k in PEAK_GBPS if k in name), key=len, default=None)
    return name, PEAK_GBPS.get(best) if best else None


def timeit(fn, repeats: int = 20) -> float:
    """The median seconds of evaluating `fn()`."""
    from macinfer.bench.step import median_ms

    return median_ms(lambda: mx.eval(fn()), repeats) / 1000


def check_attention(peak: float | None) -> bool:
    from macinfer.kv.decode_attention import block_heads, decode_mask, reference_decode_attention
    from macinfer.kernels.call import launch
    from macinfer.kernels.paged_attention import decode_calls

    ok = True
    bs, kvh, gqa, d = 16, 8, 4, 128
    print(f"\npaged decode attention (f16, block {bs}, {kvh} kv heads, GQA {gqa}, head dim {d})")
    print(f"{'batch':>6}{'context':>9}{'kernel ms':>11}{'reference ms':>14}{'GB/s':>8}{'% peak':>8}{'max err':>10}")
    for batch, ctx in [(1, 512), (1, 8192), (8, 2048), (32, 1024), (32, 4096)]:
        nblk = batch * (ctx // bs) + 1
        rng = np.random.default_rng(0)
        q = mx.array(rng.normal(size=(batch, kvh * gqa, d)).astype(np.float16))
        k = mx.array(rng.normal(size=(nblk, kvh, bs, d)).astype(np.float16))
        v = mx.array(rng.normal(size=(nblk, kvh, bs, d)).astype(np.float16))
        tables = mx.array(rng.permutation(nblk)[: batch * (ctx // bs)].reshape(batch, -1).astype(np.int32))
        lens = mx.array(np.full(batch, ctx, np.int32))
        scale = d**-0.5
        kernel = lambda: launch(decode_calls(q, k, v, tables, lens, scale, bs, ctx))  # noqa: E731
        heads, mask = block_heads(tables, kvh), decode_mask(lens, ctx)
        reference = lambda: reference_decode_attention(q, k, v, heads, mask, scale)  # noqa: E731
        err = float(mx.abs(kernel().astype(mx.float32) - reference().astype(mx.float32)).max())
        t_k, t_r = timeit(kernel), timeit(reference)
        gbps = 2 * batch * ctx * kvh * d * 2 / t_k / 1e9
        ok &= err < 1e-2
        pct = f"{100 * gbps / peak:.0f}%" if peak else "?"
        print(f"{batch:>6}{ctx:>9}{1e3 * t_k:>11.3f}{1e3 * t_r:>14.3f}{gbps:>8.1f}{pct:>8}{err:>10.2e}")
    return ok


def check_qmv(peak: float | None) -> bool:
    from macinfer.kernels.call import launch
    from macinfer.kernels.quantized import qmv_call

    ok = True
    K = N = 4096
    print(f"\nbatched qmv, 4-bit gs 64, {N}x{K} (vs mx.quantized_matmul)")
    print(f"{'rows':>6}{'kernel ms':>11}{'mlx ms':>9}{'speedup':>9}{'GB/s':>8}{'% peak':>8}{'max err':>10}")
    dense = nn.Linear(K, N, bias=False)
    dense.set_dtype(mx.float16)
    layer = nn.QuantizedLinear.from_linear(dense, 64, 4)
    mx.eval(layer.parameters())
    wbytes = layer.weight.nbytes + layer.scales.nbytes + layer.biases.nbytes
    for rows in (1, 2, 4, 8, 16, 32):
        x = mx.random.normal((rows, K)).astype(mx.float16)
        kernel = lambda: launch([qmv_call(x, layer)])  # noqa: E731
        ref = lambda: layer(x)  # noqa: E731
        err = float(mx.abs(kernel().astype(mx.float32) - ref().astype(mx.float32)).max())
        t_k, t_r = timeit(kernel), timeit(ref)
        gbps = wbytes * -(-rows // 8) / t_k / 1e9
        ok &= err < 0.5
        pct = f"{100 * gbps / peak:.0f}%" if peak else "?"
        print(f"{rows:>6}{1e3 * t_k:>11.3f}{1e3 * t_r:>9.3f}{t_r / t_k:>9.2f}{gbps:>8.1f}{pct:>8}{err:>10.2e}")
    return ok


def check_paths() -> None:
    """Load the bundled model with a fresh verdict cache, so every decision with two correct
    paths (Metal kernel or MLX's ops, fused or explicit attention ops, qmv kernel or
    quantized_matmul) and speculation's batch threshold are timed on this Mac; print the
    figures."""
    import os
    import tempfile

    os.environ["MACINFER_CACHE_DIR"] = tempfile.mkdtemp(prefix="macinfer-mac-check-")
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.kernels import autotune
    from macinfer.loading.loader import bundled_test_model

    engine = LLMEngine(bundled_test_model(), EngineConfig(kv_cache_gb=0.25, max_model_len=2048,
                                                          num_speculative_tokens=4))
    print("\npaths chosen by measurement (bundled SmolLM2, Q4_1; the verdict, then each path's time)")
    print(autotune.table())
    print("engine paths:", engine.paths.describe())
    # A verify step of k = 4 drafts (5 rows a sequence) against a plain step, by batch: the
    # largest batch whose verify step costs at most 1.5x speculates (`engine/spec_batch.py`).
    print("speculation: up to", engine.scheduler.speculative.max_batch, "decoding sequences draft")


def main() -> int:
    if not mx.metal.is_available():
        print("mac-check needs an Apple Silicon GPU (mx.metal.is_available() is False here).\n"
              "On this machine the kernels are verified by the CPU emulator: pytest tests/test_metal_kernels.py")
        return 1
    name, peak = chip_peak()
    print(f"device: {name}; peak memory bandwidth: {peak or 'unknown'} GB/s; mlx {mx.__version__}")
    ok = check_attention(peak) & check_qmv(peak)
    print("\nall kernels match the reference" if ok else "\nMISMATCH: see max err above")
    check_paths()
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
