"""The routes that report: `/v1/models`, `/status` (the chat page's view; every model's
state, memory and hit rates when several are served) and `/metrics` (Prometheus)."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from macinfer.server.model_pool import ModelPool, Served
from macinfer.server.routing import Routing


def add_routes(app: Any, routing: Routing) -> None:
    pool: ModelPool = routing.pool
    metrics = routing.metrics
    created = int(time.time())  # one value for the server's life, as clients cache model lists

    def model_card(entry) -> dict:
        card = pool.card(entry)
        return {"id": card.pop("id"), "object": "model", "created": created, "owned_by": "macinfer",
                **{k: card[k] for k in ("max_model_len", "input_modalities", "images_refused") if k in card},
                **({} if pool.single else card)}

    def adapter_cards(entry) -> list[dict]:
        """A model's LoRA adapters, as vLLM lists them: their base as `parent`, the folder as `root`."""
        loras = entry.served.engine.loras if entry.served is not None else None
        paths = {n: loras.adapters[n].path for n in loras.names()} if loras is not None else dict(entry.source.loras)
        return [{"id": n, "object": "model", "created": created, "owned_by": "macinfer", "parent": entry.name,
                 "root": p} for n, p in paths.items()]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card for e in pool.entries.values()
                                           for card in (model_card(e), *adapter_cards(e))]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        entry = pool.resolve(model_id, strict=True)  # 404 model_not_found for another id
        return next((c for c in adapter_cards(entry) if c["id"] == model_id), None) or model_card(entry)

    def engine_status(served: Served) -> dict:
        engine = served.engine
        bm = engine.block_manager
        kv = {"blocks_total": bm.num_blocks, "blocks_used": bm.num_used_blocks, "block_size": bm.block_size,
              "usage": bm.num_used_blocks / bm.num_blocks if bm.num_blocks else 0.0, "bytes": engine.kv_cache.nbytes,
              "prefix_hit_rate": bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
              "prefix_queried_tokens": bm.prefix_queries, "prefix_hit_tokens": bm.prefix_hits,
              "groups": engine.cache_groups()}
        if engine.drafter_pool() is not None:  # a drafter's own pool, in the same budget
            kv["drafter"] = engine.drafter_pool()
        if engine.block_manager.disk is not None:  # the prefix cache's disk tier
            kv["disk"] = engine.block_manager.disk.stats()
        out = {"model": served.name, "max_model_len": engine.max_model_len, "kv": kv,
               "requests": {"running": engine.num_running, "waiting": engine.num_waiting},
               "tokens": dict(engine.stats), "memory_bytes": engine.memory_bytes()}
        if getattr(engine, "distributed_status", None):  # --distributed: each rank's plan and memory
            out["distributed"] = engine.distributed_status
        return out

    def model_summary(entry) -> dict:
        """One model's line in a multi-model /status: state, memory, load and hit rates."""
        out = pool.card(entry)
        if entry.served is not None:
            engine = entry.served.engine
            bm = engine.block_manager
            out.update(memory_bytes=engine.memory_bytes(), tokens=dict(engine.stats),
                       requests={"running": engine.num_running, "waiting": engine.num_waiting},
                       prefix_hit_rate=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0)
            if bm.disk is not None:
                out["disk_hit_tokens"] = bm.disk.hit_tokens
                out["disk_hit_rate"] = bm.disk.hit_tokens / bm.prefix_queries if bm.prefix_queries else 0.0
        return out

    @app.get("/status")
    async def status(model: str | None = None):
        """What the chat page shows: the model, KV usage and the queue (Prometheus has the rest).
        Several models: the one `?model=` names (the first by default) at the top level, and
        every model's state, memory and hit rate under `models`."""
        entry = pool.resolve(model, strict=model is not None)
        served = entry.served
        out = engine_status(served) if served is not None else {
            "model": entry.name, "state": entry.state, "kv": {"usage": 0.0, "blocks_used": 0, "blocks_total": 0},
            "requests": {"running": 0, "waiting": 0}}
        if not pool.single:
            out["models"] = [model_summary(e) for e in pool.entries.values()]
            import mlx.core as mx

            # used: what the loaded models hold by their own count; device_active: what MLX has
            # allocated in this process (all models, temporaries), which an unload must give back
            out["memory"] = {"budget_bytes": pool.budget, "used_bytes": sum(s.nbytes for s in pool.loaded()),
                             "device_active_bytes": mx.get_active_memory()}
        return out

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
