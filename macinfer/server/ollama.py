"""Ollama's API (`/api/*`), for the apps that speak it first (Open WebUI, Continue, Raycast
and Obsidian plugins, the `ollama` Python and JS clients).

`/api/chat` and `/api/generate` are translated into the OpenAI chat request the rest of the
server serves (template, sampling, grammars, tools, engine), as the Anthropic API is, and
their output is written back as Ollama's NDJSON stream or single object. `options` map onto
our sampling fields; options that change nothing here (`num_ctx`, `num_thread`, `num_gpu`,
...) are named in `x-macinfer-ignored`, and so is `keep_alive` when one model is served (it
is always loaded); with several, `keep_alive` sets how long the model stays loaded idle;
sampling options we do not implement (mirostat, tfs_z, typical_p, ...) are a 400 naming
them (`ollama_requests`). Errors are Ollama's `{"error": message}`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from macinfer.server import chat_output
from macinfer.server.ollama_requests import (ChatRequest, EmbedRequest, GenerateRequest, ShowRequest,
                                             keep_alive_seconds, to_chat)
from macinfer.server.routing import Routing
from macinfer.text import json_limits

def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": message}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


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
                from macinfer.server.errors import generation_error

                yield _line({"error": generation_error(out).message})
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
    from macinfer.server.errors import APIError

    msg, _ = describe_validation_error(e.errors()) if isinstance(e, ValidationError) else (str(e), None)
    return APIError(400, msg)


def add_routes(app: Any, routing: Routing) -> None:
    """The routes, over the same models: a `name:tag` model name resolves to a served model
    by its name or alias (with one model, any name reaches it, as the other APIs take any)."""
    from macinfer import __version__
    from macinfer.server.embeddings import embed
    from macinfer.server.errors import APIError

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
