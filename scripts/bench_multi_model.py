#!/usr/bin/env python
"""Two models decoding at once against one alone, through the server's step threads.

    python scripts/bench_multi_model.py [--streams 8] [--tokens 64] [--repeats 3]
    python scripts/bench_multi_model.py --memory    # what a load and an idle unload do to memory

Two engines of the bundled SmolLM2 (135M, Q4_1 GGUF expanded to f32 on the CPU; two
copies, as two different models of that size would be) each run in its own
`AsyncEngine` thread, the way `macinfer serve A B` runs them. They take turns on the
device (`async_engine.DEVICE`: one step at a time, first come first served). Measured:
`--streams` greedy requests of `--tokens` new tokens (64-token prompts) on model A alone,
then the same on A and B at once: each model's tokens/s, the total, and the TPOT
percentiles a client of each model sees. Medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


async def _stream(ae, ids, params, name):
    stream = ae.submit(ids, [params], name)
    start = time.perf_counter()
    stamps = []
    async for _, out in stream:
        stamps.append(time.perf_counter())
        if out.finished:
            break
    stream.close()
    return start, stamps


async def _run(engines, streams, tokens, prompt):
    from macinfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    jobs = [_stream(ae, prompt, params, f"{n}-{i}") for n, ae in engines.items() for i in range(streams)]
    res = await asyncio.gather(*jobs)
    wall = time.perf_counter() - start
    out = {}
    for k, name in enumerate(engines):
        mine = res[k * streams:(k + 1) * streams]
        end = max(s[-1] for _, s in mine)
        first = min(s[0] for _, s in mine)
        gaps = sorted(b - a for _, s in mine for a, b in zip(s, s[1:]))
        out[name] = {"tok_s": streams * tokens / (end - start), "decode_tok_s": streams * (tokens - 1) / (end - first),
                     "itl_p50_ms": 1e3 * gaps[len(gaps) // 2], "itl_p95_ms": 1e3 * gaps[int(0.95 * len(gaps))],
                     "itl_p99_ms": 1e3 * gaps[int(0.99 * len(gaps))]}
    out["total_tok_s"] = len(engines) * streams * tokens / wall
    return out


def memory_roundtrip() -> None:
    """A model loaded by a request, then unloaded by a 1 s idle TTL, through the server's
    pool: MLX's active memory and the process's RSS before, loaded, after (Linux /proc)."""
    import gc

    import httpx
    import mlx.core as mx

    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.loading.loader import bundled_test_model
    from macinfer.server.app import create_app
    from macinfer.server.model_pool import ModelPool, ModelSource

    def now() -> str:
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return f"MLX active {mx.get_active_memory() / 2**20:7.1f} MiB, RSS {rss / 2**20:7.1f} MiB"

    path = bundled_test_model()
    pool = ModelPool([ModelSource("a", path), ModelSource("b", path)],
                     lambda src: LLMEngine(src.path, EngineConfig(kv_cache_gb=0.25, max_model_len=2048)), idle_ttl=1)
    app = create_app(pool)

    async def run() -> None:
        pool.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300) as c:
            print("before the first load:  ", now())
            start = time.perf_counter()
            await c.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 8})
            print(f"loaded ({time.perf_counter() - start:.1f} s):       ", now(),
                  f"(weights + KV: {pool.entries['b'].known_bytes / 2**20:.1f} MiB)")
            while pool.entries["b"].state != "unloaded":
                await asyncio.sleep(0.2)
            gc.collect()
            print("after the idle unload:  ", now())
        pool.shutdown()

    print("SmolLM2-135M (bundled Q4_1 GGUF, f32 on the CPU), 0.25 GiB KV cache, idle TTL 1 s")
    asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="measure a load and an idle unload instead")
    args = ap.parse_args()
    if args.memory:
        return memory_roundtrip()

    import mlx.core as mx

    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.loading.loader import bundled_test_model
    from macinfer.server.async_engine import AsyncEngine

    path = bundled_test_model()
    cfg = lambda: EngineConfig(kv_cache_gb=0.25, max_model_len=1024, max_num_seqs=max(8, args.streams))  # noqa: E731
    engines = {n: AsyncEngine(LLMEngine(path, cfg()), max_pending=256) for n in ("A", "B")}
    prompt = engines["A"].engine.tokenizer.encode("The history of the city of Paris, told briefly: " * 8)[:64]
    asyncio.run(_run({"A": engines["A"]}, 2, 8, prompt))  # warm both
    asyncio.run(_run({"B": engines["B"]}, 2, 8, prompt))
    rows = {"A alone": [], "A and B at once": []}
    for _ in range(args.repeats):  # interleaved, so drift hits both equally
        rows["A alone"].append(asyncio.run(_run({"A": engines["A"]}, args.streams, args.tokens, prompt)))
        rows["A and B at once"].append(asyncio.run(_run(engines, args.streams, args.tokens, prompt)))
    for ae in engines.values():
        ae.shutdown()

    def med(runs, *keys):
        vals = []
        for r in runs:
            for k in keys[:-1]:
                r = r[k]
            vals.append(r[keys[-1]])
        return statistics.median(vals)

    print(f"SmolLM2-135M (bundled Q4_1 GGUF, f32 on {mx.default_device()}), MLX {mx.__version__}, "
          f"{platform.machine()} {os.cpu_count()} cores; {args.streams} streams a model, 64-token prompts, "
          f"{args.tokens} new tokens, greedy; medians of {args.repeats}")
    print(f"{'':18} {'model':>5} {'tok/s':>8} {'decode tok/s':>13} {'ITL p50':>8} {'p95':>7} {'p99':>7} {'total tok/s':>12}")
    for label, runs in rows.items():
        for name in runs[0]:
            if name == "total_tok_s":
                continue
            print(f"{label:18} {name:>5} {med(runs, name, 'tok_s'):8.1f} {med(runs, name, 'decode_tok_s'):13.1f} "
                  f"{med(runs, name, 'itl_p50_ms'):6.1f}ms {med(runs, name, 'itl_p95_ms'):5.1f}ms "
                  f"{med(runs, name, 'itl_p99_ms'):5.1f}ms {med(runs, 'total_tok_s'):12.1f}")


if __name__ == "__main__":
    main()
