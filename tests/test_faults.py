"""One request's failure ends that request only: in the engine and through the HTTP app."""

import asyncio

import httpx
import pytest

import macinfer.engine.runner.execution as execution
import macinfer.engine.runner.verification as verification
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams


@pytest.fixture
def poisoned_sampler(monkeypatch):
    """Sampling raises whenever the request 'bad' is in the rows (a late-found bad parameter),
    both when a step samples at once and when it draws ahead for a lookahead."""
    def poisoned(real):
        def sample(logits, seqs, mask=None, eos_token_ids=()):
            if any(s.request_id.startswith("bad") or s.params.stop_token_ids == [299] for s in seqs):
                raise ValueError("poisoned request")
            return real(logits, seqs, mask, eos_token_ids)
        return sample

    monkeypatch.setattr(verification, "sample", poisoned(verification.sample))
    monkeypatch.setattr(execution, "draw", poisoned(execution.draw))


def _run(engine, requests):
    for rid, prompt in requests:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), rid)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def test_engine_isolates_a_failing_request(tiny_llama, poisoned_sampler):
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    good = [("a", [5, 6, 7]), ("b", [8, 9, 10, 11, 12])]
    clean = _run(engine, good)
    mixed = _run(engine, good[:1] + [("bad", [13, 14])] + good[1:])
    assert mixed["bad"].finish_reason == "error" and "poisoned" in mixed["bad"].error
    for rid, _ in good:
        assert mixed[rid].finish_reason == "length" and mixed[rid].token_ids == clean[rid].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert _run(engine, good)["a"].token_ids == clean["a"].token_ids  # the engine carries on


def test_http_app_returns_error_for_one_request_and_serves_the_other(tiny_llama, poisoned_sampler):
    from macinfer.server.app import create_app

    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    app = create_app(engine, "tiny")

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            good = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            bad = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "stop_token_ids": [299]})
            return await asyncio.gather(good, bad)

    try:
        good, bad = asyncio.run(go())
    finally:
        app.state.async_engine.shutdown()
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 6
    assert bad.status_code == 500
    # The exception text stays in the server log; the client gets a generic message.
    assert bad.json()["error"]["type"] == "server_error" and "poisoned" not in bad.json()["error"]["message"]
    assert "internal error" in bad.json()["error"]["message"]
