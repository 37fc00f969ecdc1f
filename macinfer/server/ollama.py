"""Ollama's API (`/api/*`), for the apps that speak it first (Open WebUI, Continue, Raycast
and Obsidian plugins, the `ollama` Python and JS clients).

`/api/chat` and `/api/generate` are translated into the OpenAI chat request the rest of the
server serves (template, sampling, grammars, tools, engine), as the Anthropic API is, and
their output is written back as Ollama's NDJSON stream or single object. `options` map onto
our sampling fields; options that change nothing here (`num_ctx`, `num_thread`, `num_gpu`,
...) are named in `x-macinfer-ignored`, and so is `keep_alive` when one model is served (it
is always loaded); with several, `keep_alive` sets how long the model stays loaded idle;
sampling options we do not implement (mirostat, tfs_z, typical_p, ...) are a 400 naming
them. Errors are Ollama's `{"error": message}`.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.background import BackgroundTask

from macinfer.server import chat_output
from macinfer.server.protocol import ChatCompletionRequest
from macinfer.server.routing import Routing
from macinfer.text import json_limits

# Ollama option -> our request field
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# Options about the runtime, not the output: accepted and named as ignored.
_RUNTIME = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "low_vram", "use_mmap", "use_mlock",
            "numa", "vocab_only", "num_keep"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": message}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


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


def _calls(proc) -> list[dict[str, Any]]:
    out = []
    for c in proc.calls:
        try:
            args = json_limits.loads(c.arguments or "{}")
        except ValueError:
            args = {}
        out.append({"function": {"name": c.name, "arguments": args}})
    return out


def _done(model_name: str, out, turn, started: float, load: int = 0) -> dict[str, Any]:
    total = int((time.perf_counter() - started) * 1e9)
    return {"model": model_name, "created_at": now(), "done": True,
            "done_reason": "length" if out.finish_reason == "length" else "stop",
            "total_duration": total, "load_duration": load, "prompt_eval_count": len(turn.ids),
            "prompt_eval_duration": 0, "eval_count": len(out.token_ids), "eval_duration": total}


def answer(kind: str, model_name: str, out, turn, started: float, load: int = 0) -> dict[str, Any]:
    """The whole answer (`stream: false`); `load`: nanoseconds spent loading the model."""
    msg, proc = chat_output.message(turn.plan, out.text, turn.prompt_tail)
    body = _done(model_name, out, turn, started, load)
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("reasoning_content"):
            message["thinking"] = msg["reasoning_content"]
        if proc.calls:
            message["tool_calls"] = _calls(proc)
        body["message"] = message
    else:
        body["response"] = msg.get("content") or ""
        if msg.get("reasoning_content"):
            body["thinking"] = msg["reasoning_content"]
    return body


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


async def stream(kind: str, model_name: str, turn, gen, started: float, load: int = 0) -> AsyncIterator[str]:
    """NDJSON: a line per piece of the answer, tool calls whole once generated, then the
    final line with `done: true` and the counts; `{"error": ...}` if generation fails."""
    proc = chat_output.ChatOutput(turn.plan, turn.prompt_tail)
    try:
        async for out, parts in chat_output.parts_stream(proc, gen):
            if parts is None:
                from macinfer.server.serving import _generation_error

                yield _line({"error": _generation_error(out).message})
                return
            text, thinking = parts.get("content") or "", parts.get("reasoning_content") or ""
            if text or thinking:
                piece: dict[str, Any] = {"model": model_name, "created_at": now(), "done": False}
                if kind == "chat":
                    piece["message"] = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}
                else:
                    piece["response"] = text
                    if thinking:
                        piece["thinking"] = thinking
                yield _line(piece)
            if out.finished:
                if kind == "chat" and proc.calls:
                    yield _line({"model": model_name, "created_at": now(), "done": False,
                                 "message": {"role": "assistant", "content": "", "tool_calls": _calls(proc)}})
                final = _done(model_name, out, turn, started, load)
                if kind == "chat":
                    final["message"] = {"role": "assistant", "content": ""}
                else:
                    final["response"] = ""
                yield _line(final)
    finally:
        gen.close()


def model_details(engine) -> dict[str, Any]:
    cfg = engine.loaded.config
    quant = cfg.get("quantization") or {}
    source = engine.loaded.source
    return {"format": "gguf" if str(source).endswith(".gguf") else "safetensors",
            "family": cfg.get("model_type", ""), "families": [cfg.get("model_type", "")],
            "parameter_size": _params(engine), "quantization_level": f"Q{quant['bits']}" if quant.get("bits") else "F32",
            "parent_model": ""}


def _params(engine) -> str:
    from mlx.utils import tree_flatten

    n = sum(v.size for _, v in tree_flatten(engine.model.parameters()))
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _to_chat_error(e: Exception):
    from pydantic import ValidationError

    from macinfer.server.protocol import describe_validation_error
    from macinfer.server.serving import APIError

    msg, _ = describe_validation_error(e.errors()) if isinstance(e, ValidationError) else (str(e), None)
    return APIError(400, msg)


def add_routes(app: Any, routing: Routing) -> None:
    """The routes, over the same models: a `name:tag` model name resolves to a served model
    by its name or alias (with one model, any name reaches it, as the other APIs take any)."""
    from macinfer import __version__
    from macinfer.server.embeddings import embed
    from macinfer.server.serving import APIError

    pool, chat_translated, add_header = routing.pool, routing.chat_translated, routing.add_header

    def entry(e, served) -> dict[str, Any]:
        name = e.name if ":" in e.name else f"{e.name}:latest"
        size = e.known_bytes or e.source.disk_bytes
        return {"name": name, "model": name, "modified_at": now(), "size": size, "digest": "",
                "details": model_details(served.engine) if served is not None else
                {"format": "gguf" if e.source.path.endswith(".gguf") else "safetensors", "family": "",
                 "families": [], "parameter_size": "", "quantization_level": "", "parent_model": ""}}

    @app.get("/api/version")
    async def ollama_version():
        return {"version": __version__}

    @app.get("/api/tags")
    async def ollama_tags():
        return {"models": [entry(e, e.served) for e in pool.entries.values()]}

    @app.get("/api/ps")
    async def ollama_ps():
        out = []
        for e in pool.entries.values():
            if e.served is None and not e.unloading:  # (one being unloaded holds memory still)
                continue
            ttl = 0 if e.unloading else e.keep_alive if e.keep_alive is not None else pool.idle_ttl
            never = pool.single or e.source.pinned or ttl is None or ttl < 0
            expires = "2318-01-01T00:00:00Z" if never else time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + max(ttl - (time.monotonic() - e.last_used), 0)))
            size = e.served.nbytes if e.served is not None else e.known_bytes
            out.append({**entry(e, e.served), "size_vram": size, "expires_at": expires})
        return {"models": out}

    @app.post("/api/show")
    async def ollama_show(req: ShowRequest):
        e = pool.resolve(req.model or req.name, strict=True)
        async with pool.use(e.name) as m:
            engine = m.engine
            caps = ["completion"] + (["tools"] if m.serving._renders_tools() else []) + \
                (["embedding"] if engine.loaded.pooling is not None else []) + \
                (["vision"] if engine.vision is not None else [])
            return {"modelfile": "", "parameters": "", "template": engine.tokenizer.chat_template or "",
                    "details": model_details(engine), "capabilities": caps,
                    "model_info": {"general.architecture": engine.loaded.config.get("model_type", ""),
                                   "general.context_length": engine.max_model_len}, "modified_at": now()}

    def seconds(value) -> float:
        try:
            return keep_alive_seconds(value)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def keep(req, e) -> None:
        """Ollama's keep_alive: how long the model stays loaded once idle (negative: forever)."""
        if req.keep_alive is not None and not pool.single:
            e.keep_alive = seconds(req.keep_alive)

    async def _generate(kind: str, req, request: Request):
        started = time.perf_counter()
        try:
            chat, ignored = to_chat(req, pool.single)
        except (ValueError, ValidationError) as e:
            raise _to_chat_error(e) from None
        if ignored:
            add_header(request, "x-macinfer-ignored", ",".join(ignored))
        e = pool.resolve(req.model)
        loaded_before = e.served is not None
        async with pool.use(req.model) as m:
            keep(req, e)
            load = 0 if loaded_before else int((time.perf_counter() - started) * 1e9)
            turn, gen, final = await chat_translated(m, chat, request)
            if final is None:
                return StreamingResponse(stream(kind, m.name, turn, gen, started, load),
                                         media_type="application/x-ndjson", background=BackgroundTask(gen.close))
            return answer(kind, m.name, final, turn, started, load)

    @app.post("/api/chat")
    async def ollama_chat(req: ChatRequest, request: Request):
        if not req.messages:  # Ollama's "load the model" request (or, with keep_alive 0, unload it)
            return await _load_only(req, "message")
        return await _generate("chat", req, request)

    @app.post("/api/generate")
    async def ollama_generate(req: GenerateRequest, request: Request):
        if not req.prompt:
            return await _load_only(req, "response")
        return await _generate("generate", req, request)

    async def _load_only(req, field: str) -> dict[str, Any]:
        e = pool.resolve(req.model)
        if req.keep_alive is not None and seconds(req.keep_alive) == 0 and not pool.single:
            pool.unload_when_idle(e)
            return {"model": e.name, "created_at": now(), field: "" if field == "response" else
                    {"role": "assistant", "content": ""}, "done": True, "done_reason": "unload"}
        async with pool.use(req.model) as m:
            keep(req, e)
            return {"model": m.name, "created_at": now(), field: "" if field == "response" else
                    {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"}

    @app.post("/api/embed")
    async def ollama_embed(req: EmbedRequest, request: Request):
        if req.dimensions is not None or req.options:
            raise APIError(400, "dimensions and options are not supported by /api/embed here")
        started = time.perf_counter()
        async with pool.use(req.model) as m:
            keep(req, pool.resolve(req.model))
            vectors, n = await embed(m, [req.input] if isinstance(req.input, str) else list(req.input), request)
            return {"model": m.name, "embeddings": [v.astype(float).tolist() for v in vectors],
                    "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
                    "prompt_eval_count": n}
