"""Tool calling, structured output and reasoning through the OpenAI, Anthropic and
Responses APIs with the official clients, on the bundled SmolLM2. Forced calls and
response formats are enforced by constrained decoding, so their outputs must
validate against the schemas (jsonschema), streamed or not."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import tiny_model_dir
from tests.server_process import ServerProcess
from tests.test_server import client, server  # noqa: F401  (the same SmolLM2 server fixtures)

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _valid(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_a_valid_call(client, stream):
    kw = dict(model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and len(msg.tool_calls) == 1
        assert msg.tool_calls[0].function.name == "get_weather" and msg.tool_calls[0].id.startswith("call_")
        _valid(msg.tool_calls[0])
        return
    calls: dict[int, dict] = {}
    with client.chat.completions.create(**kw, stream=True) as s:
        for chunk in s:
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] = (d.function.name if d.function and d.function.name else c["name"])
                c["arguments"] += d.function.arguments or "" if d.function else ""
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice(client, stream):
    kw = dict(model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120, tool_choice="required",
              parallel_tool_calls=False)
    if stream:
        acc = client.chat.completions.create(**kw, stream=True)
        deltas, finish = [], None
        for chunk in acc:
            if chunk.choices:
                deltas += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and len(deltas) == 1
        assert deltas[0].function.name in SCHEMAS
        jsonschema.validate(json.loads(deltas[0].function.arguments), SCHEMAS[deltas[0].function.name])
        return
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in SCHEMAS
    _valid(calls[0])


def test_tool_results_go_back_to_the_model(client):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=20)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt,
              temperature=0.7, seed=1, max_tokens=60)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_parse_with_pydantic(client):
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=150)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    class City(BaseModel):  # bounded fields: a 135M model repeats itself inside long strings
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int = Field(ge=0, le=100_000_000)

    parsed = client.beta.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Describe Paris."}], response_format=City,
        temperature=0, max_tokens=200)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize("body,param,fragment", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in `tools`"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": {"a": {"$ref": "#/nope"}}}}}}, "response_format", "schema"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "forced"),
])
def test_bad_tool_and_format_requests_are_400(server, body, param, fragment):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert fragment in r.json()["error"]["message"]


def test_anthropic_forced_tool_use(server):
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}]
    m = a.messages.create(model="smollm2", max_tokens=80, messages=ASK, tools=tools,
                          tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, WEATHER)
    # The result goes back as a tool_result block; "any" forces a call again.
    turns = ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "21 C"}]}]
    again = a.messages.create(model="smollm2", max_tokens=80, messages=turns, tools=tools,
                              tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert again.stop_reason == "tool_use"
    with a.messages.stream(model="smollm2", max_tokens=80, messages=ASK, tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    streamed = [b for b in final.content if b.type == "tool_use"][0]
    assert streamed.input == use[0].input  # same greedy call, streamed


def test_responses_tools_and_text_format(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather", "parameters": WEATHER}]
    r = client.responses.create(model="smollm2", input="Weather in Paris?", tools=tools, tool_choice="required",
                                temperature=0, max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = client.responses.create(model="smollm2", temperature=0, max_output_tokens=20, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C, clear"}])
    assert follow.output_text
    fmt = client.responses.create(model="smollm2", input="Invent a person.", temperature=0, max_output_tokens=60,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                   "strict": True}})
    jsonschema.validate(json.loads(fmt.output_text), PERSON)
    with client.responses.stream(model="smollm2", input="Weather in Paris?", tools=tools, tool_choice="required",
                                 temperature=0, max_output_tokens=80) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [o.arguments for o in final.output if o.type == "function_call"] == [calls[0].arguments]


def test_reasoning_content_from_a_template_that_thinks(tmp_path):
    """A template that opens <think> in the generation prompt: the (random) tiny model's
    whole output is reasoning until it closes the block, which it never does."""
    path, _ = tiny_model_dir(tmp_path, "llama")
    cfg_path = f"{path}/tokenizer_config.json"
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                            "<assistant><think>\n{# reasoning ends with </think> #}")
    json.dump(cfg, open(cfg_path, "w"))
    s = ServerProcess(path, "--kv-cache-gb", "0.01", "--served-model-name", "tiny")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0)
        msg = r.choices[0].message
        assert msg.model_extra["reasoning_content"] and not msg.content
        streamed = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                           for ch in c.chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                                               temperature=0, stream=True) if ch.choices)
        assert streamed == msg.model_extra["reasoning_content"]
        # Codex asks for reasoning.encrypted_content (and sends `reasoning: {}`, `client_metadata`):
        # the reasoning item carries its text there, streamed and not; the item sent back is accepted.
        body = {"model": "gpt-5-codex", "input": "Hi", "max_output_tokens": 8, "temperature": 0,
                "include": ["reasoning.encrypted_content"], "reasoning": {}, "client_metadata": {"x": "y"}}
        item = httpx.post(f"{s.url}/v1/responses", json=body, timeout=30).json()["output"][0]
        assert item["type"] == "reasoning" and item["encrypted_content"] == item["content"][0]["text"]
        with httpx.stream("POST", f"{s.url}/v1/responses", json={**body, "stream": True}, timeout=30) as r:
            done = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        done = [e["item"] for e in done if e["type"] == "response.output_item.done"]
        assert done[0]["encrypted_content"] == item["encrypted_content"]
        again = httpx.post(f"{s.url}/v1/responses", timeout=30, json={**body, "input": [
            {"type": "message", "role": "user", "content": "Hi"}, item,
            {"type": "message", "role": "user", "content": "And?"}]})
        assert again.status_code == 200, again.text
        bad = httpx.post(f"{s.url}/v1/responses", json={**body, "include": ["file_search_call.results"]})
        assert bad.status_code == 400 and "include" in bad.json()["error"]["message"]
    finally:
        assert "Traceback" not in s.stop()


def test_every_choice_of_n_follows_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Invent a person."}],
                                       response_format=fmt, temperature=1.0, seed=5, n=2, max_tokens=60)
    assert len(r.choices) == 2
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_reasoning_effort_and_thinking_budget(tmp_path):
    """Effort fields from every API map onto the template's `enable_thinking`; a thinking
    budget closes the think block at that many tokens (the tiny model never closes it);
    a template with no thinking control says it ignored the effort."""
    path, _ = tiny_model_dir(tmp_path, "llama")
    cfg_path = f"{path}/tokenizer_config.json"
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
                            "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
                            "{% else %}<think>\n{% endif %}{# reasoning ends with </think> #}")
    json.dump(cfg, open(cfg_path, "w"))
    s = ServerProcess(path, "--kv-cache-gb", "0.01", "--served-model-name", "tiny")
    try:
        def chat(**extra):
            r = httpx.post(f"{s.url}/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            return r

        on, off = chat(reasoning_effort="high").json(), chat(reasoning_effort="none").json()
        assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + len("</think>") - 1
        assert on["choices"][0]["message"]["reasoning_content"] and not on["choices"][0]["message"]["content"]
        # (byte tokenizer: a token a character) the block is closed after 1 + 5 tokens of it
        budget = chat(thinking_budget=5).json()["choices"][0]["message"]
        assert 0 < len(budget["reasoning_content"]) <= 6 + 1 < len(on["choices"][0]["message"]["reasoning_content"])
        # Anthropic: thinking.budget_tokens, output_config.effort; Responses: reasoning.effort
        a = httpx.post(f"{s.url}/v1/messages", timeout=30, json={
            "model": "claude-x", "max_tokens": 24, "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 5}, "output_config": {"effort": "high"},
            "temperature": 0}).json()  # (greedy: sampled, the tiny model may end at once, leaving no thinking)
        assert a["content"][0]["type"] == "thinking" and len(a["content"][0]["thinking"]) <= 7, a
        # display "omitted": the thinking block is there, its text is not (streamed: no thinking deltas)
        hidden = {"model": "claude-x", "max_tokens": 24, "messages": [{"role": "user", "content": "Hi"}],
                  "thinking": {"type": "adaptive", "display": "omitted"},
                  "temperature": 0}  # (sampled, the tiny model may end at once: no thinking then)
        a = httpx.post(f"{s.url}/v1/messages", timeout=30, json=hidden).json()
        assert a["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}, a
        events = httpx.post(f"{s.url}/v1/messages", timeout=30, json={**hidden, "stream": True}).text
        assert '"content_block": {"type": "thinking"' in events and "thinking_delta" not in events
        r = httpx.post(f"{s.url}/v1/responses", timeout=30, json={
            "model": "x", "input": "Hi", "max_output_tokens": 8, "reasoning": {"effort": "minimal"}})
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == off["usage"]["prompt_tokens"], r.text
        bad = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                "thinking_budget": 5, "reasoning_effort": "none"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_budget"
    finally:
        assert "Traceback" not in s.stop()
    plain, _ = tiny_model_dir(tmp_path / "plain", "llama")
    s = ServerProcess(plain, "--kv-cache-gb", "0.01")
    try:
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "reasoning_effort": "high"})
        assert r.status_code == 200 and r.headers["x-macinfer-ignored"] == "reasoning_effort"
        r = httpx.post(f"{s.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "thinking_budget": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_budget"
    finally:
        assert "Traceback" not in s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tools_on_a_template_without_tools(server, client, stream):
    """SmolLM2's template renders no tools: they are described in a system block (the generic
    format) and the answer is held to a call of a listed tool or a text reply."""
    plain = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2, temperature=0)
    kw = dict(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        calls = {}
        for ch in chunks:
            for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                calls.setdefault(d.index, {"name": "", "arguments": ""})
                calls[d.index]["name"] += d.function.name or ""
                calls[d.index]["arguments"] += d.function.arguments or ""
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        usage = chunks[-1].usage
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    else:
        r = client.chat.completions.create(**kw)
        calls = {i: {"name": c.function.name, "arguments": c.function.arguments}
                 for i, c in enumerate(r.choices[0].message.tool_calls or [])}
        text, usage, finish = r.choices[0].message.content or "", r.usage, [r.choices[0].finish_reason]
    assert usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools reached the prompt
    if calls:
        for c in calls.values():
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
        assert finish == ["tool_calls"]
    else:
        assert text and not text.lstrip().startswith('{"response"')


def test_auto_tools_without_template_support_through_anthropic_and_responses(server):
    a = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    msg = a.messages.create(model="smollm2", max_tokens=80, messages=ASK, tools=[
        {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}])
    blocks = [b for b in msg.content if b.type in ("tool_use", "text")]
    assert blocks and all(b.type == "text" or (b.name == "get_weather" and jsonschema.validate(b.input, WEATHER) is None)
                          for b in blocks)
    r = httpx.post(f"{server.url}/v1/responses", timeout=300, json={
        "model": "smollm2", "input": "What is the weather in Paris?", "max_output_tokens": 80,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]})
    assert r.status_code == 200, r.text
    kinds = {o["type"] for o in r.json()["output"]}
    assert kinds & {"function_call", "message"}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_namespace_tools_are_flattened_and_calls_split_back(server, stream):
    """Codex groups MCP tools as `namespace` tools: the model sees `<namespace>__<name>`
    functions, and calls come back with `name` and `namespace` apart, as Codex routes them."""
    body = {"model": "codex", "input": "What is the weather in Paris?", "max_output_tokens": 60, "temperature": 0,
            "tools": [{"type": "namespace", "name": "mcp__weather", "description": "Weather tools",
                       "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]},
                      {"type": "function", "name": "get_time", "parameters": TIME}],
            "tool_choice": {"type": "function", "name": "mcp__weather__get_weather"}}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=300) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        call = next(e["item"] for e in events if e["type"] == "response.output_item.done"
                    and e["item"]["type"] == "function_call")
    else:
        r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=300)
        assert r.status_code == 200, r.text
        call = next(o for o in r.json()["output"] if o["type"] == "function_call")
    assert (call["namespace"], call["name"]) == ("mcp__weather", "get_weather")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    follow = httpx.post(f"{server.url}/v1/responses", timeout=300, json={**body, "tool_choice": "none", "input": [
        {"type": "message", "role": "user", "content": "What is the weather in Paris?"}, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}]})
    assert follow.status_code == 200, follow.text
    # Codex also sends outputs without a call (its `agent` namespace's goal_objective), and
    # outputs as text parts: the first becomes a tool message named as namespace tools are
    # flattened, the second a text.
    base = {**body, "tool_choice": "none", "max_output_tokens": 1}
    extra = httpx.post(f"{server.url}/v1/responses", timeout=300, json={**base, "input": [
        {"type": "message", "role": "user", "content": "Hi"}, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": [{"type": "input_text", "text": "21 C"}]},
        {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "say hi"}]})
    assert extra.status_code == 200, extra.text
    bad = httpx.post(f"{server.url}/v1/responses", timeout=300, json={**base, "input": [
        {"type": "function_call_output", "output": "x"}]})
    assert bad.status_code == 400 and "call_id" in bad.json()["error"]["message"]
