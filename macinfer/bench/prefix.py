"""Prefix-cache benchmark: TTFT when prompts share prefixes, per server.

  multi-turn  one conversation of `turns` turns; every turn resends the whole history
  shared-sys  `clients` requests sharing a long system prompt, sent at once
  restart     a ~2k-token prompt, the server restarted, the same prompt again: TTFT
              cold and after the restart (macinfer runs with `--kv-disk-gb`: its prefix
              cache outlives the process; a server without a disk tier recomputes)
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Callable

import httpx

from macinfer.bench.common import energy, hardware, percentiles, versions
from macinfer.bench.targets import Target, sse_events

SYSTEM = ("You are the support assistant of a hardware store. Be precise, friendly and brief. "
          "Policies: returns within 30 days with receipt; no returns on cut lumber or mixed paint; "
          "price matching against local stores only; delivery is free above 99 dollars; "
          "tool rental requires a deposit and an ID; the store opens at 7 and closes at 21. ")
QUESTIONS = ["Can I return paint?", "When do you open?", "Do you deliver?", "Can I rent a drill?",
             "Do you price match online stores?", "Can I return a hammer?", "Is delivery free?",
             "What ID do I need?", "Can I return cut wood?", "When do you close?", "Do you sell nails?",
             "Is there a deposit?", "How long do returns last?", "Do you match prices?",
             "Can I pay by card?", "Where is the store?"]


async def _chat(client, target: Target, messages, max_tokens) -> tuple[float, str, int]:
    body = {"model": target.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, text, cached = time.perf_counter(), None, [], 0
    async for data in sse_events(client, f"{target.url}/v1/chat/completions", body):
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) or cached
        for c in data.get("choices", []):
            if c.get("delta", {}).get("content"):
                ttft = ttft or time.perf_counter() - start
                text.append(c["delta"]["content"])
    return ttft or time.perf_counter() - start, "".join(text), cached


async def _multi_turn(target: Target, turns: int, max_tokens: int, tick) -> dict:
    messages = [{"role": "system", "content": SYSTEM * 3}]
    ttfts, cached = [], []
    async with httpx.AsyncClient(timeout=600) as c:
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            ttft, text, hit = await _chat(c, target, messages, max_tokens)
            messages.append({"role": "assistant", "content": text})
            ttfts.append(ttft)
            cached.append(hit)
            tick()
    return {"ttft_per_turn": ttfts, "ttft_turns_2plus_mean": statistics.fmean(ttfts[1:] or ttfts),
            "cached_tokens_per_turn": cached}


async def _shared_system(target: Target, clients: int, max_tokens: int, tick) -> dict:
    async def one(q):
        try:
            return await _chat(c, target, [{"role": "system", "content": SYSTEM * 4}, {"role": "user", "content": q}],
                               max_tokens)
        finally:
            tick()

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as c:
        res = await asyncio.gather(*(one(q) for q in (QUESTIONS * 4)[:clients]), return_exceptions=True)
    failed = [r for r in res if isinstance(r, BaseException)]
    ok = [r for r in res if not isinstance(r, BaseException)]
    out = {**percentiles([r[0] for r in ok], "ttft"), "ttft_samples": [r[0] for r in ok],
           "cached_tokens_mean": statistics.fmean(r[2] for r in ok) if ok else 0.0, "failed": len(failed)}
    if failed:
        out["first_error"] = repr(failed[0])
    return out


async def _long_prompt(target: Target, max_tokens: int, repeats: int) -> tuple[float, int]:
    messages = [{"role": "system", "content": SYSTEM * repeats}, {"role": "user", "content": QUESTIONS[0]}]
    async with httpx.AsyncClient(timeout=600) as c:
        ttft, _, cached = await _chat(c, target, messages, max_tokens)
    return ttft, cached


def _after_restart(target: Target, max_tokens: int) -> dict | None:
    """TTFT of a ~2k-token prompt (shorter where the context is) cold, then after the
    server restarted (servers this benchmark started only)."""
    repeats = 24  # ~2k tokens with a BPE tokenizer
    while True:
        try:
            cold, _ = asyncio.run(_long_prompt(target, max_tokens, repeats))
            break
        except RuntimeError as e:  # beyond this model's context: shorter
            if "HTTP 400" not in str(e) or repeats <= 3:
                raise
            repeats //= 2
    if not target.restart():
        return None
    warm, cached = asyncio.run(_long_prompt(target, max_tokens, repeats))
    return {"ttft_cold": cold, "ttft_after_restart": warm, "cached_tokens_after_restart": cached,
            "system_prompt_repeats": repeats}


def run(targets: list[Target], turns: int, clients: int, max_tokens: int, tick: Callable[[], None]) -> dict:
    results: dict = {"mode": "prefix", "context": {
        **versions(), "hardware": hardware(), "energy": energy(),
        "workload": {"turns": turns, "clients": clients, "max_tokens": max_tokens,
                     "multi_turn": "one conversation, each turn resends the history",
                     "shared_system": "requests sharing a ~400-token system prompt, sent at once",
                     "restart": "a ~2k-token prompt, the server restarted, the same prompt again"},
        "targets": {t.name: {"url": t.url, "model": t.model, **t.info} for t in targets},
    }, "servers": {}}
    for t in targets:
        asyncio.run(_chat_warm_up(t))
        r = {"multi_turn": asyncio.run(_multi_turn(t, turns, max_tokens, tick)),
             "shared_system": asyncio.run(_shared_system(t, clients, max_tokens, tick)),
             "restart": _after_restart(t, max_tokens)}
        if t.memory is not None:
            r["memory_gb_over_time"] = list(t.memory.samples)
            r["peak_rss_gb"] = t.memory.peak_gb
        results["servers"][t.name] = r
    return results


async def _chat_warm_up(t: Target) -> None:
    """One unrelated request, so no scenario pays first-call costs or finds its prefix cached."""
    async with httpx.AsyncClient(timeout=600) as c:
        await _chat(c, t, [{"role": "user", "content": "Warm up."}], 2)


def table(results: dict) -> str:
    names = list(results["servers"])
    turns = results["context"]["workload"]["turns"]
    clients = results["context"]["workload"]["clients"]
    rows = [(f"multi-turn TTFT turn {i + 1} (s)", lambda r, i=i: r["multi_turn"]["ttft_per_turn"][i]) for i in range(turns)]
    rows += [("multi-turn TTFT turns 2+ (s)", lambda r: r["multi_turn"]["ttft_turns_2plus_mean"]),
             (f"shared-sys x{clients} TTFT p50 (s)", lambda r: r["shared_system"].get("ttft_p50")),
             (f"shared-sys x{clients} TTFT p99 (s)", lambda r: r["shared_system"].get("ttft_p99")),
             ("shared-sys cached tokens", lambda r: r["shared_system"]["cached_tokens_mean"]),
             ("shared-sys failed", lambda r: r["shared_system"]["failed"]),
             ("2k prompt TTFT cold (s)", lambda r: (r.get("restart") or {}).get("ttft_cold")),
             ("2k prompt TTFT after restart (s)", lambda r: (r.get("restart") or {}).get("ttft_after_restart")),
             ("after restart cached tokens", lambda r: (r.get("restart") or {}).get("cached_tokens_after_restart")),
             ("peak RSS (GB)", lambda r: r.get("peak_rss_gb"))]
    lines = [f"{'metric':<34}" + "".join(f"{n[:18]:>20}" for n in names)]
    for label, get in rows:
        vals = [get(results["servers"][n]) for n in names]
        lines.append(f"{label:<34}" + "".join(f"{v:>20.3f}" if v is not None else f"{'-':>20}" for v in vals))
    return "\n".join(lines)
