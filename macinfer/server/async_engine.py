"""One engine, stepped in one background thread, shared by every HTTP request.

The event loop never touches the engine directly: it sends add/abort
commands through a thread-safe queue, and the engine thread hands each
output to the request's asyncio.Queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from typing import Any
import logging
import queue
import threading
from dataclasses import dataclass

from macinfer.engine.llm_engine import LLMEngine, RequestOutput
from macinfer.engine.profile import maybe
from macinfer.sampling_params import SamplingParams

log = logging.getLogger("macinfer.server")


class Turns:
    """A lock taken in arrival order: every model's step thread (and a load) takes a turn
    on the device, so two models decoding at once alternate steps fairly. A plain Lock
    would let the thread that just released it take it again at once."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


DEVICE = Turns()  # one per process: the models of a server share one device

# Step threads are never let go: a thread that has run MLX and exits leaves MLX a
# per-thread stream whose teardown aborts the process at exit ("terminate called without
# an active exception"). An unloaded model's thread waits here for the next model's loop.
_idle_hosts: queue.SimpleQueue = queue.SimpleQueue()


def _host(inbox: queue.SimpleQueue) -> None:
    while True:
        inbox.get()()
        _idle_hosts.put(inbox)


def _start_in_host(fn) -> None:
    """Run `fn` on an idle step thread, or on a new one."""
    try:
        inbox = _idle_hosts.get_nowait()
    except queue.Empty:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_host, args=(inbox,), name="macinfer-engine", daemon=True).start()
    inbox.put(fn)


class QueueFullError(RuntimeError):
    """More requests in flight than the server accepts; the client should retry."""


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RequestStream:
    """Outputs of one submitted request as (choice index, RequestOutput).

    `close()` (idempotent) aborts unfinished choices so their KV blocks are
    freed at once: call it when the client goes away.
    """

    def __init__(self, engine: "AsyncEngine", rids: list[str]):
        self.engine = engine
        self.rids = rids
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.remaining = set(rids)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.remaining or self.closed:
            self.close()
            raise StopAsyncIteration
        try:
            rid, out = await self.queue.get()
        except BaseException:
            self.close()
            raise
        if out.finished:
            self.remaining.discard(rid)
        return self.index[rid], out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine._release(self.rids, self.remaining)


