"""Online serving benchmark: streaming /v1/completions at fixed concurrency levels
(closed loop) and with Poisson arrivals (open loop), against macinfer and any
other server. Per request: TTFT, every inter-token gap, end-to-end time and
tokens; per level: p50/p95/p99 of each, tok/s, req/s, and macinfer's prefix-cache
hit rate. Each local server's memory is sampled for the whole run."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Callable

import httpx

from macinfer.bench.common import energy, hardware, percentiles, versions
from macinfer.bench.targets import Target, sse_events

WORDS = ("river stone market lantern winter garden harbor signal copper meadow violin thunder orchard "
         "compass ember glacier canyon velvet pepper anchor falcon quarry saddle lattice").split()


def make_prompts(tokenizer, n: int, input_len: int, seed: int = 0) -> list[str]:
    """n distinct prompts of about `input_len` tokens (the served model's tokenizer)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = [f"Request {i}:"]
        while len(tokenizer.encode(" ".join(words))) < input_len:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words) + "\nContinue the story:")
    return prompts


# The structured-output workload: a bounded JSON answer (a small model can loop in an
# unbounded string).
JSON_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "mood": {"type": "string", "enum": ["calm", "tense", "joyful"]},
    "events": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4}},
    "required": ["title", "mood", "events"], "additionalProperties": False}


async def _one(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int,
               structured: bool = False) -> dict:
    """One streaming request: /v1/completions, or for the structured workload a chat
    request with a JSON-schema response_format."""
    body: dict = {"model": target.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if structured:
        body |= {"messages": [{"role": "user", "content": prompt + "\nAnswer in JSON."}],
                 "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": JSON_SCHEMA}}}
    else:
        body["prompt"] = prompt
    start = time.perf_counter()
    last, ttft, itls, tokens, chunks, text = start, None, [], 0, 0, []
    url = f"{target.url}/v1/{'chat/completions' if structured else 'completions'}"
    async for data in sse_events(client, url, body):
        if data.get("usage"):
            tokens = data["usage"]["completion_tokens"]
        choice = (data.get("choices") or [{}])[0]
        piece = (choice.get("delta") or {}).get("content") if structured else choice.get("text")
        if piece:
            text.append(piece)
            now = time.perf_counter()
            chunks += 1
            if ttft is None:
                ttft = now - start
            else:
                itls.append(now - last)
            last = now
    e2e = time.perf_counter() - start
    tokens = tokens or chunks
    out = {"ttft": ttft if ttft is not None else e2e, "e2e": e2e, "tokens": tokens, "itl": itls,
           "tpot": (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None}
    if structured:
        try:
            json.loads("".join(text))
            out["valid_json"] = True
        except ValueError:
            out["valid_json"] = False
    return out


async def _one_or_error(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int,
                        tick: Callable[[], None], structured: bool = False) -> dict:
    """One request's measurements, or {"error": ...}; ticks the progress bar either way."""
    try:
        return await _one(client, target, prompt, max_tokens, structured)
    except (httpx.HTTPError, RuntimeError) as e:
        return {"error": str(e)}
    finally:
        tick()


def _arrivals(n: int, rate: float | None, rng: random.Random, first: float = 0.0) -> list[float]:
    """Start times of n requests: Poisson at `rate` per second from `first` (all at once without a rate)."""
    delays, t = [], first
    for _ in range(n):
        delays.append(t)
        if rate:
            t += rng.expovariate(rate)
    return delays


async def run_level(target: Target, prompts: list[str], max_tokens: int, concurrency: int | None,
                    rate: float | None, tick: Callable[[], None], structured: float = 0.0) -> dict:
    """`structured`: the fraction of requests (every k-th) held to a JSON schema."""
    rng = random.Random(1)
    every = round(1 / structured) if structured > 0 else 0
    sem = asyncio.Semaphore(concurrency or len(prompts))
    before = target.status()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10),
                                 limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        async def request(i: int, prompt: str, delay: float) -> dict:
            await asyncio.sleep(delay)
            async with sem:
                return await _one_or_error(client, target, prompt, max_tokens, tick, bool(every) and i % every == 0)

        delays = _arrivals(len(prompts), rate, rng)
        start = time.perf_counter()
        results = await asyncio.gather(*(request(i, p, d) for i, (p, d) in enumerate(zip(prompts, delays))))
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    out: dict = {"requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
                 "output_tokens": sum(r["tokens"] for r in ok)}
    if any("error" in r for r in results):
        out["first_error"] = next(r["error"] for r in results if "error" in r)
    out["throughput_tok_s"] = out["output_tokens"] / wall
    out["requests_per_s"] = len(ok) / wall
    held = [r for r in ok if "valid_json" in r]
    if held:
        out["structured_requests"] = len(held)
        out["structured_valid_json"] = sum(r["valid_json"] for r in held) / len(held)
    for key in ("ttft", "tpot", "e2e"):
        out.update(percentiles([r[key] for r in ok], key))
    out.update(percentiles([g for r in ok for g in r["itl"]], "itl"))
    out["ttft_samples"] = [r["ttft"] for r in ok]
    out["itl_samples"] = [g for r in ok for g in r["itl"]]
    after = target.status()
    if before and after:
        q = after["kv"]["prefix_queried_tokens"] - before["kv"]["prefix_queried_tokens"]
        hits = after["kv"]["prefix_hit_tokens"] - before["kv"]["prefix_hit_tokens"]
        out["kv_hit_rate"] = hits / q if q else 0.0
        out["kv_usage_end"] = after["kv"]["usage"]
    return out


