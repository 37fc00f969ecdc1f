"""Ollama's request bodies (`/api/chat`, `/api/generate`, `/api/embed`, `/api/show`) and
their translation into the OpenAI chat request the server serves: `options` onto sampling
fields (runtime options named as ignored, unimplemented sampling options refused), `format`
onto a response format, `think` onto reasoning effort, images into content parts, and
`keep_alive` durations."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from macinfer.server.protocol import ChatCompletionRequest

# Ollama option -> our request field
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# Options about the runtime, not the output: accepted and named as ignored.
_RUNTIME = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "low_vram", "use_mmap", "use_mlock",
            "numa", "vocab_only", "num_keep"}


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    format: Literal["json"] | dict[str, Any] | Literal[""] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: StrictInt | StrictFloat | StrictStr | None = None
    think: bool | Literal["low", "medium", "high"] | None = None


class ChatRequest(_Base):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Base):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    suffix: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: StrictInt | StrictFloat | StrictStr | None = None
    dimensions: int | None = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool = False


def _with_images(images: Any, text: str, where: str) -> list[dict[str, Any]]:
    """Ollama's base64 images (before the text, as Ollama renders them) as OpenAI's parts."""
    if not isinstance(images, list) or not all(isinstance(b, str) for b in images):
        raise ValueError(f"{where}: a list of base64 strings")
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": b if b.startswith("data:")
                                                                        else f"data:image/*;base64,{b}"}}
                                   for b in images]
    return parts + ([{"type": "text", "text": text}] if text else [])


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: tool calls with ids and JSON arguments, tool results
    answering the calls in order."""
    out, pending = [], []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}].role: {role!r} is not system, user, assistant or tool")
        msg: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content: must be a string")
        if m.get("images"):
            msg["content"] = _with_images(m["images"], msg["content"], f"messages[{i}].images")
        if role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise ValueError(f"messages[{i}].tool_calls: must be a list of {{\"function\": {{...}}}} objects")
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name", ""), str) \
                        or not isinstance(fn.get("arguments", {}), (dict, str)):
                    raise ValueError(f"{where}: must be {{\"function\": {{\"name\": string, \"arguments\": object}}}}")
                call_id = f"call_{i}_{j}"
                args = fn.get("arguments", {})
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": fn.get("name", ""), "arguments": args if isinstance(args, str) else json.dumps(args)}})
                pending.append(call_id)
            msg["tool_calls"] = calls
        if role == "tool":
            msg["tool_call_id"] = pending.pop(0) if pending else f"call_{i}"
        out.append(msg)
    return out


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


_FOREVER = 1e9  # seconds (31 years): longer keep-alives mean "never unload", as a negative one does


def keep_alive_seconds(value: float | str) -> float:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "-1");
    negative (or longer than `_FOREVER`) means forever; NaN and infinities are refused."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive: {value!r} is not a duration (e.g. 300, \"5m\", \"1h\", -1)")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text.lstrip("+-"))
            if not parts or "".join(n + u for n, u in parts) != text.lstrip("+-"):
                raise ValueError(f"keep_alive: {value!r} is not a duration (e.g. 300, \"5m\", \"1h\", -1)") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds):
        raise ValueError(f"keep_alive: {value!r} is not a finite duration (use -1 to keep the model loaded)")
    return -1.0 if seconds > _FOREVER else seconds


def to_chat(req: ChatRequest | GenerateRequest, single: bool = True) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request this Ollama request asks for, and the fields named as ignored."""
    ignored: list[str] = []
    fields: dict[str, Any] = {"model": req.model, "stream": req.stream}
    for key, value in (req.options or {}).items():
        if key in _OPTIONS:
            fields[_OPTIONS[key]] = value
        elif key in _RUNTIME:
            ignored.append(f"options.{key}")
        else:
            raise ValueError(f"options.{key} is not supported by this server")
    limit = fields.get("max_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise ValueError(f"options.num_predict: must be an integer (-1: until done), got {limit!r}")
    if limit is not None and limit < 0:  # Ollama's -1: until done
        del fields["max_tokens"]
    if req.keep_alive is not None:
        keep_alive_seconds(req.keep_alive)  # a malformed one is a 400 either way
        if single:
            ignored.append("keep_alive")
    if req.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": req.format}}
    if req.think is False:
        fields["reasoning_effort"] = "none"
    elif isinstance(req.think, str):
        fields["reasoning_effort"] = req.think
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise ValueError("messages: at least one message is needed")
        fields["messages"] = _messages(req.messages)
        if req.tools:
            fields["tools"] = req.tools
    else:
        for name in ("suffix", "template", "context"):
            if getattr(req, name):
                raise ValueError(f"{name} is not supported by this server")
        if req.raw:
            raise ValueError("raw is not supported by this server; send the prompt through the chat template")
        prompt: Any = _with_images(req.images, req.prompt, "images") if req.images else req.prompt
        fields["messages"] = ([{"role": "system", "content": req.system}] if req.system else []) + \
            [{"role": "user", "content": prompt}]
    return ChatCompletionRequest.model_validate(fields), ignored
