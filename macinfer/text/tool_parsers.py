"""Tool calls in model text: the formats chat templates teach, parsed whole or as a stream.

Each format has start markers that open a tool call. Streaming (`ToolCallStream`):
text before the first marker is content, emitted as it comes except for a tail
that could still be the start of a marker; from the marker on, text is held and
every complete call is emitted as soon as its closing marker (or the end of the
output) arrives. A call that does not parse is given back as content, never lost.

Formats (named as vLLM's parsers are):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3, Hermes, many fine-tunes)
- llama3_json: `<|python_tag|>` or bare `{"name": ..., "parameters": {...}}`, `;`-separated (Llama 3.1-3.3)
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}` (newer tokenizers)
- qwen3_coder: `<tool_call><function=name><parameter=p>value</parameter></function></tool_call>` (XML)
"""

from __future__ import annotations

import json
import re
import uuid
from macinfer.text import json_limits
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _args_json(value: Any) -> str | None:
    if isinstance(value, str):  # some models emit the arguments already serialized
        try:
            value = json_limits.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_from_obj(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _args_json(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else ToolCall(obj["name"], args)


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after spaces) and where it ends."""
    s = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(s)
    except ValueError:
        return None
    return value, len(text) - len(s) + end


class Format:
    name = ""
    starts: tuple[str, ...] = ()
    skip_special_tokens = True  # False when the markers are special tokens the text must keep

    def take(self, held: str, final: bool) -> tuple[list[ToolCall], str, bool] | None:
        """From `held` (text from a start marker on): the calls it completes, the
        rest, and whether the held text is not a tool call after all (given back as
        content). None: wait for more text."""
        raise NotImplementedError


class Hermes(Format):
    name = "hermes"
    starts = ("<tool_call>",)

    def take(self, held, final):
        end = held.find("</tool_call>")
        if end < 0 and not final:
            return None
        body = held[len("<tool_call>"): end if end >= 0 else len(held)]
        parsed = _json_prefix(body)
        call = _call_from_obj(parsed[0]) if parsed else None
        if call is None:
            return [], "", True
        return [call], held[end + len("</tool_call>"):] if end >= 0 else "", False


class Llama3Json(Format):
    name = "llama3_json"
    starts = ("<|python_tag|>", "{")
    skip_special_tokens = False

    def take(self, held, final):
        if not final:  # bare JSON has no closing marker: the whole output is the call(s)
            return None
        body = held.removeprefix("<|python_tag|>")
        calls = []
        while body.strip():
            parsed = _json_prefix(body)
            call = _call_from_obj(parsed[0]) if parsed else None
            if call is None:
                return [], "", True
            calls.append(call)
            body = body[parsed[1]:].lstrip().removeprefix(";")
        return (calls, "", False) if calls else ([], "", True)


class Mistral(Format):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    skip_special_tokens = False

    def take(self, held, final):
        body = held[len("[TOOL_CALLS]"):]
        if "[ARGS]" in body:  # [TOOL_CALLS]name[ARGS]{...}, possibly repeated
            if not final:
                return None
            calls = []
            for chunk in body.split("[TOOL_CALLS]"):
                name, _, args = chunk.partition("[ARGS]")
                parsed = _json_prefix(args)
                call = _call_from_obj({"name": name.strip(), "arguments": parsed[0]}) if parsed else None
                if call is None:
                    return [], "", True
                calls.append(call)
            return calls, "", False
        parsed = _json_prefix(body)
        if parsed is None:
            return None if not final else ([], "", True)
        value, end = parsed
        calls = [_call_from_obj(v) for v in (value if isinstance(value, list) else [value])]
        if not calls or any(c is None for c in calls):
            return [], "", True
        return calls, body[end:], False


class Qwen3Coder(Format):
    name = "qwen3_coder"
    starts = ("<tool_call>",)

    def __init__(self, tools: list[dict] | None = None):
        self.types = {}
        for t in tools or []:
            fn = t.get("function", t)
            self.types[fn.get("name")] = (fn.get("parameters") or {}).get("properties", {})

    def _value(self, fn: str, param: str, raw: str) -> Any:
        kind = self.types.get(fn, {}).get(param, {}).get("type", "string")
        if kind == "string":
            return raw
        try:
            return json_limits.loads(raw)
        except ValueError:
            return raw

    def take(self, held, final):
        end = held.find("</tool_call>")
        if end < 0 and not final:
            return None
        body = held[len("<tool_call>"): end if end >= 0 else len(held)]
        m = re.search(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", body, re.S)
        if m is None:
            return [], "", True
        fn = m.group(1)
        args = {p: self._value(fn, p, v.strip("\n"))
                for p, v in re.findall(r"<parameter=([^>\s]+)>(.*?)</parameter>", m.group(2), re.S)}
        rest = held[end + len("</tool_call>"):] if end >= 0 else ""
        return [ToolCall(fn, json.dumps(args, ensure_ascii=False))], rest, False


FORMATS = {f.name: f for f in (Hermes, Llama3Json, Mistral, Qwen3Coder)}


def detect(chat_template: str | dict | None) -> str | None:
    """The tool-call format a chat template teaches, or None if it teaches none."""
    if isinstance(chat_template, dict):
        chat_template = " ".join(str(v) for v in chat_template.values())
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return None


def make(name: str, tools: list[dict] | None = None) -> Format:
    cls = FORMATS[name]
    return cls(tools) if cls is Qwen3Coder else cls()


class ToolCallStream:
    """Feed text deltas; get (content delta, completed calls) back."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self.held = ""  # from a start marker on
        self.pending = ""  # content tail that may be the start of a marker
        self.calls: list[ToolCall] = []
        self.started = False  # text other than whitespace seen (bare-JSON formats start only there)

    def _marker_at(self, text: str) -> int:
        hits = []
        for s in self.fmt.starts:
            if s == "{":  # bare JSON counts only as the whole output
                if not self.started and text.lstrip().startswith("{"):
                    hits.append(len(text) - len(text.lstrip()))
                continue
            if (i := text.find(s)) >= 0:
                hits.append(i)
        return min(hits) if hits else -1

    def _partial_marker(self, text: str) -> int:
        """Length of the longest tail of `text` that begins a marker."""
        best = 0
        for s in self.fmt.starts:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    best = max(best, k)
                    break
        return best

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        content, calls, text = "", [], delta
        while True:
            if self.held:
                self.held += text
            else:
                text = self.pending + text
                self.pending = ""
                at = self._marker_at(text)
                if at >= 0:
                    plain, self.held = text[:at], text[at:]
                else:
                    keep = 0 if final else self._partial_marker(text)
                    plain, self.pending = text[: len(text) - keep], text[len(text) - keep:]
                if not plain.strip() and (self.calls or calls):  # whitespace between or after calls
                    self.pending, plain = ("" if final else plain) + self.pending, ""
                self.started = self.started or bool(plain.strip())
                content += plain
            text = ""
            if not self.held:
                break
            got = self.fmt.take(self.held, final)
            if got is None:
                break
            done, rest, not_a_call = got
            if not_a_call:  # given back as content, and no marker is looked for in it again
                content += self.held
                self.held, self.started = "", True
                break
            self.held = ""
            calls += done
            if not rest:
                break
            text = rest
        self.calls += calls
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self.feed("", final=True)


def parse(fmt: Format, text: str) -> tuple[str, list[ToolCall]]:
    """Content and tool calls of a complete output."""
    stream = ToolCallStream(fmt)
    content, calls = stream.feed(text)
    more, more_calls = stream.finish()
    return content + more, calls + more_calls
