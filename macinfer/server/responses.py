"""OpenAI Responses API (`POST /v1/responses`), stateless.

`input` (text, or message, function_call and function_call_output items),
`instructions`, function `tools`, `tool_choice` and `text.format` are turned into
the chat request the rest of the server serves; the chat output is written back
as reasoning, message and function_call items, or their streaming events. Stored
responses (`previous_response_id`, `store: true`) and built-in tools (web search,
files...) are refused with a 400 naming the field. The request side is `responses_request`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from macinfer.server import chat_output
from macinfer.server.heartbeat import BEAT, with_heartbeat
from macinfer.server.responses_request import ResponsesRequest
from macinfer.server.routing import Routing

log = logging.getLogger("macinfer.server")

def _response(req: ResponsesRequest, model_name: str, rid: str, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, incomplete: str | None = None) -> dict[str, Any]:
    return {"id": f"resp_{rid}", "object": "response", "created_at": int(time.time()), "status": status,
            "model": model_name, "output": output, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}},
            "incomplete_details": {"reason": incomplete} if incomplete else None, "error": None, "usage": usage}


def _usage(prompt_tokens: int, out) -> dict[str, Any]:
    n = len(out.token_ids)
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_tokens + n}


def _encrypted(req: ResponsesRequest) -> bool:
    return "reasoning.encrypted_content" in (req.include or [])


def _reasoning_item(rid: str, text: str, encrypted: bool = False) -> dict[str, Any]:
    item = {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    return {**item, "encrypted_content": text} if encrypted else item


def _message_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed",
               namespaces: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    item = {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}
    if namespaces and name in namespaces:
        item["namespace"], item["name"] = namespaces[name]
    return item


def response(req: ResponsesRequest, model_name: str, out, turn) -> dict[str, Any]:
    rid = uuid.uuid4().hex
    msg, proc = chat_output.message(turn.plan, out.text, turn.prompt_tail)
    output = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(rid, msg["reasoning_content"], _encrypted(req)))
    if msg.get("content") or not proc.calls:
        output.append(_message_item(rid, msg.get("content") or ""))
    output += [_call_item(c.id, c.name, c.arguments, namespaces=req.namespaces()) for c in proc.calls]
    length = out.finish_reason == "length"
    return _response(req, model_name, rid, "incomplete" if length else "completed", output,
                     _usage(len(turn.ids), out), "max_output_tokens" if length else None)


class _Items:
    """Streaming events for output items, opened and closed as the parts arrive."""

    def __init__(self, rid: str, event, encrypted: bool = False, namespaces: dict | None = None):
        self.rid, self.event, self.encrypted, self.namespaces = rid, event, encrypted, namespaces
        self.items: list[dict[str, Any]] = []  # finished and open items, in output order
        self.open: str | None = None
        self.calls: dict[int, int] = {}  # OpenAI tool-call index -> output index

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        i, item = len(self.items) - 1, self.items[-1]
        out = []
        if self.open == "message":
            text = item["content"][0]["text"]
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out += [self.event("response.output_text.done", {**where, "text": text}),
                    self.event("response.content_part.done", {**where, "part": item["content"][0]})]
        elif self.open == "reasoning":
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out.append(self.event("response.reasoning_text.done", {**where, "text": item["content"][0]["text"]}))
        else:
            out.append(self.event("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": i, "arguments": item["arguments"]}))
        item["status"] = "completed"
        if self.open == "reasoning":
            item.pop("status")
            if self.encrypted:
                item["encrypted_content"] = item["content"][0]["text"]
        self.open = None
        return out + [self.event("response.output_item.done", {"output_index": i, "item": item})]

    def _add(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.items.append(item)
        self.open = kind
        shown = {**item, "content": []} if kind == "message" else item
        out.append(self.event("response.output_item.added", {"output_index": len(self.items) - 1, "item": shown}))
        if kind == "message":
            where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
            out.append(self.event("response.content_part.added", {**where, "part": {**item["content"][0], "text": ""}}))
        return out

    def parts(self, parts: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if parts.get("reasoning_content"):
            if self.open != "reasoning":
                out += self._add("reasoning", {**_reasoning_item(self.rid, ""), "status": "in_progress"})
            self.items[-1]["content"][0]["text"] += parts["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", {
                "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0,
                "delta": parts["reasoning_content"]}))
        if parts.get("content"):
            if self.open != "message":
                out += self._add("message", _message_item(self.rid, "", "in_progress"))
            self.items[-1]["content"][0]["text"] += parts["content"]
            out.append(self.event("response.output_text.delta", {
                "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0,
                "delta": parts["content"]}))
        for d in parts.get("tool_calls", []):
            fn = d.get("function", {})
            if "id" in d:
                out += self._add("function_call", _call_item(d["id"], fn["name"], "", "in_progress", self.namespaces))
                self.calls[d["index"]] = len(self.items) - 1
            if fn.get("arguments"):
                i = self.calls[d["index"]]
                self.items[i]["arguments"] += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", {
                    "item_id": self.items[i]["id"], "output_index": i, "delta": fn["arguments"]}))
        return out

    def finish(self) -> list[str]:
        return self._close()


async def events(req: ResponsesRequest, model_name: str, turn, gen) -> AsyncIterator[str]:
    rid = uuid.uuid4().hex
    seq = 0

    def event(kind: str, payload: dict[str, Any]) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **payload}, ensure_ascii=False)}\n\n"

    yield event("response.created", {"response": _response(req, model_name, rid, "in_progress", [], None)})
    yield event("response.in_progress", {"response": _response(req, model_name, rid, "in_progress", [], None)})
    proc = chat_output.ChatOutput(turn.plan, turn.prompt_tail)
    items = _Items(rid, event, _encrypted(req), req.namespaces())
    try:
        async for item in with_heartbeat(chat_output.parts_stream(proc, gen)):
            if item is BEAT:  # still working (the prompt, or an answer held back while it may be a call)
                yield event("response.in_progress", {"response": _response(req, model_name, rid, "in_progress", [], None)})
                continue
            out, parts = item
            if parts is None:
                from macinfer.server.errors import generation_error

                err = generation_error(out)
                yield event("error", {"code": err.code or err.type, "message": err.message, "param": None})
                return
            for e in items.parts(parts):
                yield e
            if out.finished:
                if not items.items:
                    for e in items._add("message", _message_item(rid, "", "in_progress")):
                        yield e
                for e in items.finish():
                    yield e
                length = out.finish_reason == "length"
                final = _response(req, model_name, rid, "incomplete" if length else "completed", items.items,
                                  _usage(len(turn.ids), out), "max_output_tokens" if length else None)
                yield event("response.completed" if not length else "response.incomplete", {"response": final})
    finally:
        gen.close()


def add_routes(app: FastAPI, routing: Routing) -> None:
    """/v1/responses, over the chat path."""
    @app.post("/v1/responses")
    async def responses_create(req: ResponsesRequest, request: Request):
        dropped = req.hosted_tools()
        if dropped:
            log.info("responses: hosted tools left out (this server cannot run them): %s", ", ".join(dropped))
            routing.add_header(request, "x-macinfer-dropped-tools", ",".join(dropped))
        async with routing.pool.use(req.model) as m:
            return await routing.translated(m, req, "input", request, lambda t, s: events(req, m.name, t, s),
                                            lambda f, t: response(req, m.name, f, t))