async def run_mixed(target: Target, short: list[list[str]], long: list[str], output_len: int, rate: float,
                    tick: Callable[[], None]) -> dict:
    """Mixed load: len(short) streams each sending its short prompts one after another
    (decoding), while the long prompts arrive with Poisson gaps. ITL is measured on the
    short streams: what a long prompt's prefill costs everyone else."""
    rng = random.Random(2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10),
                                 limits=httpx.Limits(max_connections=len(short) + len(long) + 4)) as client:
        async def stream(prompts: list[str]) -> list[dict]:
            return [await _one_or_error(client, target, p, output_len, tick) for p in prompts]

        async def arrival(prompt: str, delay: float) -> dict:
            await asyncio.sleep(delay)
            return await _one_or_error(client, target, prompt, 16, tick)

        delays = _arrivals(len(long), rate, rng, first=1.0)
        start = time.perf_counter()
        results = await asyncio.gather(*(stream(ps) for ps in short), *(arrival(p, d) for p, d in zip(long, delays)))
        wall = time.perf_counter() - start
    shorts = [r for rs in results[: len(short)] for r in rs]
    longs = list(results[len(short):])
    ok_s = [r for r in shorts if "error" not in r]
    ok_l = [r for r in longs if "error" not in r]
    out: dict = {"requests": len(shorts) + len(longs), "failed": len(shorts) + len(longs) - len(ok_s) - len(ok_l),
                 "wall_s": wall, "output_tokens": sum(r["tokens"] for r in ok_s + ok_l)}
    out["throughput_tok_s"] = out["output_tokens"] / wall
    out["requests_per_s"] = (len(ok_s) + len(ok_l)) / wall
    out.update(percentiles([g for r in ok_s for g in r["itl"]], "itl"))
    out.update(percentiles([r["ttft"] for r in ok_s], "ttft"))
    out.update(percentiles([r["ttft"] for r in ok_l], "long_ttft"))
    out.update(percentiles([r["e2e"] for r in ok_s], "e2e"))
    out["ttft_samples"] = [r["ttft"] for r in ok_s]
    out["itl_samples"] = [g for r in ok_s for g in r["itl"]]
    return out


