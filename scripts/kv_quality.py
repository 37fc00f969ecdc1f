#!/usr/bin/env python
"""Quality of the quantized KV cache on real weights: perplexity over a fixed long text and
greedy agreement with the full-precision cache, per dtype, beside mlx-lm's QuantizedKVCache
(same bits, groups of 64, quantized from the first token) on the same float weights.

    python scripts/kv_quality.py [MODEL] [--tokens 2048] [--chunk 512] [--greedy 128] [--quant-start N]
                                 [--decode N]

`--decode N`: the text's last N tokens fed one at a time (the decode path: a block filled
row by row, which keys stored per channel (`int4c`) rewrite at each step), in both engines.

`--quant-start N`: each quantized dtype again with its first N tokens kept at full
precision (`--kv-quant-start`, rows "dtype/N"), beside mlx-lm's own `quantized_kv_start=N`
(a full-precision cache until it holds N tokens, then all of it quantized, checked after
each chunk as its `generate_step` does between steps).

The text: CPython's own documentation topics (`pydoc_data.topics`, sorted by name), which
every Python ships, cut to `--tokens` tokens. Each prompt chunk attends to the quantized
K/V of the chunks before it and of itself, in both engines.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import macinfer  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
import numpy as np

DTYPES = ("auto", "int8", "k8v4", "k8v4r", "int4", "int4r", "int4c", "int3", "int3r", "int3c")


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def nll(logits: np.ndarray, tokens: list[int]) -> float:
    """Mean negative log-likelihood of tokens[1:] under logits[:-1]."""
    lg = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    return float(np.mean(lse - lg[np.arange(len(tokens) - 1), tokens[1:]]))


def mlx_lm_logits(model, tokens: list[int], chunks: list[int], bits: int | None, start: int = 0,
                  group: int = 64) -> np.ndarray:
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    cache = make_prompt_cache(model) if bits is None or start else [QuantizedKVCache(group, bits) for _ in model.layers]
    out, i = [], 0
    for n in chunks:
        out.append(np.array(model(mx.array([tokens[i:i + n]]), cache=cache)[0].astype(mx.float32)))
        i += n
        if bits is not None and start:
            maybe_quantize_kv_cache(cache, start, group, bits)
    return np.concatenate(out)


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    """(share of positions equal, first position that differs or the length)."""
    same = [x == y for x, y in zip(a, b)]
    return sum(same) / len(same), same.index(False) if False in same else len(same)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--greedy", type=int, default=128)
    ap.add_argument("--quant-start", type=int, default=0)
    ap.add_argument("--decode", type=int, default=0, help="the last N tokens one at a time (the decode path)")
    ap.add_argument("--group-size", type=int, default=None, help="values per scale and bias (default 64)")
    ap.add_argument("--block-size", type=int, default=None, help="tokens a KV block (default: the dtype's)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated KV dtypes (auto is always run)")
    args = ap.parse_args()

    from mlx_lm import load as mlx_lm_load

    from macinfer.bench.common import same_weights_dir, versions
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.sampling_params import SamplingParams

    model_dir, weights = same_weights_dir(args.model)
    base = LLMEngine(model_dir, EngineConfig(kv_cache_gb=0.5, max_model_len=args.tokens + args.greedy + 16))
    tokens = base.tokenizer.encode(fixed_text())[: args.tokens]
    head = len(tokens) - args.decode
    chunks = [args.chunk] * (head // args.chunk) + ([head % args.chunk] if head % args.chunk else [])
    chunks += [1] * args.decode
    lm, _ = mlx_lm_load(model_dir)
    prompt = tokens[: args.tokens // 2]
    greedy = SamplingParams(temperature=0, max_tokens=args.greedy, ignore_eos=True)
    rows, reference = {}, None
    dtypes = ["auto"] + [d for d in args.dtypes.split(",") if d and d != "auto"]
    runs = [(d, 0) for d in dtypes] + ([(d, args.quant_start) for d in dtypes[1:]] if args.quant_start else [])
    for dtype, start in runs:
        engine = base if dtype == "auto" else LLMEngine(base.loaded, EngineConfig(
            kv_cache_gb=0.5, max_model_len=args.tokens + args.greedy + 16, kv_cache_dtype=dtype,
            kv_quant_start=start, kv_group_size=args.group_size, block_size=args.block_size))
        ours = nll(engine.score([tokens], chunks)[0], tokens)
        # mlx-lm has no rotated KV cache, no per-channel keys and one bit width for K and V: n/a
        theirs = None if dtype.endswith(("r", "c")) or dtype.startswith("k") else \
            nll(mlx_lm_logits(lm, tokens, chunks, None if dtype == "auto" else int(dtype[3:]), start,
                            args.group_size or 64), tokens)
        rid = engine.add_request(prompt, greedy)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        out = done[rid].token_ids
        reference = reference or out
        share, first = agreement(reference, out)
        rows[dtype + (f"/{start}" if start else "")] = {"ppl": float(np.exp(ours)), "mlx_lm_ppl": None if theirs is None else float(np.exp(theirs)),
                       "bytes_per_token": engine.cache_groups()[0]["bytes_per_token"],  # (past the first tokens)
                       "greedy_agreement": share, "first_difference": first}
    auto = rows["auto"]
    print(f"{args.model} ({weights}); {len(tokens)} tokens of CPython's pydoc topics, chunks of {args.chunk}"
          f"{f', the last {args.decode} one at a time' if args.decode else ''}; "
          f"greedy {args.greedy} tokens after the first {len(prompt)}")
    print(f"{'KV':<9}{'ppl':>9}{'Δppl':>9}{'mlx-lm ppl':>12}{'Δ mlx-lm':>10}{'bytes/tok':>11}{'greedy same':>13}"
          f"{'first diff':>12}")
    for dtype, r in rows.items():
        lm_cells = f"{'n/a':>12}{'':>10}" if r["mlx_lm_ppl"] is None else \
            f"{r['mlx_lm_ppl']:>12.3f}{100 * (r['mlx_lm_ppl'] / auto['mlx_lm_ppl'] - 1):>9.2f}%"
        print(f"{dtype:<9}{r['ppl']:>9.3f}{100 * (r['ppl'] / auto['ppl'] - 1):>8.2f}%{lm_cells}{r['bytes_per_token']:>11}"
              f"{100 * r['greedy_agreement']:>12.0f}%{r['first_difference']:>12}")
    print(json.dumps({"model": args.model, "weights": weights, "tokens": len(tokens), "chunk": args.chunk,
                      "decode": args.decode,
                      "python": platform.python_version(), **versions(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
