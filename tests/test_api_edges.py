"""The server never silently wrong at the edges (#20): echo with prompt logprobs,
logprobs under a grammar, malformed nested bodies, strict types, and seeded
constrained requests on the bundled model, through a real `macinfer serve`."""

import asyncio
import json
import math

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from macinfer.loading.loader import _dequantize_modules, should_dequantize

pytestmark = pytest.mark.slow

U = {"role": "user", "content": "hi"}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "scores": {"type": "array", "items": {"type": "integer"}}},
          "required": ["name", "age", "tags", "scores"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server  # (tests/conftest.py: one server a session for the modules that only send requests)


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as strict parsers do."""
    def bad(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=bad)


def test_echo_logprobs_are_the_prompt_logprobs_of_mlx_lm(server, smollm2_mlx_dir):
    prompt = "The capital of France is Paris."
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    ids = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": False, "logprobs": None},
                     timeout=60).json()["usage"]["prompt_tokens"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == ids + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0 and lp["text_offset"][ids] == len(prompt)  # the answer starts after the echo
    assert "".join(lp["tokens"]) == choice["text"]
    assert all(a <= b for a, b in zip(lp["text_offset"], lp["text_offset"][1:]))
    # The reference: mlx-lm's own model on the same tokens and the same weights (the
    # bundled GGUF as an MLX directory, quantized layers expanded as macinfer runs them).
    model, tok = mlx_lm_load(smollm2_mlx_dir)
    if should_dequantize(model):
        _dequantize_modules(model)
    tokens = tok.encode(prompt)
    assert len(tokens) == ids
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    want = [ref[i, tokens[i + 1]] for i in range(len(tokens) - 1)]
    np.testing.assert_allclose(lp["token_logprobs"][1:ids], want, atol=2e-4)
    for i in range(1, ids):  # the top alternatives are the model's best
        best = {tok.decode([j]) for j in np.argsort(-ref[i - 1])[:2]}
        assert set(lp["top_logprobs"][i]) <= best | {lp["tokens"][i]}
    # Streamed: the echo chunk carries the same prompt logprobs, then the answer's.
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((c["token_logprobs"] for c in streamed), []) == lp["token_logprobs"]
    assert sum((c["text_offset"] for c in streamed), []) == lp["text_offset"]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_under_a_json_schema_are_finite_strict_json(server, stream):
    body = {"messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 24, "seed": 3,
            "logprobs": True, "top_logprobs": 5, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    if stream:
        events = [_strict_json(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        entries = [e for ev in events if ev["choices"] for e in (ev["choices"][0]["logprobs"] or {}).get("content", [])]
    else:
        entries = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert entries
    for e in entries:
        values = [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]
        assert all(math.isfinite(v) and v <= 0 for v in values)
        assert e["logprob"] < 0 or e["logprob"] == max(values)  # the model's own, not 0.0 for a forced token


MALFORMED = [
    ("/v1/chat/completions", {"messages": [U, {"role": "assistant", "tool_calls": "x"}]}, "tool_calls"),
    ("/v1/chat/completions", {"messages": [U, {"role": "assistant", "tool_calls": {"a": 1}}]}, "tool_calls"),
    ("/v1/chat/completions", {"messages": [U, {"role": "assistant", "tool_calls": [1, 2]}]}, "tool_calls[0]"),
    ("/v1/chat/completions", {"messages": [U, {"role": "assistant", "tool_calls": [{"function": 3}]}]}, "function"),
    ("/v1/chat/completions", {"messages": [U, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": 5}}]}]}, "arguments"),
    ("/v1/chat/completions", {"messages": [U], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [U], "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": [U], "stream": "true"}, "stream"),
    ("/v1/chat/completions", {"messages": [U], "response_format": {"type": "json_schema", "json_schema": 3}},
     "json_schema"),
    ("/v1/chat/completions", {"messages": [U], "tools": [{"type": "function", "function": {"name": 5}}]}, "name"),
    ("/v1/chat/completions", {"messages": [U], "stream_options": {"include_usage": "y"}}, "include_usage"),
    ("/v1/completions", {"prompt": "hi", "logprobs": "yes"}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": 5}]}]}, "content"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": {"x": 1}}]}]}, "content"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": ["x"]}]}]}, "content"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text"}]}]}]}, "text"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [5]}]}, "content"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "type"),
    ("/v1/messages", {"messages": [U], "system": [{"type": "text"}]}, "system"),
    ("/v1/messages", {"messages": [U], "max_tokens": "2"}, "max_tokens"),
    ("/v1/messages", {"messages": [U], "tools": [{"name": "f"}]}, "input_schema"),
    ("/v1/responses", {"input": [{"role": "user", "content": ["hi"]}]}, "content[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [5]}]}, "content[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "text"),
    ("/v1/responses", {"input": "hi", "text": {"format": "json"}}, "text.format"),
    ("/v1/responses", {"input": "hi", "text": {"format": ["x"]}}, "text.format"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, "schema"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": 1, "output": 5}]}, "call_id"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}]}, "arguments"),
    ("/v1/responses", {"input": [5]}, "input"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": 5}]}, "name"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": "2"}, "max_output_tokens"),
    # checked only once translated into a chat request: still said in the client's terms
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "name"),
    ("/v1/embeddings", {"input": [[1, "a"]]}, "input"),
]


@pytest.mark.parametrize("path,body,field", MALFORMED, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(MALFORMED)])
def test_malformed_nested_bodies_are_400s_naming_the_field(server, path, body, field):
    body = {**body}
    if path == "/v1/messages":
        body = {"model": "smollm2", "max_tokens": 2, **body}
    elif path == "/v1/responses":
        body = {"model": "smollm2", "max_output_tokens": 2, **body}
    elif path != "/v1/embeddings":
        body.setdefault("max_tokens", 2)
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"], err
    assert "validation error for" not in err["message"] and "Value error," not in err["message"]
    assert ".str" not in err["message"] and "ChatCompletionRequest" not in err["message"]


def test_seeded_constrained_requests_never_fail(server):
    """100 seeded requests held to a schema (integers, strings, arrays) or to a forced
    tool call, 32 at a time: no 5xx; each answer is valid JSON, or cut at max_tokens
    ("length"). Seeds 12, 13, 15 and 18 failed every time before the noise fix (200 seeds
    until #40: halved for the suite's time; every kind still gets 33 or more)."""
    async def one(c, seed):
        kind = seed % 3
        body = {"messages": [{"role": "user", "content": "Describe a person." if kind else "Weather in Paris?"}],
                "max_tokens": 40, "seed": seed, "temperature": 1.0}
        if kind == 0:
            body |= {"tools": [WEATHER], "tool_choice": "required"}
        elif kind == 1:
            body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
        else:
            body |= {"response_format": {"type": "json_object"}}
        r = await c.post("/v1/chat/completions", json=body)
        return seed, kind, r.status_code, r.json()

    async def run():
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            async def guarded(seed):
                async with limit:
                    return await one(c, seed)
            return await asyncio.gather(*(guarded(s) for s in range(100)))

    results = asyncio.run(run())
    assert [r[:3] for r in results if r[2] != 200] == []
    for seed, kind, _, body in results:
        choice = body["choices"][0]
        msg = choice["message"]
        if choice["finish_reason"] == "length":
            continue
        if kind == 0:
            assert choice["finish_reason"] == "tool_calls", (seed, choice)
            for call in msg["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                assert call["function"]["name"] == "get_weather" and isinstance(args["days"], int)
        else:
            value = json.loads(msg["content"])
            assert isinstance(value, dict), (seed, msg)
            if kind == 1:
                assert set(PERSON["required"]) <= set(value) and isinstance(value["age"], int)
