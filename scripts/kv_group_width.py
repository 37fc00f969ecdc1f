#!/usr/bin/env python
"""How wide a quantized KV row's group may be: perplexity on real weights with each token's
K and V rounded (quantized and dequantized, min-max affine) in groups of W values, where a
group may span several KV heads of the token. SmolLM2's heads are 64 wide, so a 128-wide
group of a Llama-sized head cannot be run on it directly; groups spanning its three heads
(192 values, wider than 128 and mixing heads' ranges) bound that case from above.

    python scripts/kv_group_width.py [MODEL] [--tokens 2048] [--chunk 512] [--bits 8,4] [--widths 64,192]

mlx-lm's model and KVCache on macinfer's float weights (`same_weights_dir`); the text and
chunks of `scripts/kv_quality.py`.
"""

from __future__ import annotations

import argparse
import json
import sys

import macinfer  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
import numpy as np
from kv_quality import fixed_text, nll


def rounded(x: mx.array, width: int, bits: int) -> mx.array:
    """x [B, H, T, D] with each token's H*D values rounded in groups of `width` (min-max affine)."""
    b, h, t, d = x.shape
    rows = x.transpose(0, 2, 1, 3).reshape(b, t, -1, width).astype(mx.float32)
    lo, hi = rows.min(-1, keepdims=True), rows.max(-1, keepdims=True)
    scale = mx.maximum(hi - lo, 1e-8) / (2**bits - 1)
    back = mx.round((rows - lo) / scale) * scale + lo
    return back.reshape(b, t, h, d).transpose(0, 2, 1, 3).astype(x.dtype)


def make_cache(width: int, bits: int):
    from mlx_lm.models.cache import KVCache

    class RoundedKVCache(KVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(rounded(keys, width, bits), rounded(values, width, bits))

    return RoundedKVCache


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--widths", default="64,192", help="values per group (a multiple of the head size spans heads)")
    args = ap.parse_args()

    from mlx_lm import load as mlx_lm_load
    from mlx_lm.models.cache import make_prompt_cache

    from macinfer.bench.common import same_weights_dir

    model_dir, weights = same_weights_dir(args.model)
    lm, tok = mlx_lm_load(model_dir)
    tokens = tok.encode(fixed_text())[: args.tokens]

    def ppl(cache) -> float:
        out = [np.array(lm(mx.array([tokens[i:i + args.chunk]]), cache=cache)[0].astype(mx.float32))
               for i in range(0, len(tokens), args.chunk)]
        return float(np.exp(nll(np.concatenate(out), tokens)))

    base = ppl(make_prompt_cache(lm))
    rows = {}
    print(f"{args.model} ({weights}), {len(tokens)} tokens in chunks of {args.chunk}; fp ppl {base:.3f}")
    print(f"{'bits':>4}{'width':>7}{'ppl':>9}{'Δppl':>9}")
    for bits in map(int, args.bits.split(",")):
        for width in map(int, args.widths.split(",")):
            cls = make_cache(width, bits)
            p = ppl([cls() for _ in lm.layers])
            rows[f"{bits}/{width}"] = p
            print(f"{bits:>4}{width:>7}{p:>9.3f}{100 * (p / base - 1):>8.2f}%")
    print(json.dumps({"model": args.model, "weights": weights, "tokens": len(tokens), "fp": base, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
