"""The bad-input matrix (#40): every surface (OpenAI, Anthropic, Responses, Ollama,
/tokenize, count_tokens, embeddings, the chat page's routes) gets each of its fields set to
each of a list of wrong values, whole bodies of the wrong shape, deep nesting and odd
encodings: well over 1,200 requests to one shared server (a tiny model, one token each),
and not one answer is a 5xx or a body that is not JSON. The server's log holds no traceback."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_process import ServerProcess

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
A_TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}


def deep(n: int, leaf=1):
    for _ in range(n):
        leaf = {"a": leaf} if n % 2 else [leaf]
    return leaf


def deep_schema(n: int) -> str:
    """A placeholder for a schema nested `n` objects deep, written into the body's text by
    `_encode` (Python's encoder would recurse too deep to write it)."""
    return f"@deep-schema-{n}@"


def _encode(body) -> bytes:
    text = json.dumps(body)
    for n in (60, 120, 500, 950):
        raw = '{"type": "object", "properties": {"x": ' * n + '{"type": "integer"}' + "}}" * n
        text = text.replace(json.dumps(deep_schema(n)), raw)
    return text.encode()


BAD = [None, "", "x" * 3000, -1, 0, 2**70, -2**70, 1.5, 1e308, True, [], [None], [1, "a"], {}, {"x": 1},
       "\ud800", deep(150), deep(40), "NaN", {"type": 5}]
FIELD_BAD = [None, "", "x" * 3000, -1, 2**70, 1.5, True, [None], {"x": 1}, "\ud800", deep(150)]  # every field

# surface -> (method, path, a valid body asking for one token, fields to set wrong)
SURFACES = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": MSG, "max_tokens": 1},
             ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
              "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias", "tools",
              "tool_choice", "response_format", "presence_penalty", "frequency_penalty", "user", "reasoning_effort",
              "chat_template_kwargs", "parallel_tool_calls", "stop_token_ids", "cache_salt", "min_tokens"]),
    "completion": ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1},
                   ["model", "prompt", "max_tokens", "temperature", "seed", "stop", "n", "echo", "logprobs",
                    "suffix", "best_of", "stream", "logit_bias", "repetition_penalty", "ignore_eos"]),
    "anthropic": ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": MSG},
                  ["model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                   "stream", "metadata", "tools", "tool_choice", "thinking", "output_config", "output_format",
                   "context_management"]),
    "count_tokens": ("/v1/messages/count_tokens", {"model": "m", "messages": MSG},
                     ["model", "messages", "system", "tools", "tool_choice", "thinking"]),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 1},
                  ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                   "tool_choice", "text", "reasoning", "stream", "previous_response_id", "store", "include"]),
    "ollama_chat": ("/api/chat", {"model": "m", "messages": MSG, "stream": False, "options": {"num_predict": 1}},
                    ["model", "messages", "stream", "options", "format", "keep_alive", "tools", "think"]),
    "ollama_generate": ("/api/generate", {"model": "m", "prompt": "hi", "stream": False,
                                          "options": {"num_predict": 1}},
                        ["model", "prompt", "system", "template", "raw", "images", "format", "options",
                         "keep_alive", "context", "suffix"]),
    "ollama_embed": ("/api/embed", {"model": "m", "input": "hi"}, ["model", "input", "truncate", "options",
                                                                    "keep_alive", "dimensions"]),
    "embeddings": ("/v1/embeddings", {"model": "m", "input": "hi"},
                   ["model", "input", "encoding_format", "dimensions", "user"]),
    "tokenize": ("/tokenize", {"model": "m", "prompt": "hi"},
                 ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"]),
    "detokenize": ("/detokenize", {"model": "m", "tokens": [1, 2]}, ["model", "tokens"]),
    "show": ("/api/show", {"model": "m"}, ["model", "name", "verbose"]),
}

