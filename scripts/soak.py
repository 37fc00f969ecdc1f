#!/usr/bin/env python
"""Soak test: `macinfer serve` under a mixed, misbehaving load for a fixed time.

Clients on loopback send chat, completion, Anthropic Messages and Responses
requests, streaming or not, with n=1..2, seeds, stops, shared prefixes, forced
(named and `required`) tool calls, JSON schemas, malformed bodies and bad values; some
disconnect mid-stream and some give up on non-streaming requests after a short
read timeout (as SDKs that retry do). At the end the server must be healthy,
hold no running request and no used KV block, and have answered every request
with a status that fits it (2xx, 4xx for the bad ones, never 5xx).

    python scripts/soak.py --minutes 5 --clients 12          # bundled SmolLM2
    python scripts/soak.py --model ./model.gguf --minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import sys
import time

import httpx

from macinfer.bench.common import hardware, save_json
from macinfer.bench.targets import start as start_server

SYSTEM = "You are a helpful assistant. Answer in one short sentence. " * 4
QUESTIONS = ["What is the capital of France?", "Name a color.", "What is 2+2?", "Say hello.", "Name a planet."]
BAD_BODIES = [
    b"{not json", b'{"prompt": "a\\ud800b"}', b'{"prompt": [true, 2]}', b'{"prompt": "hi", "top_k": 18446744073709551616}',
    b'{"prompt": "hi", "temperature": 9}', b'{"messages": []}', b'{"prompt": "hi", "stop": ["' + b"x" * 300 + b'"]}',
]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def _constrained(kind: str, rng: random.Random, body: dict) -> tuple[str, dict]:
    """A request held to a grammar: a forced tool call (OpenAI, Anthropic) or a JSON
    schema (chat, Responses)."""
    question = rng.choice(["Weather in Paris?", "Describe a person.", "Plan a trip."])
    stream, max_tokens = body["stream"], body["max_tokens"]
    if kind == "tool":
        choice = rng.choice(["required", {"type": "function", "function": {"name": "get_weather"}}])
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": question}],
                                         "tools": [WEATHER], "tool_choice": choice}
    if kind == "schema":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": question}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    if kind == "anthropic":
        tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
        extra = rng.choice([{}, {"tools": [tool], "tool_choice": {"type": "any"}},
                            {"tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"}}])
        return "/v1/messages", {"model": "smollm2", "max_tokens": max_tokens, "stream": stream,
                                "messages": [{"role": "user", "content": question}], **extra}
    extra = rng.choice([{}, {"text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON}}},
                        {"tools": [{"type": "function", **WEATHER["function"]}], "tool_choice": "required"}])
    return "/v1/responses", {"model": "smollm2", "input": question, "max_output_tokens": max_tokens,
                             "stream": stream, **extra}


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, stats: collections.Counter,
              latencies: list[float]) -> None:
    kind = rng.choices(["chat", "completion", "bad", "disconnect", "timeout", "tool", "schema", "anthropic",
                        "responses"], [25, 15, 8, 10, 7, 10, 10, 8, 7])[0]
    start = time.perf_counter()
    if kind == "bad":
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        r = await client.post(url + path, content=rng.choice(BAD_BODIES), headers={"content-type": "application/json"})
        stats[f"bad:{r.status_code}"] += 1
        return
    stream = kind == "disconnect" or rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.7]), "stream": stream,
                  "n": rng.choice([1, 1, 2]), "user": rng.choice(["a", "b", None])}
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.2:
        body["stop"] = ["."]
    if kind in ("tool", "schema", "anthropic", "responses"):
        body.pop("n")
        body.pop("stop", None)
        path, body = _constrained(kind, rng, body)
    elif kind == "completion":
        path, body["prompt"] = "/v1/completions", SYSTEM + rng.choice(QUESTIONS)
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rng.choice(QUESTIONS)}]
    body = {k: v for k, v in body.items() if v is not None}
    try:
        if stream:
            async with client.stream("POST", url + path, json=body) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if '"error": {' in line or '"error":{' in line:  # an error event (Responses' "error": null is not)
                            stats["stream_error_event"] += 1
                            print("error event:", kind, line[:200], flush=True)
                        if kind == "disconnect" and chunks >= rng.randint(1, 6):
                            stats["disconnected"] += 1
                            return
                stats[f"{kind}:stream:{r.status_code}"] += 1
        else:
            timeout = httpx.Timeout(60, read=0.3) if kind == "timeout" else httpx.Timeout(120)
            r = await client.post(url + path, json=body, timeout=timeout)
            stats[f"{kind}:plain:{r.status_code}"] += 1
            if r.status_code >= 500:
                print("5xx:", r.text[:200], flush=True)
    except httpx.ReadTimeout:
        stats["client_timeout"] += 1
        return
    latencies.append(time.perf_counter() - start)


async def client_loop(url: str, seed: int, until: float, stats: collections.Counter, latencies: list[float]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        while time.time() < until:
            await one(client, url, rng, stats, latencies)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--out", default="bench_results/soak.json")
    args = ap.parse_args()

    server = start_server("macinfer", args.model, None, ["--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs", "16",
                                                         "--max-model-len", "2048"])
    stats: collections.Counter = collections.Counter()
    latencies: list[float] = []
    start = time.time()
    try:
        until = start + args.minutes * 60

        async def run_clients() -> None:
            clients = (client_loop(server.url, i, until, stats, latencies) for i in range(args.clients))
            await asyncio.wait_for(asyncio.gather(*clients), timeout=args.minutes * 60 + 300)

        asyncio.run(run_clients())
        deadline = time.time() + 30  # aborted requests drain
        while time.time() < deadline and (metric(server.url, "macinfer_requests_running")
                                          or metric(server.url, "macinfer_kv_blocks_used")):
            time.sleep(0.5)
        result = {
            "model": args.model, "minutes": args.minutes, "clients": args.clients, "hardware": hardware(),
            "requests": sum(stats.values()), "outcomes": dict(sorted(stats.items())),
            "server_errors_5xx": sum(v for k, v in stats.items() if k.split(":")[-1].startswith("5")),
            "running_after": metric(server.url, "macinfer_requests_running"),
            "kv_blocks_used_after": metric(server.url, "macinfer_kv_blocks_used"),
            "health_after": httpx.get(f"{server.url}/health").status_code,
            "latency_p50_s": statistics.median(latencies) if latencies else None,
            "latency_p95_s": statistics.quantiles(latencies, n=20)[-1] if len(latencies) > 20 else None,
            "server_peak_rss_gb": server.memory.peak_gb,
            "wall_s": time.time() - start,
        }
    finally:
        server.stop()
    print(json.dumps(result, indent=2))
    save_json(result, args.out)
    ok = result["server_errors_5xx"] == 0 and not stats["stream_error_event"] and not result["running_after"] and not result["kv_blocks_used_after"] \
        and result["health_after"] == 200
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
