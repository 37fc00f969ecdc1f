"""The process group a distributed engine runs in, and the few collectives it needs.

Everything goes over `mx.distributed` (whatever backend `mlx.launch` set up: `ring` over
TCP or Thunderbolt, `jaccl` RDMA): Python objects travel as pickled bytes in a uint8 array
summed over the group, where every rank but the sender adds zeros. A collective that
fails (a rank died: the ring backend reports the lost peer) or does not finish within
`timeout` (a rank hangs) ends this process with a clear error instead of a silent hang.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

log = logging.getLogger("macinfer")

MODES = ("pipeline", "tensor")
DEFAULT_TIMEOUT = 60.0  # seconds a collective may take before the group is declared hung
LAUNCHER_POLL = 0.5  # seconds between looks at whether this rank's launcher still runs
WORKER_GRACE = 30.0  # seconds a worker waits for rank 0 to close once the launcher is gone


class DistributedError(RuntimeError):
    pass


@dataclass
class DistContext:
    mode: str  # "pipeline" | "tensor"
    group: Any  # mx.distributed.Group
    timeout: float = DEFAULT_TIMEOUT
    _watch: list = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler, the tokenizer and the HTTP server."""
        return self.rank == 0

    def describe(self) -> str:
        return f"{self.mode} parallel, rank {self.rank} of {self.size}"

    # -- collectives ---------------------------------------------------------
    def _guard(self, what: str, fn):
        """Run one collective under the watchdog: a lost peer or a hang ends the process."""
        self._watch.append((time.monotonic(), what))
        try:
            return fn()
        except RuntimeError as e:
            fatal(f"distributed {what} failed on rank {self.rank}: {e} (a rank died or lost its connection)")
        finally:
            self._watch.pop()

    def broadcast(self, obj: Any = None, what: str = "broadcast") -> Any:
        """Rank 0's `obj` on every rank: its length, then its bytes, sent to each rank
        (point-to-point: ~0.2 ms on loopback where a small all_sum takes ~5)."""
        def run():
            if self.is_driver:
                data = pickle.dumps(obj)
                header, body = mx.array([len(data)], dtype=mx.int32), mx.array(bytearray(data), dtype=mx.uint8)
                for r in range(1, self.size):
                    mx.eval(mx.distributed.send(header, r, group=self.group))
                    mx.eval(mx.distributed.send(body, r, group=self.group))
                return obj
            header = mx.distributed.recv((1,), mx.int32, 0, group=self.group)
            mx.eval(header)
            body = mx.distributed.recv((int(header.item()),), mx.uint8, 0, group=self.group)
            mx.eval(body)
            return pickle.loads(bytes(memoryview(body)))
        return self._guard(what, run)

    def ack(self, what: str = "heartbeat") -> None:
        """Every worker answers the driver: a round trip, so a rank that hangs is noticed
        (a send alone would sit in its socket buffer)."""
        def run():
            if self.is_driver:
                for r in range(1, self.size):
                    mx.eval(mx.distributed.recv((1,), mx.int32, r, group=self.group))
            else:
                mx.eval(mx.distributed.send(mx.array([self.rank], dtype=mx.int32), 0, group=self.group))
        self._guard(what, run)

    def gather(self, value: Any, what: str = "gather") -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        def run():
            out = []
            for r in range(self.size):
                data = pickle.dumps(value) if r == self.rank else b""
                n = mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=self.group)
                mx.eval(n)
                buf = mx.array(bytearray(data)) if r == self.rank else mx.zeros((int(n.item()),), dtype=mx.uint8)
                got = mx.distributed.all_sum(buf, group=self.group)
                mx.eval(got)
                out.append(pickle.loads(bytes(memoryview(got))))
            return out
        return self._guard(what, run)

    def start_watchdog(self) -> None:
        """A thread that ends the process when a collective runs past `timeout`."""
        def watch():
            while True:
                time.sleep(min(1.0, self.timeout / 4))
                if self._watch:
                    started, what = self._watch[-1]
                    if time.monotonic() - started > self.timeout:
                        fatal(f"distributed {what} on rank {self.rank} did not finish in {self.timeout:.0f} s "
                              "(a rank hangs or the network is down)")
        threading.Thread(target=watch, name="macinfer-dist-watchdog", daemon=True).start()

    @contextmanager
    def watch(self, what: str):
        """`what` (a forward pass with collectives inside) runs under the watchdog; any
        failure in it is fatal, since the ranks could no longer be in step."""
        self._watch.append((time.monotonic(), what))
        try:
            yield
        except Exception as e:  # noqa: BLE001
            fatal(f"distributed {what} failed on rank {self.rank}: {type(e).__name__}: {e}")
        finally:
            self._watch.pop()


def fatal(message: str) -> None:
    """Log and end this process now: mlx.launch then ends the other ranks."""
    log.critical("%s", message)
    print(f"macinfer: error: {message}", flush=True)
    os._exit(70)


def init(mode: str, timeout: float = DEFAULT_TIMEOUT) -> DistContext:
    """This process's group (started by `mlx.launch`)."""
    if mode not in MODES:
        raise ValueError(f"--distributed {mode!r}: expected one of {', '.join(MODES)}")
    if not mx.distributed.is_available():
        raise DistributedError("--distributed: this MLX build has no distributed backend")
    group = mx.distributed.init()
    if group.size() < 2:
        raise DistributedError(
            f"--distributed {mode}: this process is alone (group of 1). Start every rank with mlx.launch, e.g. "
            f"mlx.launch -n 2 --backend ring --python $(which python) $(which macinfer) serve MODEL "
            f"--distributed {mode}")
    ctx = DistContext(mode, group, timeout)
    ctx.start_watchdog()
    watch_launcher(ctx)
    return ctx


def watch_launcher(ctx: DistContext, poll: float = LAUNCHER_POLL) -> None:
    """Every rank ends when the process that started it (`mlx.launch`, or ssh's session for a
    remote rank) ends, whatever signal that one got: a supervisor's SIGTERM reaches the
    launcher alone. Noticed by the parent changing (a look every `poll` seconds: the same on
    Linux and macOS, and unlike a parent-death signal blind to which thread started us).
    Rank 0 then shuts down as a single process does on SIGTERM (stops accepting, finishes or
    ends its requests, lets the workers return); a worker waits for that, and exits by
    itself after `WORKER_GRACE` seconds if it never comes. A rank started by init (ppid 1)
    has no launcher to follow."""
    parent = os.getppid()
    if parent <= 1:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        log.warning("rank %d: its launcher (pid %d) ended; shutting down", ctx.rank, parent)
        if ctx.is_driver:
            os.kill(os.getpid(), signal.SIGTERM)  # (the server's handler: a graceful shutdown)
        else:
            time.sleep(WORKER_GRACE)
            fatal(f"rank {ctx.rank}: its launcher ended and rank 0 did not close within {WORKER_GRACE:.0f} s")

    threading.Thread(target=watch, name="macinfer-launcher-watch", daemon=True).start()