class AsyncEngine:
    """Runs the engine in a supervised thread. An iteration that raises is retried;
    `max_failures` in a row mean the engine cannot recover: every open request
    gets an error, `dead` says why, and `on_dead` is called (the server exits)."""

    def __init__(self, engine: LLMEngine, max_pending: int, on_dead=None, max_failures: int = 3):
        self.engine = engine
        self.max_pending = max_pending  # requests admitted and not finished, all choices counted
        self.on_dead = on_dead
        self.max_failures = max_failures
        self.dead: str | None = None  # why the engine stopped for good
        self.draining: str | None = None  # why no new requests are taken (shutdown)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._parked = threading.Event()  # the thread has left its loop for good
        self._leave = False  # shutdown(leave_thread=True): the thread goes back to the idle hosts
        _start_in_host(self._run)

    # -- event-loop side ---------------------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self._routes)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a request (raises ValueError); safe off the engine thread."""
        return self.engine.validate_request(prompt, params)

    def submit(
        self, prompt_ids: list[int], params_list: list[SamplingParams], request_id: str,
        cache_salt: str | None = None, images: Any = None, lora: str | None = None,
    ) -> "RequestStream":
        """Admit len(params_list) choices of one prompt, or raise QueueFullError now."""
        if self.dead or self.draining or not self.running:
            raise EngineDeadError(self.dead or self.draining or "the engine thread has stopped")
        stream = RequestStream(self, [f"{request_id}-{i}-{next(self._ids)}" for i in range(len(params_list))])
        with self._lock:
            if len(self._routes) + len(stream.rids) > self.max_pending:
                raise QueueFullError(
                    f"server is at capacity ({self.max_pending} requests in flight); retry shortly"
                )
            for rid in stream.rids:
                self._routes[rid] = _Pending(stream.loop, stream.queue)
        for rid, params in zip(stream.rids, params_list):
            self._commands.put(("add", rid, prompt_ids, params, cache_salt, images, lora))
        return stream

    async def call(self, fn, *args):
        """Run fn(*args) on the engine thread between steps (e.g. engine.embed)."""
        if self.dead or self.draining or not self.running:
            raise EngineDeadError(self.dead or self.draining or "the engine thread has stopped")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, args, future))
        return await asyncio.wrap_future(future)

    def _release(self, rids: list[str], unfinished: set[str]) -> None:
        for rid in unfinished:
            self._commands.put(("abort", rid))
        with self._lock:
            for rid in rids:
                self._routes.pop(rid, None)

    def fail_all(self, message: str) -> None:
        """End every open request with `message` (safe to show clients); any thread."""
        with self._lock:
            rids = list(self._routes)
        for rid in rids:
            self._fail(rid, message)

    def _fail(self, rid: str, message: str) -> None:
        with self._lock:
            route = self._routes.get(rid)
        if route is not None:
            out = RequestOutput(rid, [], "", [], "", [], True, "error", error=message, client_error=message)
            try:
                route.loop.call_soon_threadsafe(route.queue.put_nowait, (rid, out))
            except RuntimeError:  # its event loop is closed
                pass
        self._commands.put(("abort", rid))

    def drain(self, message: str = "the server is shutting down") -> None:
        """Stop taking requests and end the open ones with an error (graceful shutdown)."""
        if self.draining is None:
            self.draining = message
            self.fail_all(message)

    def shutdown(self, leave_thread: bool = False) -> None:
        """Stop stepping. `leave_thread`: the thread lets go of the engine and waits for another
        model's loop (an unload while the server runs); otherwise it parks (at exit, see `_run`)."""
        self._leave = leave_thread
        self._stopped.set()
        self._commands.put(("wake",))
        # A step ends in well under a second; writing the prefix cache to disk may take longer.
        self._parked.wait(timeout=60 if getattr(self.engine, "disk", None) is not None else 5)

    def wait_stopped(self) -> None:
        """Block until the step thread is parked (after `shutdown`): however long its last
        step or the prefix cache's write to disk takes."""
        self._parked.wait()

    @property
    def running(self) -> bool:
        return not self._parked.is_set()

    # -- engine thread -------------------------------------------------------
    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            route = self._routes.get(out.request_id)
        if route is not None:
            route.loop.call_soon_threadsafe(route.queue.put_nowait, (out.request_id, out))

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, salt, images, lora = cmd
            with self._lock:
                if rid not in self._routes:  # aborted before it started
                    return
            try:
                extra = {k: v for k, v in (("images", images), ("lora", lora)) if v is not None}
                self.engine.add_request(ids, params, rid, cache_salt=salt, **extra)
            except Exception as e:  # validated already; anything left is this request's
                log.exception("could not add request %s", rid)
                self._deliver(RequestOutput(rid, ids, "", [], "", [], True, "error", error=str(e)))
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
        elif kind == "call":
            _, fn, args, future = cmd
            if future.set_running_or_notify_cancel():
                try:
                    with DEVICE:
                        result = fn(*args)
                    future.set_result(result)
                except Exception as e:  # the caller's error, not the engine's
                    future.set_exception(e)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self.engine is not None and getattr(self.engine, "disk", None) is not None:
                try:  # the prefix cache to its disk tier, so it outlives this process or unload
                    with DEVICE:
                        self.engine.close()
                except Exception:
                    log.exception("closing the engine failed")
            # Never exit (see `_idle_hosts`): back to the idle hosts after an unload,
            # parked for good at shutdown.
            if self._leave:
                # Let go of the engine before the unload is told the loop is over: its
                # memory must be free when the unload hands the buffers back.
                self.engine = None
                self._parked.set()
                return
            self._parked.set()
            threading.Event().wait()

    def _loop(self) -> None:
        failures = 0
        while not self._stopped.is_set():
            try:
                self._iteration()
                failures = 0
            except Exception as e:
                failures += 1
                log.exception("engine loop failed (%d in a row)", failures)
                if failures >= self.max_failures:
                    self._die(f"the engine stopped after {failures} failed steps ({type(e).__name__}); "
                              "the server is exiting")
                    return

    def _die(self, reason: str) -> None:
        self.dead = reason
        log.critical("%s", reason)
        self.fail_all(reason)
        if self.on_dead is not None:
            self.on_dead(reason)

    def _iteration(self) -> None:
        block = not self.engine.has_unfinished_requests()
        try:
            cmd = self._commands.get(timeout=self.engine.idle_wait(0.5)) if block else self._commands.get_nowait()
            with maybe(self.engine.runner.profile, "requests"):  # (`macinfer bench profile --through-server`)
                self._apply(cmd)
                while True:
                    self._apply(self._commands.get_nowait())
        except queue.Empty:
            pass
        if not self.engine.has_unfinished_requests():
            self.engine.idle()  # over several ranks: a sync now and then finds a dead rank
            return
        with DEVICE:
            outs = self.engine.step()
        try:
            with maybe(self.engine.runner.profile, "delivery"):
                for out in outs:
                    self._deliver(out)
        except Exception:
            # A request the engine has finished gets no more steps: if its last output
            # cannot be delivered, answer it with an error rather than never.
            for out in outs:
                if out.finished:
                    self._fail(out.request_id, "internal error: the output could not be delivered")
            raise
