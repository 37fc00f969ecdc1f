"""Client input at the edge (#40), each item of the issue by name, on one in-process app
over a tiny model: JSON read as JSON whatever the Content-Type, depth limits, Anthropic's
structured output, /tokenize's cap and its work off the event loop, Ollama's shapes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.server.model_pool import ModelPool


@pytest.fixture(scope="module")
def app(tiny_llama):
    from macinfer.server.app import create_app

    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.02, max_model_len=2048))
    app = create_app(ModelPool.one(engine, "m"))
    yield app
    app.state.pool.shutdown()


def _run(app, go):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await go(c)

    return asyncio.run(main())


def _deep_schema(n: int) -> str:
    return '{"type": "object", "properties": {"x": ' * n + '{"type": "integer"}' + "}}" * n


def test_json_bodies_are_parsed_as_json_whatever_their_content_type(app):
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    ollama = json.dumps({"model": "m", "prompt": "hi", "stream": False, "options": {"num_predict": 1}}).encode()

    async def go(c):
        out = []
        for ctype in (None, "application/x-www-form-urlencoded", "text/plain"):  # curl -d, litellm
            headers = {"content-type": ctype} if ctype else {}
            out.append((await c.post("/v1/completions", content=body, headers=headers)).status_code)
            out.append((await c.post("/api/generate", content=ollama, headers=headers)).status_code)
        return out

    assert _run(app, go) == [200] * 6


@pytest.mark.parametrize("where", ["tools", "response_format", "anthropic_tools", "ollama_format", "count_tokens",
                                   "responses_tools", "tool_choice"])
def test_schemas_nested_hundreds_deep_are_a_400_naming_the_depth(app, where):
    deep = _deep_schema(500)
    msgs = '[{"role": "user", "content": "hi"}]'
    tool = '{"type": "function", "function": {"name": "f", "parameters": %s}}' % deep
    path, raw = {
        "tools": ("/v1/chat/completions", '{"model": "m", "max_tokens": 1, "messages": %s, "tools": [%s]}' % (msgs, tool)),
        "tool_choice": ("/v1/chat/completions", '{"model": "m", "max_tokens": 1, "messages": %s, "tools": [%s], '
                        '"tool_choice": {"type": "function", "function": {"name": "f"}}}' % (msgs, tool)),
        "response_format": ("/v1/chat/completions", '{"model": "m", "max_tokens": 1, "messages": %s, "response_format": '
                            '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % (msgs, deep)),
        "anthropic_tools": ("/v1/messages", '{"model": "m", "max_tokens": 1, "messages": %s, "tools": '
                            '[{"name": "f", "input_schema": %s}]}' % (msgs, deep)),
        "count_tokens": ("/v1/messages/count_tokens", '{"model": "m", "messages": %s, "tools": '
                         '[{"name": "f", "input_schema": %s}]}' % (msgs, deep)),
        "ollama_format": ("/api/chat", '{"model": "m", "stream": false, "messages": %s, "format": %s}' % (msgs, deep)),
        "responses_tools": ("/v1/responses", '{"model": "m", "input": "hi", "tools": [{"type": "function", '
                            '"name": "f", "parameters": %s}]}' % deep),
    }[where]

    async def go(c):
        return await c.post(path, content=raw.encode(), headers={"content-type": "application/json"})

    r = _run(app, go)
    assert r.status_code == 400 and "nests deeper than 100 levels" in r.text, r.text


def test_tool_call_arguments_nested_thousands_deep_are_a_400_or_kept_as_text(app):
    """Chat `tool_calls` arguments, Responses `function_call` arguments and /tokenize
    messages carry JSON inside a string: parsed with the same limit (kept as text past it)."""
    args = "[" * 2000 + "]" * 2000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]

    async def go(c):
        return [await c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": msgs}),
                await c.post("/tokenize", json={"model": "m", "messages": msgs}),
                await c.post("/v1/responses", json={"model": "m", "max_output_tokens": 1, "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": args},
                    {"type": "function_call_output", "call_id": "c", "output": "ok"}]})]

    for r in _run(app, go):
        assert r.status_code in (200, 400), r.text


def test_anthropic_output_config_format_gives_json_matching_the_schema(app):
    """Claude Code's title request: `output_config.format` (structured output) on the grammar path."""
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 8}},
              "required": ["title"], "additionalProperties": False}
    body = {"model": "m", "max_tokens": 60, "temperature": 0, "messages": [{"role": "user", "content": "title?"}]}

    async def go(c):
        return [await c.post("/v1/messages", json={**body, "output_config": {"format": {"type": "json_schema",
                                                                                       "schema": schema}}}),
                await c.post("/v1/messages", json={**body, "output_format": {"type": "json_schema", "schema": schema}}),
                await c.post("/v1/messages", json={**body, "output_config": {"format": {"type": "xml"}}})]

    new, beta, bad = _run(app, go)
    for r in (new, beta):
        assert r.status_code == 200, r.text
        answer = json.loads(r.json()["content"][0]["text"])
        assert set(answer) == {"title"} and isinstance(answer["title"], str) and len(answer["title"]) <= 8
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_tokenize_is_capped_and_runs_off_the_event_loop(app):
    """The largest prompt /tokenize takes (64 characters a context token) is counted in a
    worker thread: /health answers meanwhile; one over the cap is a 400 at once."""
    cap = 64 * 2048
    text = ("lorem ipsum dolor sit amet " * (cap // 27 + 1))[:cap]

    async def go(c):
        big = asyncio.ensure_future(c.post("/tokenize", json={"model": "m", "prompt": text, "return_token_strs": True}))
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        health = await c.get("/health")
        waited = time.perf_counter() - started
        over = await c.post("/tokenize", json={"model": "m", "prompt": text + "x"})
        return await big, health, waited, over

    big, health, waited, over = _run(app, go)
    assert big.status_code == 200 and big.json()["count"] > 2048 and health.status_code == 200
    assert waited < 0.5, waited
    assert over.status_code == 400 and "at most 131072" in over.json()["error"]["message"]


def test_tokenize_with_a_lone_surrogate_is_a_400(app):
    async def go(c):
        return await c.post("/tokenize", content=b'{"model": "m", "prompt": "a\\ud800b"}',
                            headers={"content-type": "application/json"})

    r = _run(app, go)
    assert r.status_code == 400 and "surrogate" in r.text


@pytest.mark.parametrize("calls", ['"abc"', "[5]", '[{"function": 5}]', '[{"function": {"name": 5}}]'])
def test_ollama_assistant_tool_calls_of_the_wrong_shape_are_a_400(app, calls):
    raw = ('{"model": "m", "stream": false, "messages": [{"role": "user", "content": "hi"}, '
           '{"role": "assistant", "content": "", "tool_calls": %s}]}' % calls)

    async def go(c):
        return await c.post("/api/chat", content=raw.encode(), headers={"content-type": "application/json"})

    r = _run(app, go)
    assert r.status_code == 400 and "tool_calls" in r.json()["error"], r.text


@pytest.mark.parametrize("value", ['"ten"', "1.5", "true", "[1]"])
def test_ollama_num_predict_of_the_wrong_type_is_a_400(app, value):
    raw = '{"model": "m", "prompt": "hi", "stream": false, "options": {"num_predict": %s}}' % value

    async def go(c):
        return await c.post("/api/generate", content=raw.encode(), headers={"content-type": "application/json"})

    r = _run(app, go)
    assert r.status_code == 400 and "num_predict" in r.json()["error"], r.text


@pytest.mark.parametrize("kw, field", [({"seed": 2**80}, "seed"), ({"seed": True}, "seed"),
                                       ({"stop_token_ids": [-1]}, "stop_token_ids"),
                                       ({"stop_token_ids": ["a"]}, "stop_token_ids"),
                                       ({"temperature": "hot"}, "temperature"), ({"top_p": None}, "top_p")])
def test_the_python_api_checks_what_the_server_checks(kw, field):
    from macinfer.sampling_params import InvalidSamplingParamsError, SamplingParams

    with pytest.raises(InvalidSamplingParamsError) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == field if hasattr(e.value, "param") else field in str(e.value)
