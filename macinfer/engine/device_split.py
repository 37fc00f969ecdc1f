"""Where the device time of a forward goes: attention, matmuls, the rest
(`macinfer bench profile`). MLX runs a step as one lazy graph, so the split needs
barriers: while a `DeviceSplit` is active, every attention call (`kv.attention.attend`,
the paged cache's reads and this step's K/V writes with it) and every Linear, quantized
Linear and tied LM head is evaluated on its own, timed, and what was pending before it
(norms, RoPE, activations, gathers, embeddings) is timed as "rest". The barriers cost
time of their own (the total is reported beside the plain device time), and a tie
between lazy work and its barrier may shift a little work between the rows: a profile,
not an exact account. Off unless asked for: one `is None` check per attention call."""

from __future__ import annotations

import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv import attention

KINDS = ("attention", "matmul", "rest")


class DeviceSplit:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self._patched: list[tuple[Any, str, Any]] = []

    def timed(self, kind: str, run: Callable[[], mx.array], *inputs: mx.array) -> mx.array:
        start = time.perf_counter()
        mx.eval(*inputs)  # everything pending before this op
        mid = time.perf_counter()
        self.seconds["rest"] += mid - start
        out = run()
        mx.eval(out)
        self.seconds[kind] += time.perf_counter() - mid
        return out

    def finish(self, *outputs: mx.array) -> None:
        """The end of a forward: what is still pending is rest (the sampler is not counted)."""
        start = time.perf_counter()
        mx.eval(*outputs)
        self.seconds["rest"] += time.perf_counter() - start

    def __enter__(self) -> "DeviceSplit":
        split = self

        def wrap(cls: Any, name: str) -> None:
            original = getattr(cls, name)

            def call(module, x, *a, **kw):
                return split.timed("matmul", lambda: original(module, x, *a, **kw), x)

            self._patched.append((cls, name, original))
            setattr(cls, name, call)

        wrap(nn.Linear, "__call__")
        wrap(nn.QuantizedLinear, "__call__")
        wrap(nn.Embedding, "as_linear")
        wrap(nn.QuantizedEmbedding, "as_linear")
        attention.SPLIT = self
        return self

    def __exit__(self, *exc: Any) -> None:
        attention.SPLIT = None
        for cls, name, original in reversed(self._patched):
            setattr(cls, name, original)
        self._patched.clear()

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {k: 1e3 * v / max(steps, 1) for k, v in self.seconds.items()}
