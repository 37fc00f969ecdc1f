"""Several models behind one server: each loaded on demand, unloaded when idle or when
the memory budget needs its room, never while it has a request.

A model is an `Entry`: its source, its state (unloaded, loading, loaded) and, once
loaded, its serving stack (`Served`: engine, step thread, OpenAI serving). Requests
take a model with `async with pool.use(name)`; a model is busy while any request
holds it or any of its streams is open, and only idle models are unloaded.

Every model's engine has its own step thread, and the threads take turns on the
device (`async_engine.DEVICE`): one step at a time, first come first served. A load
takes its turn too, so it pauses the other models' steps while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from macinfer.loading.memory import release_freed
from macinfer.server.model_sources import GiB, ModelSource, no_paths, size_text

log = logging.getLogger("macinfer.server")

@dataclass
class Served:
    """A loaded model's serving stack; `close()` stops its step thread."""
    name: str
    engine: Any
    async_engine: Any
    serving: Any

    @property
    def nbytes(self) -> int:
        return self.engine.memory_bytes()

    def busy(self) -> bool:
        return self.async_engine.num_pending > 0 or self.engine.has_unfinished_requests()

    def close(self) -> None:
        """Stop the step thread and wait until it has let go of the engine (its prefix cache
        written first): only then is the memory free to count."""
        self.async_engine.drain("the model is being unloaded")
        self.async_engine.shutdown(leave_thread=True)
        self.async_engine.wait_stopped()


