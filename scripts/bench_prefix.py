#!/usr/bin/env python
"""Prefix-caching benchmark: TTFT when prompts share prefixes.

Scenarios, each against `macinfer serve` with prefix caching on, with it off,
and `mlx_lm.server` (its own prompt cache), same model, same run:
  multi-turn  one conversation of --turns turns; every turn resends the whole history
  shared-sys  --clients requests sharing a long system prompt, sent at once

    python scripts/bench_prefix.py                 # bundled SmolLM2 Q4_1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_engine import hardware, save_results  # noqa: E402
from bench_serve import Server, free_port, peak_rss_gb, sse_events  # noqa: E402

SYSTEM = ("You are the support assistant of a hardware store. Be precise, friendly and brief. "
          "Policies: returns within 30 days with receipt; no returns on cut lumber or mixed paint; "
          "price matching against local stores only; delivery is free above 99 dollars; "
          "tool rental requires a deposit and an ID; the store opens at 7 and closes at 21. ")
QUESTIONS = ["Can I return paint?", "When do you open?", "Do you deliver?", "Can I rent a drill?",
             "Do you price match online stores?", "Can I return a hammer?", "Is delivery free?",
             "What ID do I need?", "Can I return cut wood?", "When do you close?", "Do you sell nails?",
             "Is there a deposit?", "How long do returns last?", "Do you match prices?",
             "Can I pay by card?", "Where is the store?"]


async def chat_ttft(client, url, model, messages, max_tokens) -> tuple[float, str, int]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, text, cached = time.perf_counter(), None, [], 0
    async for data in sse_events(client, f"{url}/v1/chat/completions", body):
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) or cached
        for c in data.get("choices", []):
            if c.get("delta", {}).get("content"):
                ttft = ttft or time.perf_counter() - start
                text.append(c["delta"]["content"])
    return ttft or time.perf_counter() - start, "".join(text), cached


async def warm_up(url, model) -> None:
    """One unrelated request, so no scenario pays first-call costs or finds its prefix cached."""
    async with httpx.AsyncClient(timeout=600) as c:
        await chat_ttft(c, url, model, [{"role": "user", "content": "Warm up."}], 2)


async def multi_turn(url, model, turns, max_tokens) -> dict:
    messages = [{"role": "system", "content": SYSTEM * 3}]
    ttfts, cached = [], []
    async with httpx.AsyncClient(timeout=600) as c:
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            ttft, text, hit = await chat_ttft(c, url, model, messages, max_tokens)
            messages.append({"role": "assistant", "content": text})
            ttfts.append(ttft)
            cached.append(hit)
    return {"ttft_per_turn": ttfts, "ttft_turns_2plus_mean": statistics.fmean(ttfts[1:] or ttfts), "cached_tokens_per_turn": cached}


async def shared_system(url, model, clients, max_tokens) -> dict:
    async with httpx.AsyncClient(timeout=600) as c:
        res = await asyncio.gather(*(chat_ttft(c, url, model, [{"role": "system", "content": SYSTEM * 4},
                                                               {"role": "user", "content": q}], max_tokens)
                                     for q in (QUESTIONS * 4)[:clients]), return_exceptions=True)
    failed = [r for r in res if isinstance(r, BaseException)]
    res = [r for r in res if not isinstance(r, BaseException)]
    if not res:
        raise RuntimeError(f"all {clients} requests failed: {failed[0]!r}")
    ttfts = [r[0] for r in res]
    return {"ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p95": float(np.percentile(ttfts, 95)),
            "ttft_p99": float(np.percentile(ttfts, 99)), "ttft_mean": statistics.fmean(ttfts),
            "cached_tokens_mean": statistics.fmean(r[2] for r in res), "failed_requests": len(failed),
            "failure": repr(failed[0]) if failed else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--servers", nargs="+", default=["macinfer", "macinfer-nocache", "mlx-lm"])
    ap.add_argument("--out", default="bench_results/bench_prefix.json")
    args = ap.parse_args()

    import mlx.core as mx
    import mlx_lm

    import macinfer
    from macinfer.convert import convert_gguf
    from macinfer.loader import bundled_test_model

    model = args.model or bundled_test_model()
    mlx_dir = convert_gguf(model, tempfile.mkdtemp(prefix="macinfer-bench-")) if model.endswith(".gguf") else model
    results: dict = {"context": {"model": os.path.basename(model), "macinfer": macinfer.__version__, "mlx": mx.__version__,
                                 "mlx_lm": mlx_lm.__version__, "hardware": hardware(), "turns": args.turns,
                                 "clients": args.clients, "max_tokens": args.max_tokens}, "servers": {}}
    for name in args.servers:
        port = free_port()
        if name.startswith("macinfer"):
            cmd = [sys.executable, "-m", "macinfer.cli", "serve", model, "--port", str(port), "--served-model-name", "bench",
                   "--kv-cache-gb", "0.5", "--max-num-seqs", "32"]
            if name.endswith("nocache"):
                cmd.append("--no-prefix-caching")
            served = "bench"
        else:
            cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", mlx_dir, "--port", str(port), "--log-level", "ERROR"]
            served = mlx_dir
        server = Server(name, cmd, port)
        try:
            asyncio.run(warm_up(server.url, served))
            r = {"multi_turn": asyncio.run(multi_turn(server.url, served, args.turns, args.max_tokens)),
                 "shared_system": asyncio.run(shared_system(server.url, served, args.clients, args.max_tokens))}
            r["peak_rss_gb"] = peak_rss_gb(server.proc.pid)
            results["servers"][name] = r
            print(f"done: {name}", flush=True)
        finally:
            server.stop()

    names = list(results["servers"])
    print(f"\n{'metric':<34}" + "".join(f"{n:>18}" for n in names))
    rows = [(f"multi-turn TTFT turn {i + 1} (s)", lambda r, i=i: r["multi_turn"]["ttft_per_turn"][i]) for i in range(args.turns)]
    rows += [("multi-turn TTFT turns 2+ mean (s)", lambda r: r["multi_turn"]["ttft_turns_2plus_mean"]),
             (f"shared-sys x{args.clients} TTFT p50 (s)", lambda r: r["shared_system"]["ttft_p50"]),
             (f"shared-sys x{args.clients} TTFT p95 (s)", lambda r: r["shared_system"]["ttft_p95"]),
             (f"shared-sys x{args.clients} TTFT p99 (s)", lambda r: r["shared_system"]["ttft_p99"]),
             ("shared-sys cached tokens mean", lambda r: r["shared_system"]["cached_tokens_mean"]),
             ("shared-sys failed requests", lambda r: r["shared_system"]["failed_requests"]),
             ("peak RSS (GB)", lambda r: r["peak_rss_gb"] or 0.0)]
    for label, get in rows:
        print(f"{label:<34}" + "".join(f"{get(results['servers'][n]):>18.3f}" for n in names))
    save_results(results, args.out)


if __name__ == "__main__":
    main()
