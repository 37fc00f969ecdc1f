"""The assistant turn's structure: what a chat request asks for (tools, tool choice,
response format, reasoning) and how the generated text becomes reasoning, content
and tool calls, whole or streamed.

Forced calls (`tool_choice` "required" or a named function) and `response_format`
are enforced by constrained decoding (a JSON-schema grammar, see
engine/structured.py), so they hold for any model. With a named function the
output is the arguments object; with "required" it is a JSON array of
`{"name", "parameters"}` objects. `tool_choice` "auto" lets the model choose, in the
tool-call format its chat template teaches (tool_parsers.detect).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from macinfer.text import reasoning as reasoning_mod
from macinfer.text import tool_parsers
from macinfer.engine.structured import GrammarError, json_schema_grammar
from macinfer.text.tool_parsers import ToolCall, ToolCallStream
from macinfer.text import json_limits


class PlanError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ChatPlan:
    tools: list[dict] | None = None  # given to the chat template
    grammar: str | None = None
    tool_format: str | None = None  # "auto": the format to parse calls from
    forced: str | None = None  # "required", or the name of the forced function
    reasoning: bool = False
    skip_special_tokens: bool = True
    grammar_param: str | None = None  # the request field the grammar comes from
    parallel: bool = True  # False: at most one tool call (parallel_tool_calls)
    tool_specs: list[dict] = field(default_factory=list)
    # A thinking budget: output tokens before the think block is closed with `thinking_end`
    # (token ids), counted once it is open (in the output, or opened by the prompt).
    thinking_budget: int | None = None
    thinking_end: tuple[int, ...] = ()
    thinking_open: bool = False


def _fn_schema(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def plan(tools: list[dict] | None, tool_choice: Any, parallel: bool, response_format: dict | None,
         chat_template: Any, tool_parser: str | None = None, reasoning: bool | None = None,
         renders_tools: bool = True) -> ChatPlan:
    """tools: OpenAI tool dicts; tool_choice: "none"/"auto"/"required"/{"type": "function", ...};
    response_format: OpenAI's dict. `tool_parser` overrides the format found in the template.
    `renders_tools`: whether the template puts `tools` in the prompt at all (see `generic`)."""
    p = ChatPlan(tools=tools or None, tool_specs=[t["function"] for t in tools or []], parallel=parallel)
    p.reasoning = reasoning_mod.template_reasons(chat_template) if reasoning is None else reasoning
    names = {f["name"]: f for f in p.tool_specs}
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise PlanError("tool_choice needs `tools`", "tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise PlanError(f"tool_choice names {name!r}, which is not in `tools`", "tool_choice")
        p.forced = name
        p.grammar, p.grammar_param = _grammar(_fn_schema(names[name]), "tools"), "tools"
    elif choice == "required":
        p.forced = "required"
        p.grammar, p.grammar_param = _grammar(_calls_schema(names, parallel), "tools"), "tools"
    elif choice == "auto":
        p.tool_format = tool_parser or tool_parsers.detect(chat_template)
        if p.tool_format is None or not renders_tools:
            # The template teaches no call format, or never shows the model its tools: describe
            # them in a system block and hold the answer to a call or a text reply (llama.cpp's
            # generic format), so tools are never silently dropped.
            p.tool_format, p.forced, p.tools = None, "generic", None
            p.grammar, p.grammar_param = _grammar(generic_schema(names, parallel), "tools"), "tools"
        else:
            p.skip_special_tokens = tool_parsers.FORMATS[p.tool_format].skip_special_tokens
    if response_format and response_format.get("type") != "text":
        if p.grammar is not None:
            raise PlanError("response_format cannot be combined with a forced tool call", "response_format")
        p.grammar_param = "response_format"
        if response_format["type"] == "json_object":
            p.grammar = _grammar(None, "response_format")
        else:
            spec = response_format.get("json_schema") or {}
            if not isinstance(spec.get("schema"), dict):
                raise PlanError("response_format json_schema needs json_schema.schema", "response_format")
            p.grammar = _grammar(spec["schema"], "response_format")
    if p.grammar is not None:
        p.reasoning = False  # the grammar holds from the first token
    return p


def _calls_schema(names: dict[str, dict], parallel: bool) -> dict:
    call = [{"type": "object", "properties": {"name": {"const": n}, "parameters": _fn_schema(f)},
             "required": ["name", "parameters"], "additionalProperties": False} for n, f in names.items()]
    array = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return array


def generic_schema(names: dict[str, dict], parallel: bool) -> dict:
    """The generic format's answer: {"tool_calls": [{"name", "parameters"}...]} or {"response": text}."""
    return {"anyOf": [
        {"type": "object", "properties": {"tool_calls": _calls_schema(names, parallel)}, "required": ["tool_calls"],
         "additionalProperties": False},
        {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
         "additionalProperties": False}]}


def generic_system_block(tool_specs: list[dict]) -> str:
    """What the model is told in the generic format: the tools, and the two answer shapes."""
    listed = "\n".join(json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f},
                                  ensure_ascii=False) for f in tool_specs)
    return ("You can call these tools (JSON Schema of each tool's parameters):\n" + listed +
            '\nAnswer with JSON only: {"tool_calls": [{"name": "<tool name>", "parameters": {...}}]} to call tools, '
            'or {"response": "<your answer>"} to answer in text.')


