"""LoRA adapters at run time, by vLLM's routes: `POST /v1/load_lora_adapter` (`lora_name`,
`lora_path`) and `POST /v1/unload_lora_adapter` (`lora_name`). They read files on this
machine, so they answer only on a server started with `--api-key` (whose guard they are
behind); `model` in the body names the base model (default: the first)."""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from macinfer.lora.adapter import LoraError
from macinfer.server.routing import Routing
from macinfer.server.errors import APIError


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    model: str | None = None


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    model: str | None = None


def add_routes(app: FastAPI, routing: Routing) -> None:
    pool = routing.pool

    def allowed() -> None:
        if not routing.key_ids:
            raise APIError(403, "loading adapters at run time reads files on this machine: start the server with "
                           "--api-key to allow it (or give them with --lora at start)", type="permission_error")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraRequest):
        allowed()
        if not req.lora_name or req.lora_name in {n for e in pool.entries.values() for n in e.source.names}:
            raise APIError(400, f"{req.lora_name!r} names a served model; give the adapter another name",
                           param="lora_name")
        async with pool.use(req.model) as m:
            path = os.path.expanduser(req.lora_path)
            try:
                await m.async_engine.call(m.engine.load_lora, req.lora_name, path)
            except LoraError as e:
                raise APIError(400, str(e), param="lora_path") from None
            pool.entries[m.name].source.loras[req.lora_name] = path  # (loaded again with the model)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraRequest):
        allowed()
        async with pool.use(req.model) as m:
            try:
                await m.async_engine.call(m.engine.unload_lora, req.lora_name)
            except LoraError as e:
                raise APIError(404, str(e), param="lora_name", code="lora_not_found") from None
            pool.entries[m.name].source.loras.pop(req.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
