#!/usr/bin/env python
"""Online serving benchmark: `macinfer serve` vs `mlx_lm.server`, same model, same run.

Each server is started as its own process on a loopback port and loaded with
streaming /v1/completions requests, at fixed concurrency levels and in a
Poisson-arrival mode. Reported per level: TTFT, TPOT and end-to-end latency
(p50/p95/p99), output throughput, and the server's peak RSS.

    python scripts/bench_serve.py                         # bundled SmolLM2 Q4_1
    python scripts/bench_serve.py --concurrency 1 4 16 --rate 2 --requests-per-level 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_engine import hardware, save_results  # noqa: E402

PROMPTS = [
    "Once upon a time, in a village by the sea,", "The history of the Roman Empire begins",
    "Here is a recipe for bread:", "The three laws of motion are", "In the year 2150, humanity",
    "A short guide to gardening:", "The best way to learn a language is", "Dear diary, today I",
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_gb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    try:  # macOS: current RSS, sampled at the end
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout
        return int(out.strip()) / 2**20
    except (ValueError, OSError):
        return None


class Server:
    def __init__(self, name: str, cmd: list[str], port: int):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                httpx.get(f"{self.url}/v1/models", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.5)
        raise TimeoutError(f"{name} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def sse_events(client: httpx.AsyncClient, url: str, body: dict):
    """The JSON payloads of one streaming request's server-sent events."""
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens, chunks = None, 0, 0
    async for data in sse_events(client, f"{url}/v1/completions", body):
        if data.get("usage"):
            tokens = data["usage"]["completion_tokens"]
        if data.get("choices") and data["choices"][0].get("text"):
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - start
    e2e = time.perf_counter() - start
    tokens = tokens or chunks
    return {"ttft": ttft or e2e, "e2e": e2e, "tokens": tokens,
            "tpot": (e2e - (ttft or e2e)) / (tokens - 1) if tokens > 1 else None}


async def run_level(url: str, model: str, n: int, max_tokens: int, concurrency: int | None, rate: float | None) -> dict:
    rng = random.Random(0)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    sem = asyncio.Semaphore(concurrency or n)
    async with httpx.AsyncClient(timeout=600) as client:
        async def guarded(p, delay):
            await asyncio.sleep(delay)
            async with sem:
                return await one_request(client, url, model, p, max_tokens)

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if rate:
                t += rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(p, d) for p, d in zip(prompts, delays)))
        wall = time.perf_counter() - start

    def pct(key):
        vals = [r[key] for r in results if r[key] is not None]
        if not vals:
            return {}
        return {f"{key}_p50": float(np.percentile(vals, 50)), f"{key}_p95": float(np.percentile(vals, 95)),
                f"{key}_p99": float(np.percentile(vals, 99)), f"{key}_mean": statistics.fmean(vals)}

    out = {"requests": n, "wall_s": wall, "output_tokens": sum(r["tokens"] for r in results)}
    out["throughput_tok_s"] = out["output_tokens"] / wall
    for k in ("ttft", "tpot", "e2e"):
        out.update(pct(k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF or MLX dir (default: bundled SmolLM2 Q4_1)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (0: skip)")
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: 2 x concurrency (min 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--servers", nargs="+", default=["macinfer", "mlx-lm"])
    ap.add_argument("--out", default="bench_results/bench_serve.json")
    args = ap.parse_args()

    import mlx.core as mx
    import mlx_lm

    import macinfer
    from macinfer.convert import convert_gguf
    from macinfer.loader import bundled_test_model

    model = args.model or bundled_test_model()
    mlx_dir = convert_gguf(model, tempfile.mkdtemp(prefix="macinfer-bench-")) if model.endswith(".gguf") else model
    levels = [(f"c{c}", c, None, args.requests_per_level or max(4, 2 * c)) for c in args.concurrency]
    if args.rate:
        levels.append((f"poisson{args.rate:g}", None, args.rate, args.requests_per_level or 16))
    results: dict = {"context": {
        "model": os.path.basename(model), "macinfer": macinfer.__version__, "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__, "hardware": hardware(), "max_tokens": args.max_tokens,
        "prompts": "8 short English prompts (5-12 tokens), greedy, streaming /v1/completions",
    }, "servers": {}}
    for name in args.servers:
        port = free_port()
        if name == "macinfer":
            cmd = [sys.executable, "-m", "macinfer.cli", "serve", model, "--port", str(port),
                   "--served-model-name", "bench", "--kv-cache-gb", "0.5", "--max-num-seqs", "32", "--max-queue", "256"]
        else:
            cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", mlx_dir, "--port", str(port), "--log-level", "ERROR"]
        server = Server(name, cmd, port)
        served = "bench" if name == "macinfer" else mlx_dir
        try:
            asyncio.run(run_level(server.url, served, 1, 4, 1, None))  # warm-up
            per = {}
            for label, conc, rate, n in levels:
                per[label] = asyncio.run(run_level(server.url, served, n, args.max_tokens, conc, rate))
                print(f"{name} {label}: {per[label]['throughput_tok_s']:.1f} tok/s", flush=True)
            per["peak_rss_gb"] = peak_rss_gb(server.proc.pid)
            results["servers"][name] = per
        finally:
            server.stop()

    names = list(results["servers"])
    print(f"\n{'level':<12}{'metric':<18}" + "".join(f"{n:>12}" for n in names) + ("   ratio" if len(names) == 2 else ""))
    for label, *_ in levels:
        for k in ("throughput_tok_s", "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95", "tpot_p99", "e2e_p50", "e2e_p95", "e2e_p99"):
            vals = [results["servers"][n][label].get(k) for n in names]
            if any(v is None for v in vals):
                continue
            line = f"{label:<12}{k:<18}" + "".join(f"{v:>12.3f}" for v in vals)
            if len(vals) == 2 and vals[1]:
                line += f"{vals[0] / vals[1]:>8.2f}"
            print(line)
    print(f"{'':<12}{'peak_rss_gb':<18}" + "".join(f"{results['servers'][n]['peak_rss_gb'] or 0:>12.2f}" for n in names))
    print("(ratio = macinfer / mlx-lm; latencies in seconds)")
    save_results(results, args.out)


if __name__ == "__main__":
    main()
