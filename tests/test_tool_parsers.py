"""Tool-call formats and reasoning markers, parsed from known model text, whole and
streamed in random chunk splits: the stream must give the same content and calls."""

import json
import random

import pytest

from macinfer.text import reasoning, tool_parsers
from macinfer.text.tool_parsers import ToolCallStream, detect, make, parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}

CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris", "days": 2})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>',
     "", [("a", {}), ("b", {"x": [1, 2]})]),
    ("hermes", "No tools needed: 2 < 3 and <tool_ is not a tag.", "No tools needed: 2 < 3 and <tool_ is not a tag.", []),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>", "<tool_call>\nnot json at all\n</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"q": 1}}; {"name": "b", "parameters": {}}',
     "", [("a", {"q": 1}), ("b", {})]),
    ("llama3_json", 'The answer is {"x": 1}.', 'The answer is {"x": 1}.', []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Sure. ",
     [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima", "days": 1}', "", [("get_weather", {"city": "Lima", "days": 1})]),
    ("qwen3_coder", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "I'll look.\n",
     [("get_weather", {"city": "New York", "days": 3})]),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_output(fmt, text, content, calls):
    got_content, got_calls = parse(make(fmt, [WEATHER]), text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
@pytest.mark.parametrize("seed", range(8))
def test_random_chunk_splits_give_the_same_result(fmt, text, content, calls, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = ToolCallStream(make(fmt, [WEATHER]))
    got_content, got_calls = "", []
    for p in pieces:
        c, k = stream.feed(p)
        got_content += c
        got_calls += k
        if fmt != "llama3_json":  # no marker text is ever shown as content
            for marker in stream.fmt.starts:
                assert marker not in got_content or marker in content
    c, k = stream.finish()
    assert got_content + c == content
    assert _calls(got_calls + k) == calls


def test_calls_are_emitted_as_soon_as_they_close():
    stream = ToolCallStream(make("hermes"))
    _, calls = stream.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert _calls(calls) == [("a", {})]


@pytest.mark.parametrize("template,fmt", [
    ("{% for tool in tools %}<tool_call>{{ tool }}</tool_call>{% endfor %}", "hermes"),
    ("<tool_call>\n<function=x>\n<parameter=y>", "qwen3_coder"),
    ("[AVAILABLE_TOOLS] ... [TOOL_CALLS]", "mistral"),
    ("{{- '<|python_tag|>' }}", "llama3_json"),
    ("<|im_start|>{{ message['content'] }}", None),
])
def test_format_detected_from_the_template(template, fmt):
    assert detect(template) == fmt


REASONING = [
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", False, "\nThe user wants 2+2.\n", "It is 4."),
    ("The user wants 2+2.\n</think>\n\nIt is 4.", True, "The user wants 2+2.\n", "It is 4."),
    ("Just an answer, no thinking.", False, "", "Just an answer, no thinking."),
    ("<think>\nunfinished thought", False, "\nunfinished thought", ""),
    ("  <think>a</think>b", False, "a", "b"),
]


@pytest.mark.parametrize("text,inside,want_r,want_c", REASONING)
@pytest.mark.parametrize("seed", range(6))
def test_reasoning_split_whole_and_streamed(text, inside, want_r, want_c, seed):
    assert reasoning.split(text, inside) == (want_r, want_c)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 10))))
    s = reasoning.ReasoningStream(inside)
    r = c = ""
    for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]:
        dr, dc = s.feed(piece)
        assert "<think>" not in dc and "</think>" not in dr
        r, c = r + dr, c + dc
    dr, dc = s.finish()
    assert (r + dr, c + dc) == (want_r, want_c)


def test_reasoning_detected_from_template():
    assert reasoning.template_reasons("{% if x %}<think>\n{{ r }}\n</think>{% endif %}")
    assert not reasoning.template_reasons("<|im_start|>")
    assert reasoning.prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert tool_parsers.FORMATS.keys() == {"hermes", "llama3_json", "mistral", "qwen3_coder"}


def test_chat_output_streams_reasoning_content_and_calls():
    from macinfer.server import chat_output

    template = "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call> ... </think>"
    plan = chat_output.plan([WEATHER], "auto", True, None, template)
    assert plan.tool_format == "hermes" and plan.reasoning and plan.grammar is None
    text = ('<think>\nweather needed\n</think>\n\nChecking.<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    proc = chat_output.ChatOutput(plan)
    parts: dict = {}
    for i in range(0, len(text), 5):
        parts = chat_output.merge(parts, proc.feed(text[i:i + 5]))
    parts = chat_output.merge(parts, proc.finish())
    assert parts["reasoning_content"] == "\nweather needed\n" and parts["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parts["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    assert proc.finish_reason("stop") == "tool_calls" and proc.finish_reason("length") == "length"
    msg, _ = chat_output.message(plan, text)
    assert msg["content"] == "Checking." and msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_forced_plans_use_a_grammar():
    from macinfer.server import chat_output

    named = chat_output.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, True, None, None)
    assert named.forced == "get_weather" and named.grammar and named.tool_format is None
    proc = chat_output.ChatOutput(named)
    first = proc.feed('{"city": ')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first["tool_calls"][1] == {"index": 0, "function": {"arguments": '{"city": '}}
    proc.feed('"Rome"}')
    assert json.loads(proc.calls[0].arguments) == {"city": "Rome"} and proc.finish_reason("stop") == "stop"
    required = chat_output.plan([WEATHER], "required", False, None, None)
    proc = chat_output.ChatOutput(required)
    assert proc.feed('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]') == {}
    done = proc.finish()
    assert done["tool_calls"][0]["function"]["name"] == "get_weather" and proc.finish_reason("stop") == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_auto_call():
    from macinfer.server import chat_output

    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    for parallel, names in ((True, ["a", "b"]), (False, ["a"])):
        plan = chat_output.plan([WEATHER], "auto", parallel, None, "<tool_call>")
        msg, _ = chat_output.message(plan, text)
        assert [c["function"]["name"] for c in msg["tool_calls"]] == names
