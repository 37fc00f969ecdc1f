"""A stream whose engine output is silent (a long prompt, an answer held back while it may be
a tool call) says it is still working, in each API's own words, and still ends as it should."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.server import heartbeat
from macinfer.server.heartbeat import BEAT, with_heartbeat


def test_beats_while_the_source_is_silent_and_every_item_comes_through():
    closed = []

    async def source():
        try:
            for i in range(3):
                await asyncio.sleep(0.25 if i == 1 else 0)
                yield i
        finally:
            closed.append(True)

    async def go():
        return [x async for x in with_heartbeat(source(), every=0.05)]

    out = asyncio.run(go())
    assert [x for x in out if x is not BEAT] == [0, 1, 2]
    beats = [i for i, x in enumerate(out) if x is BEAT]
    assert len(beats) >= 3 and all(out.index(0) < b < out.index(1) for b in beats)
    assert closed


def test_a_consumer_that_leaves_mid_wait_cancels_the_wait_and_closes_the_source():
    closed = []

    async def source():
        try:
            yield 0
            await asyncio.sleep(30)
            yield 1
        finally:
            closed.append(True)

    async def go():
        stream = with_heartbeat(source(), every=0.05)
        got = [await stream.__anext__(), await stream.__anext__()]  # the item, then a beat
        await stream.aclose()
        await asyncio.sleep(0)
        return got

    start = time.monotonic()
    assert asyncio.run(go()) == [0, BEAT]
    assert closed and time.monotonic() - start < 5


@pytest.mark.parametrize("path,body,beat,end", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, ": keep-alive",
     "data: [DONE]"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4}, "event: response.in_progress",
     ("event: response.completed", "event: response.incomplete")),  # (a random model may stop early)
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "event: ping",
     "event: message_stop"),
])
def test_each_api_keeps_a_silent_stream_alive_in_its_own_words(tiny_llama, monkeypatch, path, body, beat, end):
    from macinfer.server.app import create_app

    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    real_step = engine.step
    calls = {"n": 0}

    def slow_step():  # the first steps (the prompt) take a while, as a long prompt would
        calls["n"] += 1
        if calls["n"] <= 3:
            time.sleep(0.2)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    monkeypatch.setattr(heartbeat, "EVERY", 0.05)
    app = create_app(engine, "tiny")

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            return await c.post(path, json={"model": "tiny", "stream": True, **body})

    try:
        r = asyncio.run(go())
    finally:
        app.state.async_engine.shutdown()
    assert r.status_code == 200, r.text
    text = r.text
    first_beat = text.find(beat, text.find(beat) + 1 if beat.startswith("event: ") else 0)  # past the opening one
    assert text.count(beat) >= (3 if beat.startswith("event: ") else 2), text[:2000]
    last = max(text.rfind(e) for e in ((end,) if isinstance(end, str) else end))
    assert 0 <= first_beat < last, text[-1000:]
    if path == "/v1/responses":  # every event numbered in order, the beats included
        import json
        seqs = [json.loads(line[6:])["sequence_number"] for line in text.splitlines() if line.startswith("data: ")]
        assert seqs == list(range(1, len(seqs) + 1))
