#!/usr/bin/env python
"""Decode step time against context length and batch size: macinfer's paged engine
against mlx-lm's own model and KV cache, same weights (mlx-lm gets the float32
expansion macinfer runs on the CPU), same run, medians. The caches are filled with
random K/V (attention cost does not depend on the values), so long contexts need
no prefill. Also reports macinfer's host time to build a step's graph.

    python scripts/decode_scaling.py                        # bundled SmolLM2
    python scripts/decode_scaling.py --points 1x128 16x1024 64x128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache

from macinfer.bench.common import hardware, same_weights_dir, versions
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.sequence import Sequence
from macinfer.loader import bundled_test_model
from macinfer.sampling_params import SamplingParams


def _median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def macinfer_step(engine: LLMEngine, B: int, L: int, repeats: int) -> tuple[float, float]:
    seqs = [Sequence(f"s{i}", [5] * L, SamplingParams(temperature=0), 0) for i in range(B)]
    for s in seqs:
        engine.block_manager.allocate(s, L + 1)
        s.num_computed_tokens = L
        s.output_token_ids.append(7)
    host = []

    def step():
        t = time.perf_counter()
        ids, meta, rows, _ = engine.runner.prepare([(s, 1) for s in seqs])
        logits = engine.model.logits(engine.model(ids, meta)[mx.array(rows)])
        host.append(time.perf_counter() - t)
        mx.eval(mx.argmax(logits, axis=-1), *engine.kv_cache.state())

    try:
        ms = _median_ms(step, repeats)
    finally:
        for s in seqs:
            engine.block_manager.free(s)
    return ms, 1000 * statistics.median(host)


def mlx_lm_step(model, B: int, L: int, repeats: int) -> float:
    cache = make_prompt_cache(model)
    for c, layer in zip(cache, model.layers):
        attn = layer.self_attn
        kvh, d = attn.n_kv_heads, attn.head_dim if hasattr(attn, "head_dim") else model.args.head_dim
        c.update_and_fetch(mx.random.normal((B, kvh, L, d)), mx.random.normal((B, kvh, L, d)))
    mx.eval([c.state for c in cache])
    tokens = mx.full((B, 1), 7, dtype=mx.int32)

    def step():
        logits = model(tokens, cache=cache)
        mx.eval(mx.argmax(logits[:, -1], axis=-1), [c.state for c in cache])
        for c in cache:  # stay at context L
            c.offset -= 1

    return _median_ms(step, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--points", nargs="+", default=["1x128", "1x1024", "1x4096", "1x8192", "4x1024", "16x1024",
                                                     "16x4096", "64x128"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = args.model or bundled_test_model()
    points = [tuple(int(x) for x in p.split("x")) for p in args.points]
    need = max(B * (L + 16) for B, L in points)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max(B for B, _ in points), max_model_len=max(L for _, L in points) + 16,
                                           kv_cache_gb=None, enable_prefix_caching=False,
                                           num_kv_blocks=need // 16 + 64))
    lm, _ = mlx_lm_load(same_weights_dir(model)[0])
    rows = []
    for B, L in points:
        ours, host = macinfer_step(engine, B, L, args.repeats)
        theirs = mlx_lm_step(lm, B, L, args.repeats)
        rows.append({"batch": B, "context": L, "macinfer_ms": ours, "mlx_lm_ms": theirs, "ratio": ours / theirs,
                     "macinfer_host_ms": host})
        print(f"batch {B:>3} context {L:>5}: macinfer {ours:8.1f} ms (host {host:5.2f} ms)   "
              f"mlx-lm {theirs:8.1f} ms   ratio {ours / theirs:5.2f}", flush=True)
    print(json.dumps({"model": model, **versions(), "hardware": hardware()["chip"], "rows": rows}))


if __name__ == "__main__":
    main()
