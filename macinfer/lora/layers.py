"""Many adapters in one batch (Punica / S-LoRA style, in plain MLX ops): an adapted linear
layer holds every loaded adapter's factors stacked by slot (slot 0: the base, zeros), and
each row of the step's flat batch adds its own adapter's low-rank update, two gathered
matmuls over the batch. No fuse or unfuse per step, no batch per adapter; a step whose rows
are all the base's runs the base layer alone."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

_local = threading.local()


@contextmanager
def rows(slots: mx.array | None) -> Iterator[None]:
    """Each row's adapter slot [T] for the forward built inside (None: every row the base's)."""
    prev = getattr(_local, "slots", None)
    _local.slots = slots
    try:
        yield
    finally:
        _local.slots = prev


def current() -> mx.array | None:
    return getattr(_local, "slots", None)


class BatchedLoRA(nn.Module):
    """`base` (a Linear, quantized or not) plus each row's adapter update: for slot s,
    x @ a[s] @ b[s] ([S, in, R] and [S, R, out]; a module's adapters padded to its largest
    rank with zeros), and for DoRA, the output rescaled by g[s] = magnitude / column norm of
    the adapted weight (1 for plain LoRA and the base)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.a: mx.array | None = None
        self.b: mx.array | None = None
        self.g: mx.array | None = None  # [S, out] DoRA's rescale, or None when no adapter is DoRA

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        slots = current()
        if slots is None or self.a is None:
            return y
        shape = x.shape
        flat = x.reshape(-1, 1, shape[-1])
        if flat.shape[0] != slots.shape[0]:
            raise RuntimeError(f"an adapted layer saw {flat.shape[0]} rows for a step of {slots.shape[0]}")
        z = mx.gather_mm(mx.gather_mm(flat.astype(self.a.dtype), self.a, rhs_indices=slots), self.b,
                         rhs_indices=slots)
        out = y + z.reshape(*shape[:-1], -1).astype(y.dtype)
        if self.g is not None:
            g = self.g[slots].reshape(*shape[:-1], -1).astype(y.dtype)
            bias = self.base.get("bias") if isinstance(self.base, nn.Module) else None
            out = g * out if bias is None else g * out + (1 - g) * bias
        return out


def dims(module: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of a linear layer, plain or quantized; None for another kind."""
    if isinstance(module, nn.QuantizedLinear):
        return module.scales.shape[-1] * module.group_size, module.weight.shape[0]
    if isinstance(module, nn.Linear):
        return module.weight.shape[1], module.weight.shape[0]
    return None


def dense_weight(module: nn.Module) -> mx.array:
    """The layer's weight [out, in] in float32 (dequantized): DoRA's column norms need it."""
    if isinstance(module, nn.QuantizedLinear):
        return mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                             bits=module.bits, mode=getattr(module, "mode", "affine")).astype(mx.float32)
    return module.weight.astype(mx.float32)
