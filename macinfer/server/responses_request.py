"""The Responses API request (`POST /v1/responses`) and its translation into the OpenAI chat
request the server serves: `input` items (text, messages, function calls and their
outputs), `instructions`, function tools (namespaced ones flattened), `tool_choice` and
`text.format`; stored responses refused with the field's name, and provider-run tools
(web search, files...) left out and named."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from macinfer.server.protocol import ChatCompletionRequest

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
