#!/usr/bin/env python
"""Decode speed with a quantized KV cache: N conversations of L prompt tokens each,
decoded together, with int8 / int4 KV against the full-precision cache; and one stream at
that context against mlx-lm's `generate_step(kv_bits=...)` on the same float weights (its
batched generator takes no quantized cache). Every configuration runs in a process of its
own, taking turns; medians over repeats; greedy, so each dtype's tokens are its own.

    python scripts/bench_kv_quant.py [MODEL]   # from the repository's root [--conversations 8] [--context 2048] [--new 32]
                                                # [--dtypes auto,int8,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `scripts.` from the repo root
import macinfer  # noqa: F401,E402  (OpenBLAS before MLX)

DTYPES = ("auto", "int8", "k8v4r", "int4", "int4r", "int4c")
MLX_LM_BITS = {"auto": None, "int8": 8, "int4": 4}  # mlx-lm has one bit width for K and V, no rotation


class MlxLmStream:
    """mlx-lm's one-stream decode with its quantized KV cache, in its own process."""

    def __init__(self, model_dir: str):
        from mlx_lm import load

        self.model, _ = load(model_dir)

    def run(self, prompt: list[int], new: int, bits: int | None) -> float:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        kw = {} if bits is None else {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0}
        first, n = None, 0
        for _ in generate_step(mx.array(prompt), self.model, max_tokens=new, sampler=lambda x: mx.argmax(x, -1), **kw):
            first = first or time.perf_counter()
            n += 1
        return (n - 1) / (time.perf_counter() - first)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated KV dtypes (auto is always run)")
    args = ap.parse_args()
    dtypes = ["auto"] + [d for d in args.dtypes.split(",") if d and d != "auto"]

    from macinfer.bench.common import hardware, same_weights_dir, versions
    from macinfer.bench.isolated import Isolated
    from macinfer.loading.loader import load
    from scripts.kv_quality import fixed_text

    model_dir, weights = same_weights_dir(args.model)
    ids = load(model_dir).tokenizer.encode(fixed_text())
    n, L = args.conversations, args.context
    prompts = [ids[i * 997: i * 997 + L] for i in range(n)]  # overlapping windows of the text: no shared prefix
    base = {"max_num_seqs": n, "kv_cache_gb": 1.0, "enable_prefix_caching": False, "max_model_len": L + args.new + 16}
    engines = {d: Isolated("macinfer.bench.batch:MacinferBatch", model_dir, {**base, "kv_cache_dtype": d}, name=d)
               for d in dtypes}
    lm = Isolated("scripts.bench_kv_quant:MlxLmStream", model_dir, name="mlx-lm")
    batch = {d: [] for d in dtypes}
    single = {d: [] for d in dtypes}
    lm_single = {d: [] for d in MLX_LM_BITS if d in dtypes}
    try:
        for _ in range(args.repeats):  # configurations take turns: a drift in the machine's speed hits all alike
            for d, e in engines.items():
                r = e.run(prompts, args.new)
                batch[d].append(r["decode_tokens"] / r["decode_seconds"])
                r = e.run(prompts[:1], args.new)
                single[d].append(r["decode_tokens"] / r["decode_seconds"])
                if d in lm_single:
                    lm_single[d].append(lm.run(prompts[0], args.new, MLX_LM_BITS[d]))
    finally:
        for p in (*engines.values(), lm):
            p.close()
    med = {k: {d: statistics.median(v) for d, v in t.items()} for k, t in
           (("batch", batch), ("single", single), ("mlx_lm_single", lm_single))}
    print(f"{args.model} ({weights}); {n} conversations x {L} prompt tokens, {args.new} new tokens each; "
          f"medians of {args.repeats}")
    print(f"{'KV':<6}{f'{n} x {L} tok/s':>16}{'vs auto':>9}{'1 stream':>10}{'mlx-lm 1 stream':>17}{'vs mlx-lm':>11}")
    for d in dtypes:
        lm_cells = f"{med['mlx_lm_single'][d]:>17.1f}{med['single'][d] / med['mlx_lm_single'][d]:>10.2f}x" \
            if d in lm_single else f"{'n/a':>17}{'':>11}"
        print(f"{d:<6}{med['batch'][d]:>16.1f}{med['batch'][d] / med['batch']['auto']:>8.2f}x{med['single'][d]:>10.1f}"
              f"{lm_cells}")
    print(json.dumps({"model": args.model, "weights": weights, "conversations": n, "context": L, "new": args.new,
                      "hardware": hardware(), **versions(), "tok_s": med}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
