"""The FastAPI app: middleware (auth, body limit, hosts), errors in each API's own shape, the
health probes, and every API surface's routes composed (`routing.py`); and `run_server`."""

from __future__ import annotations

import contextlib
import hashlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from macinfer.engine.llm_engine import LLMEngine
from macinfer.server import adapters, anthropic, embeddings, ollama, openai, responses, status
from macinfer.server import webui as chat_page
from macinfer.server.async_engine import AsyncEngine
from macinfer.server.metrics import ServerMetrics
from macinfer.server.middleware import Guard
from macinfer.server.model_pool import ModelPool, PoolError, Served
from macinfer.server.model_sources import ModelSource
from macinfer.server.protocol import describe_validation_error
from macinfer.server.routing import Routing
from macinfer.server.errors import APIError
from macinfer.server.serving import DEFAULT_MAX_TOKENS, OpenAIServing

log = logging.getLogger("macinfer.server")

_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           type: str | None = None, headers: dict | None = None, path: str = "") -> JSONResponse:
    if 400 <= status < 500 and status != 499:  # with -v, the reason a client got, not only its status
        log.info("%d on %s: %s%s", status, path, message, f" (param: {param})" if param else "")
    if path.startswith("/v1/messages"):  # Anthropic clients read Anthropic-shaped errors
        return JSONResponse(anthropic.error_body(status, message), status_code=status, headers=headers)
    if path.startswith("/api/") and path != "/api/hello":  # Ollama's clients read {"error": ...}
        return JSONResponse(ollama.error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(APIError(status, message, type or _STATUS_TYPES.get(status, "server_error"),
                                 param, code).body(), status_code=status, headers=headers)


def create_app(engine: LLMEngine | ModelPool, model_name: str | None = None, api_key: str | None = None,
               cors_origins: list[str] | None = None, max_queue: int = 64,
               max_body_bytes: int = 32 * 2**20, allowed_hosts: set[str] | None = None,
               on_dead=None, model_aliases: tuple[str, ...] = (), api_keys: list[str] | None = None,
               cache_isolation: str = "key-and-user", webui: bool = True, tool_parser: str | None = None,
               body_timeout: float = 30.0, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               sampling_defaults: dict | None = None, allow_image_urls: bool = False) -> FastAPI:
    """The ASGI app. `allowed_hosts`: Host header names accepted (None: any);
    `on_dead`: called from the engine thread if the engine cannot recover;
    `cache_isolation`: which requests may share prefix-cache entries;
    `webui`: serve the chat page at `/`. `engine`: one loaded engine served as `model_name`
    (every `model` value reaches it), or a `ModelPool` of several models."""
    api_keys = list(api_keys or []) + ([api_key] if api_key else [])
    # A key's share of the prefix cache is named by a digest of the key, not its place in
    # the list: the disk tier outlives the process, and the key list may change.
    key_ids = [hashlib.blake2b(k.encode(), digest_size=8).hexdigest() for k in api_keys]
    pool = engine if isinstance(engine, ModelPool) else ModelPool.one(engine, model_name, model_aliases)
    metrics = ServerMetrics(lambda: [(s.name, s.engine) for s in pool.loaded()], labelled=not pool.single)

    def wrap(engine: LLMEngine, source: ModelSource) -> Served:
        async_engine = AsyncEngine(engine, max_pending=engine.config.max_num_seqs + max_queue, on_dead=on_dead)
        serving = OpenAIServing(async_engine, source.name, metrics, aliases=source.aliases,
                                cache_isolation=cache_isolation, tool_parser=tool_parser,
                                default_max_tokens=default_max_tokens, sampling_defaults=sampling_defaults,
                                allow_image_urls=allow_image_urls)
        return Served(source.name, engine, async_engine, serving)

    pool.attach(wrap)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        pool.start()
        yield
        pool.shutdown()

    app = FastAPI(title="macinfer", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.pool = pool
    if pool.single:
        app.state.async_engine = pool.default.served.async_engine

    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    open_paths = ("/health", *(chat_page.OPEN_PATHS if webui else ()))
    app.add_middleware(Guard, api_keys=api_keys, max_body_bytes=max_body_bytes, allowed_hosts=allowed_hosts,
                       open_paths=open_paths, body_timeout=body_timeout)
    if webui:
        chat_page.add_routes(app)
    else:
        @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
        async def root():  # clients probe `HEAD /` before their first request (Claude Code does)
            return {"status": "ok", "model": pool.default.name}

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error(e.status, e.message, e.param, e.code, e.type, e.headers, request.url.path)

    @app.exception_handler(PoolError)
    async def _pool_error(request: Request, e: PoolError):
        return _error(e.status, e.message, "model", e.code, "server_error" if e.status >= 500 else None,
                      {"Retry-After": "5"} if e.retry else None, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        path = request.url.path
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {err.get('ctx', {}).get('error', 'invalid JSON')}", path=path)
        msg, field = describe_validation_error(e.errors())
        return _error(400, msg, param=field, path=path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), path=request.url.path)

    @app.api_route("/api/hello", methods=["GET", "HEAD"], include_in_schema=False)
    async def hello():  # Anthropic's connectivity probe; Claude Code sends `HEAD /api/hello` first
        return {"status": "ok"}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        problem = next((s.async_engine.dead or s.async_engine.draining for s in pool.loaded()
                        if s.async_engine.dead or s.async_engine.draining), None)
        if problem:
            return JSONResponse({"status": "error", "reason": problem}, status_code=503)
        return {"status": "ok"}

    routing = Routing(pool, metrics, key_ids)
    for surface in (openai, anthropic, responses, embeddings, ollama, status, adapters):
        surface.add_routes(app, routing)
    return app


def run_server(engine: LLMEngine | ModelPool, model_name: str | None, sock, *, header_timeout: float = 10.0,
               max_connections: int | None = None, log_requests: bool = False, **kwargs) -> int:
    """Serve on an already bound socket until SIGINT/SIGTERM or an engine that cannot
    recover. Returns the process exit code: 0 after a clean shutdown, 1 if the engine died."""
    import uvicorn

    from macinfer.server.net import RateLimitFilter, max_connections_for, protocol_with_limits, raise_fd_limit

    holder: dict = {}

    def on_dead(reason: str) -> None:
        server = holder.get("server")
        if server is not None:
            server.should_exit = True

    app = create_app(engine, model_name, on_dead=on_dead, **kwargs)
    pool: ModelPool = app.state.pool

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Before uvicorn waits for open requests: end them with an error event / 503.
            for served in pool.loaded():
                served.async_engine.drain("the server is shutting down")
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a captured SIGINT/SIGTERM after its graceful shutdown
            # (exit 130/143); a shutdown asked for is a clean exit here: status 0.
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    fd_limit = raise_fd_limit()
    limit = max_connections or max_connections_for(fd_limit)
    config = uvicorn.Config(
        app, log_level="info" if log_requests else "warning", access_log=log_requests,
        timeout_graceful_shutdown=3, timeout_keep_alive=5, limit_concurrency=limit,
        # One address may hold half the connections: never all of them.
        http=protocol_with_limits(header_timeout, per_client=max(1, limit // 2)),
    )
    server = holder["server"] = Server(config)
    logging.getLogger("uvicorn.error").addFilter(RateLimitFilter())  # connection errors, not the access log
    host, port = sock.getsockname()[:2]
    if pool.single:
        engine = pool.default.served.engine
        kv = engine.kv_cache
        groups = ", ".join(f"{g['kind']}: {g['blocks_total']}" if "blocks_total" in g else
                           f"{g['kind']}: {g['slots_total']} slots" for g in engine.cache_groups())
        print(f"macinfer serving {pool.default.name} on http://{host}:{port}/v1  "
              f"(KV cache: blocks of {kv.block_size} tokens ({groups}) = {kv.nbytes / 2**30:.2f} GiB; "
              f"max_model_len {engine.max_model_len}; max_num_seqs {engine.config.max_num_seqs})", flush=True)
    else:
        budget = f"{pool.budget / 2**30:.1f} GiB" if pool.budget else "none"
        ttl = f"{pool.idle_ttl:g}s" if pool.idle_ttl else "none"
        print(f"macinfer serving {len(pool.entries)} models on http://{host}:{port}/v1 (memory budget {budget}, "
              f"idle TTL {ttl}): " + ", ".join(f"{e.name} ({e.state})" for e in pool.entries.values()), flush=True)
    if kwargs.get("webui", True):
        print(f"chat page: http://{host}:{port}/", flush=True)
    hosts = kwargs.get("allowed_hosts")
    print("Host check: any name (--allowed-host '*')" if hosts is None else
          f"Host check: answers IP addresses and {', '.join(sorted(hosts))} (more with --allowed-host)", flush=True)
    server.run(sockets=[sock])
    pool.shutdown()
    dead = next((s.async_engine.dead for s in pool.loaded() if s.async_engine.dead), None)
    if dead:
        print(f"macinfer: {dead}", flush=True)
        return 1
    return 0
