"""The FastAPI app: routes, auth, body limit, OpenAI-style errors; and `run_server`."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from macinfer.engine.llm_engine import LLMEngine
from macinfer.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from macinfer.server.metrics import ServerMetrics
from macinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from macinfer.server.serving import APIError, OpenAIServing

log = logging.getLogger("macinfer.server")

_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           type: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type or _STATUS_TYPES.get(status, "server_error"),
                                 param, code).body(), status_code=status, headers=headers)


class _BodyLimit:
    """Pure ASGI middleware: 413 for bodies over the limit, declared or streamed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = _error(413, f"request body is larger than {self.max_bytes} bytes")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_big(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await too_big(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def create_app(engine: LLMEngine, model_name: str, api_key: str | None = None,
               cors_origins: list[str] | None = None, max_queue: int = 64,
               max_body_bytes: int = 4 * 2**20) -> FastAPI:
    metrics = ServerMetrics(engine)
    async_engine = AsyncEngine(engine, max_pending=engine.config.max_num_seqs + max_queue)
    serving = OpenAIServing(async_engine, model_name, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        async_engine.shutdown()

    app = FastAPI(title="macinfer", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.async_engine = async_engine

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path != "/health" and request.method != "OPTIONS":
            got = request.headers.get("authorization", "")
            if not (got.startswith("Bearer ") and secrets.compare_digest(got[7:], api_key)):
                return _error(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")
        return await call_next(request)

    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {err.get('ctx', {}).get('error', 'invalid JSON')}")
        loc = [str(p) for p in err.get("loc", []) if p != "body"]
        field = ".".join(loc) or None
        return _error(400, f"{field or 'body'}: {err.get('msg')}", param=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        log.exception("unhandled error")
        return _error(500, "internal server error", type="server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                             "owned_by": "macinfer", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _run(kind: str, req, prompt, max_tokens, logprobs, request: Request):
        serving.check_model(req.model)
        try:
            rid, ids, stream = serving.start(req, prompt, max_tokens, logprobs, kind)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="server_busy",
                           headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error") from None
        if req.stream:
            # The background task runs even if the client left before the body started.
            return StreamingResponse(serving.stream(kind, req, rid, ids, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(stream.close))
        return await serving.complete(kind, req, rid, ids, stream, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        prompt = serving.chat_prompt(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await _run("chat", req, prompt, req.max_completion_tokens or req.max_tokens, logprobs, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        return await _run("completion", req, prompt, req.max_tokens or 16, req.logprobs, request)

    return app


def run_server(engine: LLMEngine, model_name: str, host: str, port: int, **kwargs) -> None:
    import uvicorn

    app = create_app(engine, model_name, **kwargs)
    kv = engine.kv_cache
    print(f"macinfer serving {model_name} on http://{host}:{port}/v1  "
          f"(KV cache: {kv.num_blocks} blocks x {kv.block_size} tokens = {kv.nbytes / 2**30:.2f} GiB; "
          f"max_model_len {engine.max_model_len}; max_num_seqs {engine.config.max_num_seqs})", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=3)
