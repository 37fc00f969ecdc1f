"""OpenAI's /v1/embeddings: pooled final hidden states computed on the engine thread through
the paged cache (`engine/embedding.py`), one forward pass per engine call (Ollama's
/api/embed takes the same path)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from macinfer.engine.embedding import EmbeddingBusyError
from macinfer.server.async_engine import EngineDeadError
from macinfer.server.model_pool import Served
from macinfer.server.protocol import EmbeddingRequest
from macinfer.server.routing import Routing
from macinfer.server.errors import APIError

log = logging.getLogger("macinfer.server")

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request


async def embed(m: Served, inputs: list, request: Request):
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


def add_routes(app: FastAPI, routing: Routing) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        inputs = req.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        async with routing.pool.use(req.model) as m:
            results, n = await embed(m, inputs, request)
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
