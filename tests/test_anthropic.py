"""POST /v1/messages with the official anthropic client, on the bundled SmolLM2."""

import anthropic
import httpx
import pytest

from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    s = ServerProcess(smollm2_gguf, "--served-model-name", "smollm2", "--kv-cache-gb", "0.1",
                      "--max-model-len", "1024", "--api-key", "sekret")
    yield s
    out = s.stop()
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0)


def test_message(client):
    m = client.messages.create(model="smollm2", max_tokens=12, messages=ASK, extra_body={"temperature": 0},
                               system="You are a helpful assistant.")
    assert m.type == "message" and m.role == "assistant" and "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    short = client.messages.create(model="smollm2", max_tokens=2, messages=ASK, extra_body={"temperature": 0})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    stopped = client.messages.create(model="smollm2", max_tokens=20, messages=ASK, extra_body={"temperature": 0},
                                     stop_sequences=["Paris"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert "Paris" not in stopped.content[0].text


def test_multi_turn_and_prefill(client):
    turns = ASK + [{"role": "assistant", "content": "The capital of France is Paris."},
                   {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}]
    m = client.messages.create(model="smollm2", max_tokens=12, messages=turns, extra_body={"temperature": 0})
    assert m.content[0].text
    prefill = ASK + [{"role": "assistant", "content": "The capital of France is"}]
    p = client.messages.create(model="smollm2", max_tokens=3, messages=prefill, extra_body={"temperature": 0})
    assert "Paris" in p.content[0].text  # the assistant turn is continued


def test_streaming_events_in_order(client):
    kinds, text = [], ""
    with client.messages.stream(model="smollm2", max_tokens=12, messages=ASK, extra_body={"temperature": 0}) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "Paris" in text and final.content[0].text == text and final.stop_reason == "end_turn"


def test_errors_are_anthropic_shaped(server, client):
    with pytest.raises(anthropic.BadRequestError, match="not in `tools`"):
        client.messages.create(model="smollm2", max_tokens=5, messages=ASK, tool_choice={"type": "tool", "name": "g"},
                               tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}])
    with pytest.raises(anthropic.BadRequestError, match="mcp_servers"):
        client.messages.create(model="smollm2", max_tokens=5, messages=ASK, extra_body={"mcp_servers": [{"x": 1}]})
    # Claude Code's own model names reach the one model served
    assert client.messages.create(model="claude-opus-4-8", max_tokens=2, messages=ASK).model == "smollm2"


def test_claude_code_fields_are_accepted(server, client):
    """What Claude Code sends besides the basics: a system message amid the conversation,
    `thinking: {type: adaptive}`, `service_tier` and a top-level `cache_control` (bookkeeping)."""
    msgs = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "And Spain?"}]
    r = client.messages.create(model="claude-opus-4-8", max_tokens=3, messages=msgs, thinking={"type": "adaptive"},
                               extra_body={"service_tier": "auto", "cache_control": {"type": "ephemeral"}})
    assert r.stop_reason in ("max_tokens", "end_turn")
    # Claude Code 2.1.3xx: an effort change as an empty system message carrying `output_config`
    # (adds nothing to the prompt), `thinking.display`, and its `HEAD /api/hello` probe.
    base = client.messages.create(model="x", max_tokens=1, messages=ASK)
    r = client.messages.create(model="x", max_tokens=1, thinking={"type": "adaptive", "display": "omitted"},
                               messages=[*ASK, {"role": "system", "content": [], "output_config": {"effort": "low"}}])
    assert r.usage.input_tokens == base.usage.input_tokens
    assert httpx.head(f"{server.url}/api/hello", headers={"x-api-key": "sekret"}).status_code == 200
    with pytest.raises(anthropic.BadRequestError, match="effort"):
        client.messages.create(model="x", max_tokens=1, messages=[
            *ASK, {"role": "system", "content": [], "output_config": {"effort": "extreme"}}])
    with pytest.raises(anthropic.BadRequestError, match="mcp_servers"):  # still refused: it would change the answer
        client.messages.create(model="x", max_tokens=3, messages=ASK, extra_body={"mcp_servers": [{"y": 1}]})
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "smollm2", "max_tokens": 5, "messages": ASK})
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "sekret"},
                   json={"model": "smollm2", "messages": ASK})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_context_management_clears_old_tool_results(server, client):
    """Claude Code's `context_management`: past the trigger, the oldest tool results are
    replaced by a placeholder, the last `keep` kept; the answer says what was cleared."""
    def turn(i):
        return [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "read",
                                                    "input": {"path": f"f{i}"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                              "content": f"file {i}: " + "lorem ipsum " * 40}]}]
    msgs = [*ASK, *[m for i in range(4) for m in turn(i)], {"role": "user", "content": "Summarize."}]
    tools = [{"name": "read", "description": "read a file", "input_schema": {"type": "object"}}]
    body = {"model": "x", "max_tokens": 2, "messages": msgs, "tools": tools, "tool_choice": {"type": "none"}}
    full = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "sekret"}, json=body).json()["usage"]["input_tokens"]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
            "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": True}
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "sekret"},
                   json={**body, "context_management": {"edits": [edit, {"type": "clear_thinking_20251015"}]}})
    assert r.status_code == 200, r.text
    (applied,) = r.json()["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 3
    assert r.json()["usage"]["input_tokens"] < full - applied["cleared_input_tokens"] // 2
    quiet = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "sekret"}, json={
        **body, "context_management": {"edits": [{**edit, "trigger": {"type": "input_tokens", "value": 10**6}}]}})
    assert quiet.json()["context_management"] == {"applied_edits": []}
    assert quiet.json()["usage"]["input_tokens"] == full
    bad = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "sekret"},
                     json={**body, "context_management": {"edits": [{"type": "compact_20260101"}]}})
    assert bad.status_code == 400 and "context_management" in bad.text