def with_generic_tools(messages: list[dict], tool_specs: list[dict]) -> list[dict]:
    """The conversation with the generic format's system block first (merged into a leading
    system message), and earlier tool calls and results written as text in that format."""
    block = generic_system_block(tool_specs)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "parameters": c["function"].get("arguments")}
                     for c in m["tool_calls"]]
            m = {"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"Tool result: {m.get('content', '')}"}
        out.append(m)
    if out and out[0].get("role") == "system":
        return [{"role": "system", "content": f"{out[0]['content']}\n\n{block}"}] + out[1:]
    return [{"role": "system", "content": block}] + out


def _grammar(schema: dict | None, param: str) -> str:
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise PlanError(str(e), param) from None



def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: tool-call arguments as objects."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json_limits.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn})
            m["tool_calls"] = fixed
        out.append(m)
    return out


class ChatOutput:
    """Text deltas of one choice in; reasoning, content and tool-call deltas out."""

    def __init__(self, p: ChatPlan, prompt_tail: str = ""):
        self.plan = p
        self.reasoning = (reasoning_mod.ReasoningStream(reasoning_mod.prompt_opens_think(prompt_tail))
                          if p.reasoning else None)
        self.tools = ToolCallStream(tool_parsers.make(p.tool_format, p.tools)) if p.tool_format else None
        self.forced_text = ""
        self.calls: list[ToolCall] = []
        self._named: ToolCall | None = None

    def feed(self, delta: str, final: bool = False) -> dict[str, Any]:
        """{"reasoning_content"?, "content"?, "tool_calls"?: [OpenAI delta dicts]}."""
        out: dict[str, Any] = {}
        if self.plan.forced:
            return self._forced(delta, final)
        text = delta
        if self.reasoning is not None:
            r, text = self.reasoning.feed(delta, final)
            if r:
                out["reasoning_content"] = r
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text, final)
            if not self.plan.parallel:  # parallel_tool_calls: false keeps the first call only
                calls = calls[: max(0, 1 - len(self.calls))]
        if text:
            out["content"] = text
        if calls:
            out["tool_calls"] = [c.openai(len(self.calls) + i) for i, c in enumerate(calls)]
            self.calls += calls
        return out

    def _forced(self, delta: str, final: bool) -> dict[str, Any]:
        self.forced_text += delta
        if self.plan.forced not in ("required", "generic"):  # the named function's arguments, streamed as they come
            out: list[dict] = []
            if self._named is None:
                self._named = ToolCall(self.plan.forced, "")
                self.calls.append(self._named)
                out.append({**self._named.openai(0), "function": {"name": self._named.name, "arguments": ""}})
            self._named.arguments += delta
            if delta:
                out.append({"index": 0, "function": {"arguments": delta}})
            return {"tool_calls": out} if out else {}
        if not final:
            return {}
        try:
            items = json.loads(self.forced_text)
            if self.plan.forced == "generic":  # {"tool_calls": [...]} or {"response": text}
                if "response" in items:
                    return {"content": items["response"]}
                items = items["tool_calls"]
            calls = [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        except (ValueError, KeyError, TypeError):  # cut short (max_tokens): no calls to return
            return {"content": self.forced_text} if self.forced_text else {}
        self.calls += calls
        return {"tool_calls": [c.openai(i) for i, c in enumerate(calls)]}

    def finish(self) -> dict[str, Any]:
        return self.feed("", final=True)

    def parts(self, out) -> dict[str, Any]:
        """The chat parts of one engine output; the finishing output carries the rest."""
        parts = self.feed(out.delta_text)
        return merge(parts, self.finish()) if out.finished else parts

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason == "stop" and self.calls and self.plan.forced in (None, "required", "generic"):
            return "tool_calls"
        return engine_reason


async def parts_stream(proc: ChatOutput, gen):
    """(engine output, its chat parts) for each output of one streamed choice; parts is
    None for a failed request (the last item). The finishing output carries the rest."""
    async for _, out in gen:
        if out.finish_reason == "error":
            yield out, None
            return
        yield out, proc.parts(out)


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two feed() results as one (strings joined, call lists appended)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, "" if isinstance(v, str) else []) + v
    return out


def message(p: ChatPlan, text: str, prompt_tail: str = "") -> tuple[dict[str, Any], ChatOutput]:
    """The assistant message of a complete output (non-streaming)."""
    proc = ChatOutput(p, prompt_tail)
    parts = merge(proc.feed(text), proc.finish())
    msg: dict[str, Any] = {"role": "assistant", "content": parts.get("content")}
    if "reasoning_content" in parts:
        msg["reasoning_content"] = parts["reasoning_content"]
    if proc.calls:
        msg["tool_calls"] = [c.openai() for c in proc.calls]
    elif msg["content"] is None:
        msg["content"] = ""
    return msg, proc


@dataclass
class ChatTurn:
    """A chat request made ready: prompt ids, what the answer must look like, and the
    prompt's last text (whether the template opened a think block)."""
    ids: list[int]
    plan: ChatPlan
    prompt_tail: str = ""
    ignored: list[str] = field(default_factory=list)  # fields this model cannot act on (a response header)
    images: Any = None  # `vision.inputs.ImageInputs` when the messages hold images
