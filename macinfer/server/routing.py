"""What every API surface's routes share: the served models, the metrics, and the one way a
request is admitted, run, streamed, or translated into a chat (`Routing`). Each surface
(`openai`, `anthropic`, `responses`, `embeddings`, `ollama`, `status`) registers its routes
with `add_routes(app, routing)`; `app.create_app` only composes them."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from macinfer.server.async_engine import EngineDeadError, QueueFullError
from macinfer.server.model_pool import ModelPool, Served
from macinfer.server.protocol import ChatCompletionRequest, describe_validation_error
from macinfer.server.errors import APIError

log = logging.getLogger("macinfer.server")


class Routing:
    def __init__(self, pool: ModelPool, metrics: Any, key_ids: list[str]):
        self.pool, self.metrics = pool, metrics
        self.key_ids = key_ids  # per API key: the digest naming its share of the prefix cache

    @staticmethod
    def add_header(request: Request, name: str, value: str) -> None:
        """A header for this response's head (the Guard middleware adds them)."""
        extra = getattr(request.state, "response_headers", [])
        request.state.response_headers = [*extra, (name.encode(), value.encode())]

    def say_ignored(self, request: Request, turn) -> None:
        """Fields this model cannot act on (a reasoning effort for a template with no thinking
        control): named in `x-macinfer-ignored` and the log, not refused (every agent sends them)."""
        if turn.ignored:
            log.info("request fields this model cannot act on: %s", ", ".join(turn.ignored))
            self.add_header(request, "x-macinfer-ignored", ",".join(turn.ignored))

    async def start(self, m: Served, kind: str, req, prompt, max_tokens, logprobs, request: Request, plan=None,
                    images=None):
        """Validate, tokenize (never on the event loop: a large prompt takes seconds) and
        admit a request; returns (request id, prompt ids, output stream)."""
        ids, params, limit = await asyncio.to_thread(m.serving.prepare, req, prompt, max_tokens, logprobs, plan)
        if limit is not None:
            self.add_header(request, "x-macinfer-max-tokens", limit)
        try:
            index = getattr(request.state, "api_key_index", None)
            client = (None if index is None else self.key_ids[index], req.user)
            # a `model` naming one of this model's LoRA adapters runs under it
            model = getattr(req, "model", None)
            lora = model if model and model in m.engine.loras else None
            rid, stream = m.serving.submit(req, ids, params, kind, client, images, lora)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="server_busy",
                           headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error") from None
        return rid, ids, stream

    @staticmethod
    def sse(events, stream) -> StreamingResponse:
        # The background task runs even if the client left before the body started.
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(stream.close))

    async def run(self, m: Served, kind: str, req, prompt, max_tokens, logprobs, request: Request, turn=None):
        rid, ids, stream = await self.start(m, kind, req, prompt, max_tokens, logprobs, request, turn and turn.plan,
                                            turn and turn.images)
        if req.stream:
            return self.sse(m.serving.stream(kind, req, rid, ids, stream, turn), stream)
        return await m.serving.complete(kind, req, rid, ids, stream, request, turn)

    async def chat_translated(self, m: Served, chat: ChatCompletionRequest, request: Request):
        """Start a chat translated from another API; (chat turn, stream, final output or None)."""
        turn = await asyncio.to_thread(m.serving.chat_prompt, chat)
        self.say_ignored(request, turn)
        _, _, stream = await self.start(m, "chat", chat, turn.ids, chat.max_tokens, None, request, turn.plan,
                                        turn.images)
        if chat.stream:
            return turn, stream, None
        final = (await m.serving.wait_final(stream, request))[0]
        self.metrics.observe(final, m.name)
        return turn, stream, final

    @staticmethod
    def to_chat(req, param: str) -> ChatCompletionRequest:
        """A request of another API as a chat request, or a 400 in the client's terms."""
        try:
            return req.to_chat()
        except ValidationError as e:  # the translated request breaks a chat rule: say it in the client's terms
            msg, _ = describe_validation_error(e.errors())
            raise APIError(400, msg, param=param) from None
        except (ValueError, TypeError, AttributeError, KeyError) as e:  # a shape the checks above missed
            msg = str(e) if isinstance(e, ValueError) else f"malformed `{param}`"
            # Messages start with the field they are about ("text.format ...", "tools[0]: ...").
            named = re.match(r"(system|tools|tool_choice|text|thinking)\b", msg)
            raise APIError(400, msg, param=named.group(1) if named else param) from None

    async def translated(self, m: Served, req, param: str, request: Request, events, whole):
        """Serve a request of another API through the chat path: `events(turn, stream)`
        streams it, `whole(final, turn)` answers it at once."""
        turn, stream, final = await self.chat_translated(m, self.to_chat(req, param), request)
        if final is None:
            return self.sse(events(turn, stream), stream)
        return whole(final, turn)
