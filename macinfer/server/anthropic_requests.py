"""The Anthropic Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`) and its
translation into the OpenAI chat request the server serves: `tool_use` and `tool_result`
blocks into assistant tool calls and tool messages, `tool_choice` any/tool into
"required"/a named function, `thinking` into the template's `enable_thinking`; fields this
server cannot act on refused with their names."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from macinfer.server import context_editing
from macinfer.server.context_editing import ContextManagement
from macinfer.server.protocol import _NO_INPUT, ChatCompletionRequest

_REFUSED = ("mcp_servers", "container")
_BLOCKS = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
           "system": ("text",)}
# Accepted, without effect on the output: billing and provider-side caching hints.
_BOOKKEEPING = ("service_tier", "cache_control")


class TextBlock(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class OutputFormat(BaseModel):
    """Structured output: the answer is JSON matching `schema` (the grammar path)."""
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")
    name: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.schema_}}


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["low", "medium", "high", "max"] | None = None  # mapped as `reasoning_effort`
    format: OutputFormat | None = None  # Anthropic's structured output (Claude Code's title request)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant", "system"]  # system: Claude Code puts some mid-conversation
    content: str | list[dict[str, Any]]
    # A mid-conversation system message may change the effort from there on (Claude Code
    # sends one, with empty content); the latest one in the conversation wins over the top level.
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _known_blocks(self):
        if isinstance(self.content, list):
            for i, b in enumerate(self.content):
                kind = b.get("type")
                if not isinstance(kind, str):
                    raise ValueError(f"content[{i}]: a content block needs a `type`")
                if kind in _NO_INPUT:
                    raise ValueError(f"content[{i}] is a {kind} block: {_NO_INPUT[kind]} input is not supported")
                if kind not in _BLOCKS[self.role]:
                    raise ValueError(f"content[{i}]: a {self.role} message cannot hold a {kind!r} block "
                                     f"(supported: {', '.join(_BLOCKS[self.role])})")
                if kind == "text" and not isinstance(b.get("text"), str):
                    raise ValueError(f"content[{i}]: a text block needs `text`")
                if kind == "image":
                    source = b.get("source")
                    if not isinstance(source, dict) or source.get("type") != "base64" \
                            or not isinstance(source.get("data"), str) or not isinstance(source.get("media_type"), str):
                        raise ValueError(f"content[{i}]: an image block needs a base64 `source` with `media_type` "
                                         "and `data` (url and file sources are not fetched)")
                if kind == "tool_use" and not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                                               and isinstance(b.get("input"), dict)):
                    raise ValueError(f"content[{i}]: a tool_use block needs `id`, `name` and an `input` object")
                if kind == "tool_result":
                    if not isinstance(b.get("tool_use_id"), str):
                        raise ValueError(f"content[{i}]: a tool_result block needs `tool_use_id`")
                    result = b.get("content")
                    if not (result is None or isinstance(result, str) or (isinstance(result, list) and all(
                            isinstance(r, dict) for r in result))):
                        raise ValueError(f"content[{i}].content: a tool_result's content is a string or a list "
                                         "of content blocks")
                    for j, r in enumerate(result if isinstance(result, list) else []):
                        if r.get("type") != "text":
                            raise ValueError(f"content[{i}].content[{j}]: tool_result content holds a "
                                             f"{r.get('type')!r} block; only text is supported")
                        if not isinstance(r.get("text"), str):
                            raise ValueError(f"content[{i}].content[{j}]: a text block needs `text`")
        return self

    def blocks(self) -> list[dict[str, Any]]:
        return [{"type": "text", "text": self.content}] if isinstance(self.content, str) else self.content


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["enabled", "disabled", "adaptive"]  # adaptive: the model decides; thinking is on
    budget_tokens: int | None = Field(default=None, ge=1)
    # omitted: thinking blocks come back with empty text (the model still thinks), as Anthropic does
    display: Literal["summarized", "omitted"] | None = None


def _result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for b in content or []:
        if b.get("type") != "text":
            raise ValueError(f"tool_result content holds a {b.get('type')!r} block; only text is supported")
        parts.append(b["text"])
    return "".join(parts)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # checked below: unknown fields are refused by name

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # None: the server's default
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1 << 20)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-output beta's place for `output_config.format`
    context_management: ContextManagement | None = None  # applied in `context_editing`

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in _BOOKKEEPING or (name in _REFUSED and value in (None, [], {})):
                continue
            raise ValueError(f"`{name}` is not supported by this server")
        return self

    def _chat_messages(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for m in self.messages:
            blocks = m.blocks()
            if m.role == "system":
                # A system message amid the conversation (Claude Code sends them) is kept in place;
                # a template that takes one system message only refuses it with a 400 naming `messages`.
                # One without text (an effort change only) adds nothing to the prompt.
                if text := "".join(b["text"] for b in blocks):
                    out.append({"role": "system", "content": text})
                continue
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            if m.role == "assistant":
                calls = [{"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}
                         for b in blocks if b["type"] == "tool_use"]
                out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
                continue
            for b in blocks:
                if b["type"] == "tool_result":
                    result = _result_text(b.get("content"))
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": f"Error: {result}" if b.get("is_error") else result})
            if any(b["type"] == "image" for b in blocks):  # the parts in order, images as data URLs
                parts = [{"type": "text", "text": b["text"]} if b["type"] == "text" else
                         {"type": "image_url", "image_url": {
                             "url": f"data:{b['source']['media_type']};base64,{b['source']['data']}"}}
                         for b in blocks if b["type"] in ("text", "image")]
                out.append({"role": "user", "content": parts})
            elif text or not any(b["type"] == "tool_result" for b in blocks):
                out.append({"role": "user", "content": text})
        return out

    def to_chat(self) -> ChatCompletionRequest:
        user = (self.metadata or {}).get("user_id")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in self.tools or []]
        choice, parallel = None, True
        if self.tool_choice is not None:
            tc = self.tool_choice
            parallel = not tc.disable_parallel_tool_use
            if tc.type == "tool":
                if not tc.name:
                    raise ValueError("tool_choice of type 'tool' needs `name`")
                choice = {"type": "function", "function": {"name": tc.name}}
            else:
                choice = {"any": "required"}.get(tc.type, tc.type)
        kwargs, budget = None, None
        if self.thinking is not None:
            kwargs = {"enable_thinking": self.thinking.type != "disabled"}
            if self.thinking.budget_tokens is not None and self.thinking.type != "disabled":
                budget = self.thinking.budget_tokens  # the think block is closed at this many tokens
        configs = [self.output_config] + [m.output_config for m in self.messages]
        effort = next((c.effort for c in reversed(configs) if c is not None and c.effort is not None), None)
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        last = self.messages[-1]
        continues = last.role == "assistant" and not any(b["type"] == "tool_use" for b in last.blocks())
        return ChatCompletionRequest(
            model=self.model, messages=self._chat_messages(), max_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences,
            stream=self.stream, user=user if isinstance(user, str) else None,
            continue_final_message=continues, add_generation_prompt=not continues,
            tools=tools or None, tool_choice=choice, parallel_tool_calls=parallel, chat_template_kwargs=kwargs,
            reasoning_effort={"max": "high"}.get(effort, effort), thinking_budget=budget,
            response_format=fmt.response_format() if fmt else None,
        )


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens`."""
    max_tokens: int = Field(default=1, ge=1)
