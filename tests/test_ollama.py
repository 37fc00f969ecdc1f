"""Ollama's API (`/api/*`) driven by the official `ollama` Python client (PyPI), against a
real `macinfer serve`: list, show, ps, version, chat streamed and not (the same greedy
text), generate, a JSON-schema `format` held by the grammar, tools, embed, and Ollama-style
errors for what is not supported."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.server_process import ServerProcess

ollama = pytest.importorskip("ollama") if not os.environ.get("CI") else __import__("ollama")


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    s = ServerProcess(smollm2_gguf, "--served-model-name", "smollm2", "--kv-cache-gb", "0.1", "--max-model-len", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


def test_list_show_ps_version(client, server):
    (model,) = client.list().models
    assert model.model == "smollm2:latest" and model.size > 0 and model.details.family == "llama"
    shown = client.show("smollm2:latest")
    assert "completion" in shown.capabilities and shown.template and shown.modelinfo["general.context_length"] == 2048
    assert [m.model for m in client.ps().models] == ["smollm2:latest"]
    assert httpx.get(f"{server.url}/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3:8b")
    assert e.value.status_code == 404 and "smollm2" in e.value.error


def test_chat_streamed_and_whole_give_the_same_greedy_text(client, smollm2_engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    options = {"temperature": 0, "num_predict": 24, "num_ctx": 4096}
    whole = client.chat(model="smollm2", messages=messages, options=options)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.prompt_eval_count > 0 and 0 < whole.eval_count <= 24
    chunks = list(client.chat(model="smollm2:latest", messages=messages, options=options, stream=True))
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    assert "".join(c.message.content or "" for c in chunks) == whole.message.content
    assert "Paris" in whole.message.content
    # the same answer the engine gives for the chat template's prompt
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import generate

    ids = smollm2_engine.tokenizer.encode_chat(messages)
    want = generate(smollm2_engine, [ids], SamplingParams(temperature=0, max_tokens=24))[0].text
    assert whole.message.content == want


def test_generate_and_structured_format(client):
    out = client.generate(model="smollm2", prompt="Say hello.", options={"temperature": 0, "num_predict": 8})
    assert out.done and out.response and out.eval_count <= 8
    streamed = "".join(c.response for c in client.generate(model="smollm2", prompt="Say hello.", stream=True,
                                                           options={"temperature": 0, "num_predict": 8}))
    assert streamed == out.response
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    reply = client.chat(model="smollm2", messages=[{"role": "user", "content": "Name a city and its country as JSON."}],
                        format=schema, options={"temperature": 0, "num_predict": 64})
    data = json.loads(reply.message.content)
    assert set(data) == {"city", "country"}


def test_tools(client):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    reply = client.chat(model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
                        tools=tools, options={"temperature": 0, "num_predict": 64})
    calls = reply.message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and isinstance(calls[0].function.arguments, dict)
    # the call and its result sent back: a plain answer follows
    follow = client.chat(model="smollm2", tools=tools, options={"temperature": 0, "num_predict": 32}, messages=[
        {"role": "user", "content": "What is the weather in Paris right now?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}'}])
    assert follow.done


def test_unsupported_fields_are_refused_in_ollamas_shape(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smollm2", messages=[{"role": "user", "content": "hi"}], options={"mirostat": 2})
    assert e.value.status_code == 400 and "options.mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="smollm2", input="hello")  # SmolLM2 publishes no pooling
    assert e.value.status_code == 400 and "embedding" in e.value.error
    r = httpx.post(f"{server.url}/api/generate", json={"model": "smollm2", "prompt": "hi", "raw": True})
    assert r.status_code == 400 and "raw" in r.json()["error"]
    r = httpx.post(f"{server.url}/api/chat", json={"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                                                   "stream": False, "keep_alive": "5m",
                                                   "options": {"num_predict": 2, "num_thread": 4}})
    assert r.status_code == 200 and r.headers["x-macinfer-ignored"] == "options.num_thread,keep_alive"


def test_embed_on_a_model_with_pooling(tmp_path):
    from tests.helpers import tiny_model_dir
    from tests.test_embeddings import _with_pooling

    path, _ = tiny_model_dir(tmp_path, "llama", hidden_size=64)
    s = ServerProcess(_with_pooling(path, "pooling_mode_mean_tokens", True), "--kv-cache-gb", "0.01")
    try:
        out = ollama.Client(host=s.url).embed(model="m", input=["hello", "world!"])
        assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 64 and out.prompt_eval_count > 0
        openai = httpx.post(f"{s.url}/v1/embeddings", json={"input": ["hello", "world!"]}).json()["data"]
        assert out.embeddings == [d["embedding"] for d in openai]
    finally:
        s.stop()