def run(targets: list[Target], tokenizer, input_len: int, output_len: int, concurrency: tuple[int, ...],
        requests: int | None, rate: float | None, tick: Callable[[], None],
        mixed: tuple[int, int, int, float] | None = None, structured: float = 0.0) -> dict:
    """`mixed`: (streams, long prompt tokens, long prompts, their arrival rate) for a mixed-load level."""
    levels = [(f"c{c}", c, None, requests or max(4, 2 * c)) for c in concurrency]
    if rate:
        levels.append((f"poisson{rate:g}", None, rate, requests or 16))
    if mixed:
        levels.append(("mixed", None, None, 0))
    results: dict = {"mode": "serve", "context": {
        **versions(), "hardware": hardware(), "energy": energy(),
        "workload": {"input_len": input_len, "output_len": output_len, "concurrency": list(concurrency),
                     "poisson_rate": rate, "requests_per_level": {name: n for name, _, _, n in levels},
                     "prompts": "distinct word-salad prompts of about input_len tokens (the served model's "
                                "tokenizer), streaming /v1/completions, greedy, EOS honoured",
                     "shared_prefixes": "none (see `macinfer bench prefix`)",
                     "mixed": None if not mixed else {
                         "streams": mixed[0], "long_prompt_tokens": mixed[1], "long_prompts": mixed[2],
                         "long_rate_per_s": mixed[3], "short_requests_per_stream": 3,
                         "what": "streams decode back-to-back short requests while long prompts arrive "
                                 "(Poisson); ITL is measured on the streams"},
                     "structured_output": "none" if not structured else {
                         "fraction": structured, "how": "chat completions with a json_schema response_format",
                         "schema": JSON_SCHEMA}},
        "targets": {t.name: {"url": t.url, "model": t.model, **t.info} for t in targets},
    }, "levels": [name for name, *_ in levels], "servers": {}}
    for t in targets:
        asyncio.run(run_level(t, make_prompts(tokenizer, 1, 8, seed=99), 4, 1, None, lambda: None))  # warm-up
        per: dict = {}
        for i, (name, conc, r, n) in enumerate(levels):
            if name == "mixed":
                streams, long_len, n_long, long_rate = mixed
                short = [make_prompts(tokenizer, 3, 32, seed=100 + j) for j in range(streams)]
                long = make_prompts(tokenizer, n_long, long_len, seed=200)
                per[name] = asyncio.run(run_mixed(t, short, long, output_len, long_rate, tick))
                continue
            prompts = make_prompts(tokenizer, n, input_len, seed=i)
            per[name] = asyncio.run(run_level(t, prompts, output_len, conc, r, tick, structured))
        if t.memory is not None:
            per["memory_gb_over_time"] = list(t.memory.samples)
            per["peak_rss_gb"] = t.memory.peak_gb
        results["servers"][t.name] = per
    return results


def table(results: dict) -> str:
    names = list(results["servers"])
    lines = [f"{'level':<14}{'metric':<18}" + "".join(f"{n[:16]:>18}" for n in names)
             + ("   ratio" if len(names) == 2 else "")]
    keys = ("throughput_tok_s", "requests_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "itl_p50", "itl_p95",
            "itl_p99", "e2e_p50", "e2e_p99", "long_ttft_p50", "long_ttft_p99", "kv_hit_rate",
            "structured_valid_json", "failed")
    for level in results["levels"]:
        for k in keys:
            vals = [results["servers"][n][level].get(k) for n in names]
            if all(v is None for v in vals):
                continue
            line = f"{level:<14}{k:<18}" + "".join(f"{v:>18.3f}" if v is not None else f"{'-':>18}" for v in vals)
            if len(vals) == 2 and None not in vals and vals[1]:
                line += f"{vals[0] / vals[1]:>8.2f}"
            lines.append(line)
    peaks = [results["servers"][n].get("peak_rss_gb") for n in names]
    lines.append(f"{'':<14}{'peak_rss_gb':<18}" + "".join(f"{p:>18.2f}" if p else f"{'-':>18}" for p in peaks))
    return "\n".join(lines)
