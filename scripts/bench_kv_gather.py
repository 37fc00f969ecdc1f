#!/usr/bin/env python
"""The decode's per-block product on its own, float against quantized blocks: MLX's
`gather_mm` over float (block, head) matrices, `gather_qmm` over packed ones (what the
quantized decode reads), and a dequantized copy then `gather_mm`, at SmolLM2's shapes for N
conversations x L context (3 KV heads of 64, 3 queries a head), for several block sizes.
Medians of 20 evaluations, milliseconds a layer's key product.

    python scripts/bench_kv_gather.py [--conversations 8] [--context 2048]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import macinfer  # noqa: F401,E402  (OpenBLAS before MLX)
import mlx.core as mx  # noqa: E402

from macinfer.bench.step import median_ms as _median_ms  # noqa: E402


def median_ms(f, n: int = 20) -> float:
    return _median_ms(lambda: mx.eval(f()), n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    args = ap.parse_args()
    B, ctx, kvh, g, d = args.conversations, args.context, 3, 3, 64
    print(f"mlx {mx.__version__}, {B} x {ctx}, {kvh} KV heads of {d}, {g} queries a head")
    print(f"{'block':>6}{'float':>9}{'q8':>9}{'q4':>9}{'deq8+mm':>10}{'deq4+mm':>10}")
    for bs in (16, 32, 64, 128):
        nb = ctx // bs
        mats = mx.random.normal((B * nb * kvh, bs, d))
        heads = (mx.arange(B * nb).reshape(B, nb, 1) * kvh + mx.arange(kvh).reshape(1, 1, kvh)).astype(mx.uint32)
        q = mx.random.normal((B, 1, kvh, g, d))
        row = [median_ms(lambda: mx.gather_mm(q, mats.swapaxes(-1, -2), None, heads))]
        packed = {bits: mx.quantize(mats, group_size=64, bits=bits) for bits in (8, 4)}
        for bits, (w, s, b) in packed.items():
            row.append(median_ms(lambda: mx.gather_qmm(q, w, s, b, rhs_indices=heads, transpose=True, group_size=64,
                                                       bits=bits)))
        for bits, (w, s, b) in packed.items():
            row.append(median_ms(lambda: mx.gather_mm(q, mx.dequantize(w, s, b, group_size=64, bits=bits)
                                                      .swapaxes(-1, -2), None, heads)))
        print(f"{bs:>6}" + "".join(f"{v:>9.2f}" if i < 3 else f"{v:>10.2f}" for i, v in enumerate(row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
