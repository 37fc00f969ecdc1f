"""Keeping a silent stream alive. A long prompt on a Mac (or any prompt on this project's
CPU runner) can take minutes to its first token, and a tool-call answer is held back until
it parses: agent clients give up on a stream that sends nothing for a while (Codex after
5 minutes without an event). Each API's stream says "still working" in its own words when
its engine output has been silent for `EVERY` seconds: Anthropic's `ping` event, a repeated
Responses `response.in_progress`, an SSE comment for Chat Completions."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, TypeVar

T = TypeVar("T")
EVERY = 10.0  # seconds of silence before a keep-alive
BEAT = object()  # what `with_heartbeat` yields for one


async def with_heartbeat(source: AsyncIterator[T], every: float | None = None) -> AsyncIterator[T | object]:
    """`source`'s items, and `BEAT` after each `every` seconds (`EVERY`) that brought none. The
    item being waited for is never cancelled by a beat (only when the consumer leaves)."""
    every = EVERY if every is None else every
    it = source.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield BEAT
                continue
            fut, pending = pending, None
            try:
                item = fut.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