@dataclass
class Entry:
    source: ModelSource
    served: Served | None = None
    loading: asyncio.Future | None = None
    users: int = 0  # requests holding it (between `use` and their return)
    last_used: float = field(default_factory=time.monotonic)
    known_bytes: int = 0  # measured at its last load
    keep_alive: float | None = None  # seconds idle before unload, set by a request (Ollama's keep_alive)
    loads: int = 0
    unloading: bool = False  # no request reaches it any more, and its memory is not back yet

    @property
    def state(self) -> str:
        return "loaded" if self.served else "loading" if self.loading else "unloading" if self.unloading \
            else "unloaded"

    @property
    def name(self) -> str:
        return self.source.name

    def busy(self) -> bool:
        return self.users > 0 or (self.served is not None and self.served.busy())

    def need_bytes(self, kv_guess: int | None = None) -> int:
        """Its size: measured at its last load, else its weights as they will load plus the
        KV it will take (`kv_guess`; else a quarter of the weights, about the default share)."""
        if self.known_bytes:
            return self.known_bytes
        weights = max(self.source.weights_bytes, self.source.disk_bytes)
        return weights + (kv_guess if kv_guess is not None else weights // 4)


class PoolError(Exception):
    """A model that cannot be served now: `status` and a message for the client."""

    def __init__(self, status: int, message: str, code: str, retry: bool = False):
        super().__init__(message)
        self.status, self.message, self.code, self.retry = status, message, code, retry


class ModelPool:
    """The models one server serves. `load(source)` builds an engine (any thread),
    `wrap(engine, source)` its serving stack (set by the app). With one model given
    as loaded (`single`), every `model` value reaches it, as llama-server does."""

    def __init__(self, sources: list[ModelSource], load: Callable[[ModelSource], Any] | None = None,
                 budget_bytes: int | None = None, idle_ttl: float | None = None, wait_seconds: float = 60.0,
                 kv_bytes: int | None = None):
        if not sources:
            raise ValueError("no models to serve")
        self.entries = {s.name: Entry(s) for s in sources}
        self.load_fn = load
        self.budget = budget_bytes
        self.kv_bytes = kv_bytes  # each model's KV cache when the engine options fix it (--kv-cache-gb)
        self.idle_ttl = idle_ttl
        self.wait_seconds = wait_seconds
        self.wrap: Callable[[Any, ModelSource], Served] | None = None
        self.single = False
        self._engines: dict[str, Any] = {}  # loaded before the app existed, wrapped at `attach`
        self._reaper: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # room making and unloads: one at a time
        # Loads one at a time, each from making its room to its measured size: a load never
        # starts while another one's memory is still unknown (two would both pass the check).
        self._loading = asyncio.Lock()

    @classmethod
    def one(cls, engine: Any, name: str, aliases: tuple[str, ...] = ()) -> "ModelPool":
        pool = cls([ModelSource(name, "", tuple(a for a in aliases if a != name), pinned=True)])
        pool.single = True
        pool._engines[name] = engine
        return pool

    def preloaded(self, name: str, engine: Any) -> None:
        """An engine loaded before the server started (the first model)."""
        self._engines[name] = engine

    def attach(self, wrap: Callable[[Any, ModelSource], Served]) -> None:
        self.wrap = wrap
        for name, engine in self._engines.items():
            e = self.entries[name]
            e.served = wrap(engine, e.source)
            e.known_bytes, e.loads = e.served.nbytes, 1
        self._engines.clear()

    @property
    def default(self) -> Entry:
        return next(iter(self.entries.values()))

    def loaded(self) -> list[Served]:
        return [e.served for e in self.entries.values() if e.served is not None]

    # -- names -----------------------------------------------------------------
    def resolve(self, model: str | None, strict: bool = False) -> Entry:
        """The entry a `model` value names: a name or alias, with or without an Ollama
        `:tag`; none names the first model. Unknown names are a 404 listing the served ones,
        except with one model without LoRA adapters (not `strict`): any name reaches it, as
        agents send their own. With adapters a name picks one, so a mistyped one is a 404,
        never the base model answering in its place."""
        if model is None or model == "" or (self.single and not strict and not self._adapters(self.default)):
            return self.default
        for e in self.entries.values():
            if model in e.source.names:
                return e
        base, _, tag = model.rpartition(":")
        if base and "/" not in tag:
            for e in self.entries.values():
                if base in e.source.names:
                    return e
        for e in self.entries.values():  # one of a model's LoRA adapters: that model
            if model in e.source.loras or (e.served is not None and model in e.served.engine.loras):
                return e
        names = ", ".join(sorted(self.entries))
        raise PoolError(404, f"The model `{model}` does not exist; this server serves: {names}.", "model_not_found")

    @staticmethod
    def _adapters(entry: Entry) -> bool:
        """Whether `entry`'s model serves LoRA adapters (given at start or loaded since)."""
        return bool(entry.source.loras) or (entry.served is not None and bool(entry.served.engine.loras.names()))

    # -- use ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def use(self, model: str | None) -> AsyncIterator[Served]:
        """The model's serving stack, loaded first if it is not; held busy until the block ends."""
        entry = self.resolve(model)
        entry.users += 1
        entry.keep_alive = None  # a keep-alive is per request (Ollama's): this one sets its own, if any
        try:
            served = await self._ensure(entry)
            entry.last_used = time.monotonic()
            yield served
        finally:
            entry.users -= 1
            entry.last_used = time.monotonic()

    async def _ensure(self, entry: Entry) -> Served:
        while entry.served is None:
            if entry.loading is None:  # the first request starts the load; the others wait on it
                entry.loading = asyncio.ensure_future(self._load(entry))
            fut = entry.loading
            try:
                await asyncio.shield(fut)
            finally:
                if fut.done() and entry.loading is fut:
                    entry.loading = None
        return entry.served

    async def _load(self, entry: Entry) -> None:
        async with self._loading:
            await self._load_one(entry)

    async def _load_one(self, entry: Entry) -> None:
        async with self._lock:
            await self._make_room(entry, entry.need_bytes(self.kv_bytes))
            # The engine may take what the budget leaves (weights and KV), no more.
            limit = None if self.budget is None else self.budget - self._used_by_others(entry)
        started = time.perf_counter()
        log.info("loading model %s from %s", entry.name, entry.source.path)
        try:
            engine = await asyncio.to_thread(self._build_engine, entry.source, limit)
        except PoolError:
            raise
        except Exception as e:  # the model's files: every request waiting on it gets the reason
            log.exception("loading model %s failed", entry.name)
            raise PoolError(503, f"model `{entry.name}` failed to load: {no_paths(str(e))}",
                            "model_load_failed") from None
        served = self.wrap(engine, entry.source)
        entry.known_bytes, entry.loads = served.nbytes, entry.loads + 1
        entry.served = served
        entry.last_used = time.monotonic()
        async with self._lock:  # measured now: it may need more room than guessed
            try:
                await self._make_room(entry, entry.known_bytes)
            except PoolError:
                await self._unload(entry, "it does not fit the memory budget")
                raise
        log.info("loaded model %s in %.1fs (%.2f GiB: weights and KV cache)", entry.name,
                 time.perf_counter() - started, entry.known_bytes / GiB)

    def _build_engine(self, source: ModelSource, limit: int | None) -> Any:
        from macinfer.server.async_engine import DEVICE

        with DEVICE:  # a load takes its turn on the device like a step
            return self.load_fn(source, limit)

    def _used_by_others(self, entry: Entry) -> int:
        return sum(e.known_bytes for e in self.entries.values() if e is not entry and e.served is not None)

    async def _make_room(self, entry: Entry, need: int) -> None:
        """Unload idle models, least recently used first, until `need` fits the budget;
        wait for busy ones up to `wait_seconds`; a model larger than the budget is refused."""
        if self.budget is None:
            return
        pinned = sum(e.known_bytes for e in self.entries.values()
                     if e is not entry and e.served is not None and e.source.pinned)
        if need + pinned > self.budget:
            raise PoolError(503, f"model `{entry.name}` needs {size_text(need)} (weights and KV cache); the "
                            f"memory budget is {size_text(self.budget)}" +
                            (f", {size_text(pinned)} of it held by pinned models" if pinned else "") +
                            " (--max-memory-gb)", "model_too_large")
        deadline = time.monotonic() + self.wait_seconds
        while self._used_by_others(entry) + need > self.budget:
            idle = [e for e in self.entries.values() if e is not entry and e.served is not None
                    and not e.source.pinned and not e.busy()]
            if idle:
                await self._unload(min(idle, key=lambda e: e.last_used), f"to make room for {entry.name}")
                continue
            if time.monotonic() > deadline:
                busy = ", ".join(e.name for e in self.entries.values() if e is not entry and e.served is not None)
                raise PoolError(503, f"model `{entry.name}` needs {size_text(need)} and the memory budget "
                                f"({size_text(self.budget)}) is held by models serving requests ({busy}); "
                                "retry shortly", "model_busy", retry=True)
            await asyncio.sleep(0.1)

    # -- unload ------------------------------------------------------------------
    async def _unload(self, entry: Entry, why: str) -> None:
        """Stop the model's step loop (its prefix cache to disk, when that tier is on) and
        free its memory, off the event loop: the other models' requests go on meanwhile."""
        box, entry.served = [entry.served], None
        if box[0] is None:
            return

        def close() -> None:
            box[0].close()
            box.clear()  # the last reference: the engine goes now
            release_freed()  # the freed buffers back to the system, not to MLX's cache or the heap

        entry.unloading = True  # listed (state "unloading") until its memory is back
        try:
            await asyncio.to_thread(close)
        finally:
            entry.unloading = False
        log.info("unloaded model %s (%s)", entry.name, why)

    def unload_when_idle(self, entry: Entry) -> None:
        """Ollama's keep_alive 0: unload once its requests are done (the reaper does it)."""
        entry.keep_alive = 0.0

    async def unload_idle(self, now: float | None = None) -> list[str]:
        """Unload models idle past their keep-alive (a request's) or the pool's TTL."""
        now = time.monotonic() if now is None else now
        gone = []
        for e in self.entries.values():
            ttl = e.keep_alive if e.keep_alive is not None else self.idle_ttl
            if e.served is None or e.source.pinned or ttl is None or ttl < 0 or e.busy():
                continue
            if now - e.last_used >= ttl:
                await self._unload(e, f"idle for {now - e.last_used:.0f}s")
                gone.append(e.name)
        return gone

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            async with self._lock:
                await self.unload_idle()

    def start(self) -> None:
        if self._reaper is None and not self.single:
            self._reaper = asyncio.get_running_loop().create_task(self.reap_forever())

    def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for served in self.loaded():
            served.async_engine.shutdown()

    # -- reports -----------------------------------------------------------------
    def card(self, e: Entry) -> dict[str, Any]:
        out: dict[str, Any] = {"id": e.name, "state": e.state, "aliases": sorted(e.source.aliases),
                               "pinned": e.source.pinned}
        if e.source.path and e.source.context_length:
            out["context_length"] = e.source.context_length
        if e.served is not None:
            engine = e.served.engine
            out["max_model_len"] = engine.max_model_len
            # Which inputs it takes; a vision checkpoint whose images are refused says why.
            out["input_modalities"] = ["text", "image"] if getattr(engine, "vision", None) is not None else ["text"]
            if getattr(engine, "vision_refusal", None):
                out["images_refused"] = engine.vision_refusal
        if e.known_bytes or e.source.disk_bytes:
            out["size_bytes"] = e.known_bytes or e.source.disk_bytes
        return out
