"""Anthropic Messages API (`POST /v1/messages`): conversations with tool use and
thinking, streaming events in Anthropic's order, stop sequences, usage,
Anthropic-style errors.

A request is translated into the OpenAI chat request the rest of the server
serves (same template, sampling, constrained decoding, engine): `tool_use` and
`tool_result` blocks become assistant tool calls and tool messages, `tool_choice`
any/tool become "required"/a named function, `thinking` becomes the template's
`enable_thinking`. The chat output (reasoning, text, tool calls) is written back
as thinking, text and tool_use blocks, or as their streaming events. The request side is
`anthropic_requests`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from macinfer.server import chat_output, context_editing
from macinfer.server.anthropic_requests import CountTokensRequest, MessagesRequest
from macinfer.server.heartbeat import BEAT, with_heartbeat
from macinfer.server.routing import Routing
from macinfer.text import json_limits

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error"}
def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def stop_reason(out, calls: bool) -> tuple[str, str | None]:
    if out.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _tool_use(call) -> dict[str, Any]:
    try:
        args = json_limits.loads(call.arguments or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name, "input": args}


def thinking_omitted(req: MessagesRequest) -> bool:
    return req.thinking is not None and req.thinking.display == "omitted"


def message(req: MessagesRequest, model_name: str, out, turn, applied: list[dict] | None = None) -> dict[str, Any]:
    msg, proc = chat_output.message(turn.plan, out.text, turn.prompt_tail)
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        shown = "" if thinking_omitted(req) else msg["reasoning_content"]
        content.append({"type": "thinking", "thinking": shown, "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [_tool_use(c) for c in proc.calls]
    if not content:
        content.append({"type": "text", "text": ""})
    reason, seq = stop_reason(out, bool(proc.calls))
    answer = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model_name,
              "content": content, "stop_reason": reason, "stop_sequence": seq,
              "usage": {"input_tokens": len(turn.ids), "output_tokens": len(out.token_ids)}}
    if applied is not None:
        answer["context_management"] = {"applied_edits": applied}
    return answer


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class _Blocks:
    """Open/close content blocks as the chat output's parts arrive, in order."""

    def __init__(self, omit_thinking: bool = False):
        self.omit_thinking = omit_thinking
        self.index = -1
        self.kind: str | None = None
        self.tool_ids: dict[int, int] = {}  # OpenAI tool-call index -> block index

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def parts(self, parts: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if parts.get("reasoning_content"):
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                    out.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "thinking_delta", "thinking": parts["reasoning_content"]}}))
        if parts.get("content"):
            if self.kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": parts["content"]}}))
        for d in parts.get("tool_calls", []):
            fn = d.get("function", {})
            if "id" in d:  # a new call
                out += self._open("tool_use", {**_tool_use(_Call(d["id"], fn["name"], "")), "input": {}})
                self.tool_ids[d["index"]] = self.index
            if fn.get("arguments"):
                out.append(_event("content_block_delta", {"index": self.tool_ids[d["index"]], "delta": {
                    "type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return out


class _Call:
    def __init__(self, id: str, name: str, arguments: str):
        self.id, self.name, self.arguments = id, name, arguments


async def events(model_name: str, turn, gen, applied: list[dict] | None = None,
                 omit_thinking: bool = False) -> AsyncIterator[str]:
    """message_start, ping, then per block content_block_start, deltas, content_block_stop;
    message_delta, message_stop; an `error` event if generation fails."""
    yield _event("message_start", {"message": {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(turn.ids), "output_tokens": 0}}})
    yield _event("ping", {})
    proc = chat_output.ChatOutput(turn.plan, turn.prompt_tail)
    blocks = _Blocks(omit_thinking)
    try:
        async for item in with_heartbeat(chat_output.parts_stream(proc, gen)):
            if item is BEAT:  # Anthropic's own keep-alive
                yield _event("ping", {})
                continue
            out, parts = item
            if parts is None:
                from macinfer.server.errors import generation_error

                err = generation_error(out)
                yield _event("error", {"error": error_body(err.status, err.message)["error"]})
                return
            for e in blocks.parts(parts):
                yield e
            if out.finished:
                if blocks.index < 0:  # an empty answer is still one (empty) text block
                    for e in blocks._open("text", {"type": "text", "text": ""}):
                        yield e
                for e in blocks.close():
                    yield e
                reason, seq = stop_reason(out, bool(proc.calls))
                delta = {"delta": {"stop_reason": reason, "stop_sequence": seq},
                         "usage": {"output_tokens": len(out.token_ids)}}
                if applied is not None:
                    delta["context_management"] = {"applied_edits": applied}
                yield _event("message_delta", delta)
                yield _event("message_stop", {})
    finally:
        gen.close()


def add_routes(app: FastAPI, routing: Routing) -> None:
    """/v1/messages (with context editing) and /v1/messages/count_tokens, over the chat path."""
    pool = routing.pool

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        async with pool.use(req.model) as m:
            applied = None
            if req.context_management is not None:  # Anthropic's context editing, before the prompt is built
                req, applied = await asyncio.to_thread(
                    context_editing.apply, req,
                    lambda r: len(m.serving.chat_prompt(routing.to_chat(r, "messages")).ids),
                    lambda text: len(m.engine.tokenizer.encode(text, add_special_tokens=False)))
            omit = thinking_omitted(req)
            return await routing.translated(m, req, "messages", request,
                                            lambda t, s: events(m.name, t, s, applied, omit),
                                            lambda f, t: message(req, m.name, f, t, applied))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        """Anthropic's token count: the prompt the same request to /v1/messages would run."""
        async with pool.use(req.model) as m:
            turn = await asyncio.to_thread(m.serving.chat_prompt, routing.to_chat(req, "messages"))
        return {"input_tokens": len(turn.ids)}