# values inside messages, tools and options (where most parsing happens)
NESTED = {
    "chat": [("messages", [{"role": "user", "content": v} for v in BAD] + [{"role": v, "content": "hi"} for v in BAD]
              + [[{"role": "assistant", "tool_calls": v}] for v in BAD]
              + [[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": a}}]}]
                 for a in ["[" * 2000 + "]" * 2000, "{", "5", json.dumps(deep(150)), "\ud800", None, 5]]
              + [[{"role": "user", "content": [{"type": v, "text": "x"}]}] for v in BAD]),
             ("tools", [[{"type": "function", "function": {"name": "f", "parameters": v}}] for v in BAD]
              + [[{"type": "function", "function": {"name": "f", "parameters": deep_schema(n)}}]
                 for n in (60, 120, 500, 950)]),
             ("response_format", [{"type": "json_schema", "json_schema": {"name": "x", "schema": v}} for v in BAD]
              + [{"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(n)}}
                 for n in (60, 120, 500, 950)] + [{"type": v} for v in BAD])],
    "anthropic": [("messages", [[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": v,
                                                                "content": v}]}] for v in BAD]
                   + [[{"role": "user", "content": [{"type": v}]}] for v in BAD]),
                  ("tools", [[{"name": "f", "input_schema": v}] for v in BAD]
                   + [[{"name": "f", "input_schema": deep_schema(n)}] for n in (120, 500)]),
                  ("output_config", [{"format": {"type": "json_schema", "schema": v}} for v in BAD]
                   + [{"format": {"type": "json_schema", "schema": deep_schema(500)}}])],
    "ollama_chat": [("messages", [[{"role": "assistant", "content": "", "tool_calls": v}] for v in BAD]
                     + [[{"role": "assistant", "content": "", "tool_calls": [v]}] for v in BAD]
                     + [[{"role": "assistant", "content": "", "tool_calls": [{"function": v}]}] for v in BAD]),
                    ("options", [{"num_predict": v} for v in BAD] + [{"temperature": v} for v in BAD]
                     + [{"seed": v} for v in BAD] + [{"stop": v} for v in BAD]),
                    ("format", [deep_schema(n) for n in (120, 500, 950)])],
    "responses": [("input", [[{"type": "function_call", "call_id": "c", "name": "f", "arguments": a}]
                             for a in ["[" * 2000 + "]" * 2000, "{", json.dumps(deep(150))]]
                   + [[{"role": "user", "content": v}] for v in BAD] + [[{"type": v}] for v in BAD]),
                  ("tools", [[{"type": "function", "name": "f", "parameters": deep_schema(n)}] for n in (120, 500)]
                   + [[{"type": "function", "name": "f", "parameters": v}] for v in BAD])],
    "tokenize": [("messages", [[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                      "function": {"name": "f", "arguments": a}}]}]
                               for a in ["[" * 2000 + "]" * 2000, json.dumps(deep(150))]])],
}

# whole bodies of the wrong shape, as raw bytes, with and without a JSON Content-Type
RAW = [b"", b"null", b"5", b'"x"', b"[]", b"[1,2]", b"{", b"{}", b"\xff\xfe", b"[" * 5000, b'{"a":' * 2000,
       b'{"model": "m", "prompt": "\\ud800"}', b'{"model": NaN}', b'{"model": Infinity}', b"\x00" * 10]


def _cases():
    out = []
    for name, (path, base, fields) in SURFACES.items():
        for field in fields:
            for v in FIELD_BAD:
                out.append((f"{name}.{field}={json.dumps(v)[:20]}", path, {**base, field: v}))
        for field, values in NESTED.get(name, []):
            for v in values:
                out.append((f"{name}.{field}[nested]", path, {**base, field: v}))
        for raw in RAW:
            for ctype in ("application/json", None) if name in ("chat", "ollama_chat", "anthropic") else (None,):
                out.append((f"{name} raw {raw[:12]!r} {ctype}", path, (raw, ctype)))
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = ServerProcess(tiny_llama, "--served-model-name", "m", "--kv-cache-gb", "0.05", "--max-model-len", "512",
                      "--max-queue", "256")
    yield s
    out = s.stop()
    assert "Traceback" not in out, out[-4000:]


def _send(client: httpx.Client, case) -> tuple[str, int, str]:
    label, path, body = case
    if isinstance(body, tuple):
        raw, ctype = body
        r = client.post(path, content=raw, headers={"content-type": ctype} if ctype else {})
    else:
        # ASCII JSON: lone surrogates travel as \\ud800 escapes, as a client's would
        r = client.post(path, content=_encode(body), headers={"content-type": "application/json"})
    return label, r.status_code, r.text


def test_every_bad_value_on_every_surface_is_a_4xx_or_answered(server):
    assert len(CASES) >= 1200, len(CASES)
    with httpx.Client(base_url=server.url, timeout=120) as client, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: _send(client, c), CASES))
        gets = [client.get(p) for p in ("/ui/..%2f..%2fetc%2fpasswd", "/ui/%00", "/v1/models/%ff", "/v1/models/a/b",
                                         "/api/tags?x=" + "a" * 5000, "/status", "/metrics", "/ui/chat.js")]
    server_errors = [(label, status, text[:200]) for label, status, text in results if status >= 500]
    assert not server_errors, server_errors[:20]
    for label, status, text in results:
        if status >= 400:
            body = json.loads(text)  # every error is JSON, in its API's shape
            assert "error" in body or body.get("type") == "error", (label, text[:200])
    assert all(r.status_code < 500 for r in gets), [(r.url, r.status_code) for r in gets]
    refused = sum(status >= 400 for _, status, _ in results)
    print(f"\n{len(results)} requests: {refused} refused (4xx), {len(results) - refused} answered, 0 5xx")
