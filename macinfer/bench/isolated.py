"""A benchmark's comparison engine in a process of its own.

MLX's allocator settings and heap belong to a process: macinfer raises MLX's CPU
buffer cache (`engine/cache_plan.py`), and mlx-lm's `batch_generate` run in the
same process after macinfer's engine was built ran 10-20% slower than in a
process of its own (32 x 32-token prompts, 32 new tokens, this project's 2-core
runner: 115 tok/s alone, 90-105 beside macinfer). So the engine macinfer is
compared with runs as its users run it: its own process, MLX's defaults. The
runs still take turns with macinfer's, so a drift in the machine's speed hits
both alike.

The child speaks pickles over its stdin/stdout (its own prints go to stderr).
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import traceback
from typing import Any, Callable


class Isolated:
    """`target` ("module:Class") built with `args` in a child process; its methods
    are called through the proxy and their results pickled back."""

    def __init__(self, target: str, *args: Any, name: str | None = None):
        self.name = name or target.rsplit(":", 1)[-1]
        self._proc = subprocess.Popen([sys.executable, "-m", "macinfer.bench.isolated"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            self._call("__init__", target, *args)
        except Exception:
            self.close()  # (the child would otherwise wait on its stdin until this object is collected)
            raise

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            pickle.dump((method, args, kwargs), self._proc.stdin)
            self._proc.stdin.flush()
            ok, value = pickle.load(self._proc.stdout)
        except (BrokenPipeError, EOFError) as e:
            raise RuntimeError(f"{self.name}'s benchmark process ended (exit {self._proc.poll()})") from e
        if not ok:
            raise RuntimeError(f"{self.name}'s benchmark process: {value}")
        return value

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self._call(method, *args, **kwargs)

    def peak_rss_gb(self) -> float:
        """The child's own peak resident memory."""
        return self._call("__peak_rss_gb__")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)

    def __enter__(self) -> "Isolated":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _serve() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints and library chatter go to stderr, not into the pickles
    inp = sys.stdin.buffer
    obj = None
    while True:
        try:
            method, args, kwargs = pickle.load(inp)
        except EOFError:
            return
        try:
            if method == "__init__":
                module, cls = args[0].split(":")
                obj, value = getattr(importlib.import_module(module), cls)(*args[1:]), None
            elif method == "__peak_rss_gb__":
                from macinfer.bench.common import process_peak_rss_gb

                value = process_peak_rss_gb()
            else:
                value = getattr(obj, method)(*args, **kwargs)
            reply = (True, value)
        except Exception as e:  # sent back and raised in the parent
            reply = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        pickle.dump(reply, out)
        out.flush()


if __name__ == "__main__":
    _serve()
