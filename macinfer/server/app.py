"""The FastAPI app: routes, auth, body limit, OpenAI-style errors; and `run_server`."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import contextlib
import json
import logging

from fastapi import FastAPI, Request
from pydantic import ValidationError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from macinfer.engine.embedding import EmbeddingBusyError
from macinfer.engine.llm_engine import LLMEngine
from macinfer.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from macinfer.server.metrics import ServerMetrics
from macinfer.server.model_pool import ModelPool, PoolError, Served, ModelSource
from macinfer.server import webui as chat_page
from macinfer.server.middleware import Guard
from macinfer.server import anthropic, ollama, context_editing, responses, status as status_routes
from macinfer.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                      TokenizeRequest, describe_validation_error)
from macinfer.server.serving import DEFAULT_MAX_TOKENS, APIError, OpenAIServing

log = logging.getLogger("macinfer.server")

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request

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
               max_body_bytes: int = 4 * 2**20, allowed_hosts: set[str] | None = None,
               on_dead=None, model_aliases: tuple[str, ...] = (), api_keys: list[str] | None = None,
               cache_isolation: str = "key-and-user", webui: bool = True, tool_parser: str | None = None,
               body_timeout: float = 30.0, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               sampling_defaults: dict | None = None) -> FastAPI:
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
                                default_max_tokens=default_max_tokens, sampling_defaults=sampling_defaults)
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

    status_routes.add_routes(app, pool, metrics)

    def _add_header(request: Request, name: str, value: str) -> None:
        """A header for this response's head (the Guard middleware adds them)."""
        extra = getattr(request.state, "response_headers", [])
        request.state.response_headers = [*extra, (name.encode(), value.encode())]

    def _say_ignored(request: Request, turn) -> None:
        """Fields this model cannot act on (a reasoning effort for a template with no thinking
        control): named in `x-macinfer-ignored` and the log, not refused (every agent sends them)."""
        if turn.ignored:
            log.info("request fields this model cannot act on: %s", ", ".join(turn.ignored))
            _add_header(request, "x-macinfer-ignored", ",".join(turn.ignored))

    async def _start(m: Served, kind: str, req, prompt, max_tokens, logprobs, request: Request, plan=None):
        """Validate, tokenize (never on the event loop: a large prompt takes seconds) and
        admit a request; returns (request id, prompt ids, output stream)."""
        ids, params, limit = await asyncio.to_thread(m.serving.prepare, req, prompt, max_tokens, logprobs, plan)
        if limit is not None:
            _add_header(request, "x-macinfer-max-tokens", limit)
        try:
            index = getattr(request.state, "api_key_index", None)
            client = (None if index is None else key_ids[index], req.user)
            rid, stream = m.serving.submit(req, ids, params, kind, client)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="server_busy",
                           headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error") from None
        return rid, ids, stream

    def _sse(events, stream) -> StreamingResponse:
        # The background task runs even if the client left before the body started.
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(stream.close))

    async def _run(m: Served, kind: str, req, prompt, max_tokens, logprobs, request: Request, turn=None):
        rid, ids, stream = await _start(m, kind, req, prompt, max_tokens, logprobs, request, turn and turn.plan)
        if req.stream:
            return _sse(m.serving.stream(kind, req, rid, ids, stream, turn), stream)
        return await m.serving.complete(kind, req, rid, ids, stream, request, turn)

    async def _chat_translated(m: Served, chat: ChatCompletionRequest, request: Request):
        """Start a chat translated from another API; (chat turn, stream, final output or None)."""
        turn = await asyncio.to_thread(m.serving.chat_prompt, chat)
        _say_ignored(request, turn)
        _, _, stream = await _start(m, "chat", chat, turn.ids, chat.max_tokens, None, request, turn.plan)
        if chat.stream:
            return turn, stream, None
        final = (await m.serving.wait_final(stream, request))[0]
        metrics.observe(final, m.name)
        return turn, stream, final

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        async with pool.use(req.model) as m:
            turn = await asyncio.to_thread(m.serving.chat_prompt, req)
            _say_ignored(request, turn)
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            return await _run(m, "chat", req, turn.ids, req.max_completion_tokens or req.max_tokens, logprobs,
                              request, turn)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        async with pool.use(req.model) as m:
            return await _run(m, "completion", req, prompt, req.max_tokens or 16, req.logprobs, request)

    def _to_chat(req, param: str) -> ChatCompletionRequest:
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

    async def _translated(m: Served, req, param: str, request: Request, events, whole):
        """Serve a request of another API through the chat path: `events(turn, stream)`
        streams it, `whole(final, turn)` answers it at once."""
        turn, stream, final = await _chat_translated(m, _to_chat(req, param), request)
        if final is None:
            return _sse(events(turn, stream), stream)
        return whole(final, turn)

    @app.post("/v1/messages")
    async def messages(req: anthropic.MessagesRequest, request: Request):
        async with pool.use(req.model) as m:
            applied = None
            if req.context_management is not None:  # Anthropic's context editing, before the prompt is built
                req, applied = await asyncio.to_thread(
                    context_editing.apply, req, lambda r: len(m.serving.chat_prompt(_to_chat(r, "messages")).ids),
                    lambda text: len(m.engine.tokenizer.encode(text, add_special_tokens=False)))
            omit = anthropic.thinking_omitted(req)
            return await _translated(m, req, "messages", request,
                                     lambda t, s: anthropic.events(m.name, t, s, applied, omit),
                                     lambda f, t: anthropic.message(req, m.name, f, t, applied))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: anthropic.CountTokensRequest):
        """Anthropic's token count: the prompt the same request to /v1/messages would run."""
        async with pool.use(req.model) as m:
            turn = await asyncio.to_thread(m.serving.chat_prompt, _to_chat(req, "messages"))
        return {"input_tokens": len(turn.ids)}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """vLLM's /tokenize: a prompt, or messages through the chat template."""
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either `prompt` or `messages`", param="prompt")
        async with pool.use(req.model) as m:
            if req.messages is not None:
                chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
                ids = (await asyncio.to_thread(m.serving.chat_prompt, chat)).ids
            else:
                ids = await asyncio.to_thread(m.engine.tokenizer.encode, req.prompt, req.add_special_tokens)
            out = {"count": len(ids), "max_model_len": m.engine.max_model_len, "tokens": ids}
            if req.return_token_strs:
                out["token_strs"] = [m.engine.tokenizer.id_to_token(i) for i in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        async with pool.use(req.model) as m:
            vocab = m.engine.model.args.vocab_size
            if any(not 0 <= t < vocab for t in req.tokens):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
            return {"prompt": m.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/responses")
    async def responses_create(req: responses.ResponsesRequest, request: Request):
        dropped = req.hosted_tools()
        if dropped:
            log.info("responses: hosted tools left out (this server cannot run them): %s", ", ".join(dropped))
            _add_header(request, "x-macinfer-dropped-tools", ",".join(dropped))
        async with pool.use(req.model) as m:
            return await _translated(m, req, "input", request, lambda t, s: responses.events(req, m.name, t, s),
                                     lambda f, t: responses.response(req, m.name, f, t))

    async def _embed(m: Served, inputs: list, request: Request):
        """Pooled embeddings of `inputs` (texts or token lists): (vectors, token count)."""
        engine, async_engine = m.engine, m.async_engine
        if engine.loaded.pooling is None:
            raise APIError(400, "this model does not publish embedding use (no sentence-transformers pooling "
                           "config, no GGUF pooling_type): it has no embeddings endpoint", param="model",
                           code="model_not_supported")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"input holds {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS} per request",
                           param="input")
        tok = engine.tokenizer
        ids = await asyncio.to_thread(lambda: [tok.encode(x) if isinstance(x, str) else list(x) for x in inputs])
        vocab = engine.model.args.vocab_size
        for i, x in enumerate(ids):
            if not x or len(x) > engine.max_model_len:
                raise APIError(400, f"input {i} has {len(x)} tokens; 1 to {engine.max_model_len} fit", param="input")
            if any(not 0 <= t < vocab for t in x):
                raise APIError(400, f"input {i}: token ids must be in [0, {vocab})", param="input")
        job = None
        try:
            job = await async_engine.call(engine.embedding_job, ids)
            # One forward pass per call: generation steps run between them, and a
            # client that leaves stops the work at the next pass.
            while not await async_engine.call(job.step):
                if await request.is_disconnected():
                    log.info("embeddings: client left after %d of %d inputs; stopped", job.next, len(ids))
                    raise APIError(499, "client disconnected")
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error") from None
        except EmbeddingBusyError as e:
            raise APIError(503, str(e), type="server_error", headers={"Retry-After": "1"}) from None
        except APIError:
            raise
        except Exception:
            log.exception("embedding failed")
            raise APIError(500, "embedding failed with an internal error (details are in the server log)",
                           type="server_error") from None
        finally:
            if job is not None:
                with contextlib.suppress(Exception):
                    await async_engine.call(job.close)
        return job.results, sum(len(x) for x in ids)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        inputs = req.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        async with pool.use(req.model) as m:
            results, n = await _embed(m, inputs, request)
            name = m.name

        async def body():
            # Written a few vectors at a time on the event loop, which serves other
            # streams between them: one json.dumps (or FastAPI's encoder) of 2,000
            # vectors holds the GIL for ~0.5 s, a pause every stream would see.
            yield '{"object": "list", "data": ['
            for i, v in enumerate(results):
                emb = (base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64"
                       else v.astype(float).tolist())
                yield ("" if i == 0 else ", ") + json.dumps({"object": "embedding", "index": i, "embedding": emb})
                if i % 32 == 31:
                    await asyncio.sleep(0)
            yield (f'], "model": {json.dumps(name)}, '
                   f'"usage": {json.dumps({"prompt_tokens": n, "total_tokens": n})}}}')

        return StreamingResponse(body(), media_type="application/json")

    ollama.add_routes(app, pool, _chat_translated, _embed, _add_header)
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
