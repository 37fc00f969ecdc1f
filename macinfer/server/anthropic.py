"""Anthropic Messages API (`POST /v1/messages`): text conversations, streaming
events in Anthropic's order, stop sequences, usage, Anthropic-style errors.

A request is translated into the OpenAI chat request the rest of the server
serves (same template, sampling, engine), and its outputs are written back
as Anthropic messages or events. Tool use and extended thinking are refused
with a 400 naming the field until they are implemented.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from macinfer.server.protocol import ChatCompletionRequest, check_text_parts

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error"}
_REFUSED = ("tools", "tool_choice", "thinking", "mcp_servers", "container")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return check_text_parts(data)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked below: unknown fields are refused by name

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1 << 20)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in _REFUSED and value in (None, [], {}):
                continue
            raise ValueError(f"`{name}` is not supported by this server")
        return self

    def to_chat(self) -> ChatCompletionRequest:
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": m.role, "content": m.text()} for m in self.messages]
        user = (self.metadata or {}).get("user_id")
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences, stream=self.stream,
            user=user if isinstance(user, str) else None,
            continue_final_message=self.messages[-1].role == "assistant",
            add_generation_prompt=self.messages[-1].role != "assistant",
        )


def stop_reason(out) -> tuple[str, str | None]:
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def message(req: MessagesRequest, model_name: str, out, prompt_tokens: int) -> dict[str, Any]:
    reason, seq = stop_reason(out)
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model_name,
            "content": [{"type": "text", "text": out.text}], "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(out.token_ids)}}


async def events(model_name: str, prompt_tokens: int, gen) -> AsyncIterator[str]:
    """message_start, content_block_start, ping, content_block_delta*, content_block_stop,
    message_delta, message_stop; an `error` event if generation fails."""
    def event(kind: str, payload: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"

    yield event("message_start", {"message": {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield event("ping", {})
    try:
        async for _, out in gen:
            if out.finish_reason == "error":
                from macinfer.server.serving import _generation_error

                err = _generation_error(out)
                yield event("error", {"error": error_body(err.status, err.message)["error"]})
                return
            if out.delta_text:
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": out.delta_text}})
            if out.finished:
                reason, seq = stop_reason(out)
                yield event("content_block_stop", {"index": 0})
                yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                              "usage": {"output_tokens": len(out.token_ids)}})
                yield event("message_stop", {})
    finally:
        gen.close()
