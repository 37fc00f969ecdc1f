"""OpenAI Responses API (`POST /v1/responses`), the stateless text subset.

`input` as text or message items and `instructions` are turned into the chat
request the rest of the server serves; the outputs are written back as a
Response object or its streaming events. Stored responses
(`previous_response_id`, `store: true`), tools and `text.format` schemas are
refused with a 400 naming the field until they are implemented.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from macinfer.server.protocol import ChatCompletionRequest

_NOOP = {"tools": (None, []), "tool_choice": (None, "auto", "none"), "previous_response_id": (None,),
         "store": (None, False), "text": (None, {"format": {"type": "text"}}), "reasoning": (None,),
         "parallel_tool_calls": (None, True, False), "truncation": (None, "disabled"), "include": (None, []),
         "metadata": None, "background": (None, False), "service_tier": None, "safety_identifier": None,
         "prompt_cache_key": None}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked below: unknown fields are refused by name

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    user: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            allowed = _NOOP.get(name, ())
            if name in _NOOP and (allowed is None or value in allowed):
                continue
            raise ValueError(f"`{name}` is not supported by this server")
        return self

    def messages(self) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind != "message":
                raise ValueError(f"input[{i}]: {kind!r} items are not supported (only messages)")
            role, content = item.get("role"), item.get("content")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"input[{i}]: unknown role {role!r}")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.get("type") not in ("input_text", "output_text", "text"):
                        raise ValueError(f"input[{i}].content[{j}]: {part.get('type')!r} parts are not supported "
                                         "(only text; this model has no vision or audio input)")
                    parts.append(part.get("text", ""))
                content = "".join(parts)
            if not isinstance(content, str):
                raise ValueError(f"input[{i}]: content must be text")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        return out

    def to_chat(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(model=self.model, messages=self.messages(), max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                                     user=self.user)


def _response(req: ResponsesRequest, model_name: str, rid: str, status: str, text: str | None,
              usage: dict[str, Any] | None, incomplete: str | None = None) -> dict[str, Any]:
    output = []
    if text is not None:
        output.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
    return {"id": f"resp_{rid}", "object": "response", "created_at": int(time.time()), "status": status,
            "model": model_name, "output": output, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
            "incomplete_details": {"reason": incomplete} if incomplete else None, "error": None, "usage": usage}


def _usage(prompt_tokens: int, out) -> dict[str, Any]:
    n = len(out.token_ids)
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_tokens + n}


def response(req: ResponsesRequest, model_name: str, out, prompt_tokens: int) -> dict[str, Any]:
    length = out.finish_reason == "length"
    return _response(req, model_name, uuid.uuid4().hex, "incomplete" if length else "completed", out.text,
                     _usage(prompt_tokens, out), "max_output_tokens" if length else None)


async def events(req: ResponsesRequest, model_name: str, prompt_tokens: int, gen) -> AsyncIterator[str]:
    rid = uuid.uuid4().hex
    seq = 0

    def event(kind: str, payload: dict[str, Any]) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **payload}, ensure_ascii=False)}\n\n"

    item = {"type": "message", "id": f"msg_{rid}", "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": f"msg_{rid}", "output_index": 0, "content_index": 0}
    yield event("response.created", {"response": _response(req, model_name, rid, "in_progress", None, None)})
    yield event("response.in_progress", {"response": _response(req, model_name, rid, "in_progress", None, None)})
    yield event("response.output_item.added", {"output_index": 0, "item": item})
    yield event("response.content_part.added", {**where, "part": part})
    text = ""
    try:
        async for _, out in gen:
            if out.finish_reason == "error":
                from macinfer.server.serving import _generation_error

                err = _generation_error(out)
                yield event("error", {"code": err.code or err.type, "message": err.message, "param": None})
                return
            if out.delta_text:
                text += out.delta_text
                yield event("response.output_text.delta", {**where, "delta": out.delta_text})
            if out.finished:
                yield event("response.output_text.done", {**where, "text": text})
                yield event("response.content_part.done", {**where, "part": {**part, "text": text}})
                done_item = {**item, "status": "completed", "content": [{**part, "text": text}]}
                yield event("response.output_item.done", {"output_index": 0, "item": done_item})
                final = response(req, model_name, out, prompt_tokens)
                final["id"], final["output"][0]["id"] = f"resp_{rid}", f"msg_{rid}"
                kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                yield event(kind, {"response": final})
    finally:
        gen.close()
