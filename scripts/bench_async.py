#!/usr/bin/env python
"""Async scheduling on and off (`engine/lookahead.py`): the same offline batches through
two engines sharing one loaded model, in turns, medians of `--repeats`.

    python scripts/bench_async.py [--concurrency 32 --concurrency 1] [--split-cores]

Greedy, EOS ignored, 32-token random prompts, 32 new tokens: the first step's time (the
prompts), the median decode step and tokens per second. `--split-cores` puts the host
thread on core 0 and MLX's CPU worker (with OpenBLAS at one thread, so the BLAS work too)
on core 1: a device beside the host, as a GPU is, so what overlapping them hides shows.
Without it both share the cores, and MLX's CPU backend returns from `mx.async_eval` only
near a graph's end, so little can.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def split_cores() -> None:
    """MLX's CPU worker thread starts on core 1 and stays; this thread moves to core 0."""
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":  # BLAS threads are made at load: restart with it set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    os.sched_setaffinity(0, {1})
    import mlx.core as mx

    mx.eval(mx.ones(4) + 1)
    os.sched_setaffinity(0, {0})


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--concurrency", type=int, action="append", default=None)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--split-cores", action="store_true", help="host on core 0, MLX's worker on core 1")
    args = ap.parse_args()
    if args.split_cores:
        split_cores()
    import numpy as np

    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.loading.loader import bundled_test_model, load
    from macinfer.sampling_params import SamplingParams

    loaded = load(args.model or bundled_test_model())
    engines = {on: LLMEngine(loaded, EngineConfig(max_num_seqs=32, kv_cache_gb=1.0, max_num_batched_tokens=2048,
                                                  enable_prefix_caching=False, async_scheduling=on))
               for on in (False, True)}
    vocab = engines[True].model.args.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    print(f"{os.path.basename(str(loaded.source))}: 32-token prompts, 32 new tokens, greedy; medians of "
          f"{args.repeats}" + ("; host on core 0, MLX's worker on core 1" if args.split_cores else ""))
    for c in args.concurrency or [32, 1]:
        runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for _ in range(args.repeats + 1):  # the first round warms up
            prompts = [rng.integers(100, vocab - 100, size=32).tolist() for _ in range(c)]
            for on, engine in engines.items():
                for p in prompts:
                    engine.add_request(p, params)
                steps, start = [], time.perf_counter()
                while engine.has_unfinished_requests():
                    t = time.perf_counter()
                    engine.step()
                    steps.append(time.perf_counter() - t)
                runs[on].append((time.perf_counter() - start, steps[0], statistics.median(steps[1:])))
        for on, rs in runs.items():
            rs = rs[1:]
            total, first, step = (statistics.median(r[i] for r in rs) for i in range(3))
            print(f"  {c:>3} sequences, async {'on ' if on else 'off'}: {c * 32 / total:7.1f} tok/s, first step "
                  f"{first * 1e3:6.0f} ms, decode step {step * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
