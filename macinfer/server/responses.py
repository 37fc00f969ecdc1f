"""OpenAI Responses API (`POST /v1/responses`), stateless.

`input` (text, or message, function_call and function_call_output items),
`instructions`, function `tools`, `tool_choice` and `text.format` are turned into
the chat request the rest of the server serves; the chat output is written back
as reasoning, message and function_call items, or their streaming events. Stored
responses (`previous_response_id`, `store: true`) and built-in tools (web search,
files...) are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from macinfer.server import chat_output
from macinfer.server.heartbeat import BEAT, with_heartbeat
from macinfer.server.protocol import ChatCompletionRequest
from macinfer.server.routing import Routing

log = logging.getLogger("macinfer.server")

_NOOP = {"previous_response_id": (None,), "store": (None, False),
         "truncation": (None, "disabled"), "metadata": None, "background": (None, False),
         "service_tier": None, "safety_identifier": None, "prompt_cache_key": None, "client_metadata": None}
# `include` values served: reasoning items carry their text as `encrypted_content` (this server
# keeps no state and encrypts nothing; Codex sends the item back, and it is dropped on input as
# chat templates drop earlier reasoning).
_INCLUDE = ("reasoning.encrypted_content",)
# Tools the provider runs itself: this server cannot, so they are left out of what the model
# sees and named in an `x-macinfer-dropped-tools` header and the log, never passed off as run.
NAMESPACE_SEP = "__"  # a namespace's function as the model sees it: "<namespace>__<name>"
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                "image_generation", "local_shell", "mcp")


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # as `reasoning_effort`
    summary: Literal["auto", "concise", "detailed"] | None = None  # the reasoning text is returned whole


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # checked below: unknown fields are refused by name

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None: the server's default
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    user: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            allowed = _NOOP.get(name, ())
            if name in _NOOP and (allowed is None or value in allowed):
                continue
            raise ValueError(f"`{name}` is not supported by this server")
        for value in self.include or []:
            if value not in _INCLUDE:
                raise ValueError(f"include: {value!r} is not supported (only {', '.join(_INCLUDE)})")
        return self

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "function_call":
                name = item.get("name")
                if isinstance(item.get("namespace"), str) and isinstance(name, str):
                    name = f"{item['namespace']}{NAMESPACE_SEP}{name}"  # as the model saw it
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": name, "arguments": item.get("arguments", "{}")}}
                if not (isinstance(call["id"], str) and isinstance(item.get("name"), str)
                        and isinstance(call["function"]["arguments"], str)):
                    raise ValueError(f"input[{i}]: a function_call item needs `call_id`, `name` and text `arguments`")
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                continue
            if kind == "function_call_output":
                if isinstance(item.get("call_id"), str):
                    message = {"role": "tool", "tool_call_id": item["call_id"]}
                elif isinstance(item.get("name"), str) and "call_id" not in item:
                    # An output the client adds without a call (Codex: `agent` namespace's goal_objective):
                    # a tool message named as namespace tools are flattened.
                    ns = item.get("namespace")
                    message = {"role": "tool", "name": f"{ns}__{item['name']}" if isinstance(ns, str) else item["name"]}
                else:
                    raise ValueError(f"input[{i}]: a function_call_output item needs a string `call_id` (or a `name`)")
                output = item.get("output")
                if isinstance(output, list):  # content parts: text only
                    if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                               and isinstance(p.get("text"), str) for p in output):
                        raise ValueError(f"input[{i}].output: only text parts are supported "
                                         "(this model has no image or file input)")
                    output = "".join(p["text"] for p in output)
                if not isinstance(output, str):
                    raise ValueError(f"input[{i}]: a function_call_output item needs a text `output`")
                out.append({**message, "content": output})
                continue
            if kind == "reasoning":  # earlier reasoning is not fed back, as chat templates drop it
                continue
            if kind != "message":
                raise ValueError(f"input[{i}]: {kind!r} items are not supported "
                                 "(message, function_call, function_call_output, reasoning)")
            role, content = item.get("role"), item.get("content")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"input[{i}]: unknown role {role!r}")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict):
                        raise ValueError(f"input[{i}].content[{j}]: a content part is an object with a `type`")
                    if part.get("type") == "input_image" and role == "user":
                        url = part.get("image_url")
                        if not isinstance(url, str) or part.get("file_id") is not None:
                            raise ValueError(f"input[{i}].content[{j}]: an input_image part needs an `image_url` "
                                             "(a data URL; file ids are not supported)")
                        detail = part.get("detail")
                        parts.append({"type": "image_url", "image_url": {"url": url, **(
                            {"detail": detail} if detail is not None else {})}})
                        continue
                    if part.get("type") not in ("input_text", "output_text", "text"):
                        raise ValueError(f"input[{i}].content[{j}]: {part.get('type')!r} parts are not supported "
                                         "(text, and input_image in user messages)")
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"input[{i}].content[{j}]: a text part needs `text`")
                    parts.append({"type": "text", "text": part["text"]})
                images = any(p["type"] == "image_url" for p in parts)
                content = parts if images else "".join(p["text"] for p in parts)
            if not isinstance(content, (str, list)):
                raise ValueError(f"input[{i}]: content must be text or content parts")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        return out

    def namespaces(self) -> dict[str, tuple[str, str]]:
        """Flattened name -> (namespace, name) of each function in a `namespace` tool group
        (Codex groups MCP tools so). The model sees flat functions; calls go back split, as
        Codex routes them by both fields."""
        out = {}
        for t in self.tools or []:
            if t.get("type") == "namespace" and isinstance(t.get("name"), str):
                for child in t.get("tools") or []:
                    if isinstance(child, dict) and isinstance(child.get("name"), str):
                        out[f"{t['name']}{NAMESPACE_SEP}{child['name']}"] = (t["name"], child["name"])
        return out

    def _tools(self) -> list[dict[str, Any]] | None:
        tools = []
        flat = []
        for i, t in enumerate(self.tools or []):
            if t.get("type") == "namespace":
                children = t.get("tools")
                if not isinstance(t.get("name"), str) or not isinstance(children, list):
                    raise ValueError(f"tools[{i}]: a namespace tool needs a `name` and a list of `tools`")
                flat += [{**c, "name": f"{t['name']}{NAMESPACE_SEP}{c.get('name')}"} if isinstance(c, dict) else c
                         for c in children]
            else:
                flat.append(t)
        for i, t in enumerate(flat):
            if not isinstance(t, dict):
                raise ValueError(f"tools[{i}] must be an object")
            if t.get("type") in HOSTED_TOOLS:
                continue
            if t.get("type") != "function":
                raise ValueError(f"tools[{i}]: {t.get('type')!r} tools are not supported (only function tools)")
            if not isinstance(t.get("name"), str) or not isinstance(t.get("parameters", {}), (dict, type(None))):
                raise ValueError(f"tools[{i}]: a function tool needs a `name` and a `parameters` object")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
        return tools or None

    def _response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise ValueError("text.format must be an object with a `type` (text, json_object or json_schema)")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise ValueError("text.format: a json_schema format needs a `schema` object")
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                           "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
        raise ValueError(f"text.format type {fmt.get('type')!r} is not supported")

    def hosted_tools(self) -> list[str]:
        """The hosted tools asked for (dropped: see HOSTED_TOOLS)."""
        return [t["type"] for t in self.tools or [] if t.get("type") in HOSTED_TOOLS]

    def to_chat(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError("tool_choice: only {'type': 'function', 'name': ...} objects are supported")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return ChatCompletionRequest(model=self.model, messages=self.messages(), max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                                     user=self.user, tools=self._tools(), tool_choice=choice,
                                     parallel_tool_calls=self.parallel_tool_calls,
                                     response_format=self._response_format(),
                                     reasoning_effort=self.reasoning.effort if self.reasoning else None)


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
                from macinfer.server.serving import _generation_error

                err = _generation_error(out)
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
