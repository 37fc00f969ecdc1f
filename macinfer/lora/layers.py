"""Many adapters in one batch (Punica / S-LoRA style, in plain MLX ops): an adapted linear
layer holds every loaded adapter's factors stacked by slot (slot 0: the base, zeros), and
each row of the step's flat batch adds its own adapter's low-rank update: the batch times
every slot's A side by side, the other slots' columns masked out per row, times every
slot's B (two matmuls over the batch; MoE experts: gathered matmuls by slot and expert).
No fuse or unfuse per step, no batch per adapter; a step whose rows are all the base's runs
the base layer alone."""

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


def plain(layer: nn.Module) -> nn.Module:
    """The layer a step with no adapter rows may take a shortcut through (a kernel that reads
    its weights itself): an adapted layer's base then; an adapted layer as it is otherwise."""
    return layer.base if isinstance(layer, BatchedLoRA) and current() is None else layer


_MASKS: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}


def _slot_mask(slots: mx.array, num_slots: int, rank: int, dtype: mx.Dtype) -> mx.array:
    """[T, S * R]: 1 where a column of the stacked factors is the row's own slot's. Built once
    a step per (slots, rank): every layer of that rank shares it."""
    hit = _MASKS.get((num_slots, rank))
    if hit is None or hit[0] is not slots:
        cols = mx.arange(num_slots * rank, dtype=slots.dtype) // rank
        hit = _MASKS[num_slots, rank] = (slots, (slots[:, None] == cols[None, :]).astype(dtype))
    return hit[1]


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

    def _stacked(self) -> tuple[mx.array, mx.array]:
        """a ([S, in, R]) as [in, S * R] and b ([S, R, out]) as [S * R, out], made once a load."""
        cached = getattr(self, "_mi_stacked", None)
        if cached is None or cached[0] is not self.a or cached[1] is not self.b:
            S, D, R = self.a.shape
            cached = (self.a, self.b, self.a.transpose(1, 0, 2).reshape(D, S * R), self.b.reshape(S * R, -1))
            object.__setattr__(self, "_mi_stacked", cached)  # (not a parameter: not counted, not saved)
        return cached[2], cached[3]

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        slots = current()
        if slots is None or self.a is None:
            return y
        shape = x.shape
        flat = x if x.ndim == 2 else x.reshape(-1, shape[-1])
        if flat.shape[0] != slots.shape[0]:
            raise RuntimeError(f"an adapted layer saw {flat.shape[0]} rows for a step of {slots.shape[0]}")
        a, b = self._stacked()
        if flat.dtype != a.dtype:
            flat = flat.astype(a.dtype)
        # Every slot's factors side by side, the columns of the rows' other slots masked out:
        # two matmuls over the batch, the second adding onto the base's output (`addmm`).
        # On the CPU, 8 adapters: 0.89x of the base end to end, against 0.82x for one
        # gathered matmul a row and factor (docs/lora.md).
        h = (flat @ a) * _slot_mask(slots, self.a.shape[0], self.a.shape[2], a.dtype)
        yf = y if y.ndim == 2 else y.reshape(-1, y.shape[-1])
        if yf.dtype == h.dtype:
            out = mx.addmm(yf, h, b)
        else:
            z = h @ b
            out = yf + (z if z.dtype == y.dtype else z.astype(y.dtype))
        out = out if out.shape == y.shape else out.reshape(y.shape)
        if self.g is not None:
            g = self.g[slots].reshape(*shape[:-1], -1).astype(y.dtype)
            bias = self.base.get("bias") if isinstance(self.base, nn.Module) else None
            out = g * out if bias is None else g * out + (1 - g) * bias
        return out


class BatchedSwitchLoRA(nn.Module):
    """An MoE's experts (mlx-lm's SwitchLinear) with per-expert adapters per row: while a step
    has adapter rows, the experts' parent hands every child the row's expert ids offset by
    slot * experts (`slot_experts`), so a row of slot s reads expert e's factors at s*E + e
    ([S*E, in, R], [S*E, R, out]) and the base its expert e. Every expert layer of an adapted
    parent is one of these (zeros where its adapters do not reach)."""

    def __init__(self, base: nn.Module, experts: int):
        super().__init__()
        self.base, self.experts = base, experts
        self.a: mx.array | None = None
        self.b: mx.array | None = None

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if current() is None:
            return self.base(x, indices, sorted_indices=sorted_indices)
        # (sorted by slot and expert, the expert ids alone are not in order)
        y = self.base(x, indices % self.experts, sorted_indices=False)
        if self.a is None:
            return y
        z = mx.gather_mm(x.astype(self.a.dtype), self.a, rhs_indices=indices, sorted_indices=sorted_indices)
        z = mx.gather_mm(z, self.b, rhs_indices=indices, sorted_indices=sorted_indices)
        return y + z.astype(y.dtype)


def slot_experts(parent: nn.Module, experts: int) -> None:
    """Make an MoE's expert block (mlx-lm's SwitchGLU / SwitchMLP: `__call__(x, indices)`)
    offset each row's expert ids by its adapter slot * `experts` while a step has adapter
    rows (its own sort then groups rows by slot and expert)."""
    cls = type(parent)
    if getattr(cls, "_slot_experts", False):
        return

    class WithSlots(cls):  # type: ignore[misc, valid-type]
        _slot_experts = True

        def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
            slots = current()
            if slots is None:
                return super().__call__(x, indices)
            if indices.shape[0] != slots.shape[0]:
                raise RuntimeError(f"an adapted expert block saw {indices.shape[0]} rows for a step of "
                                   f"{slots.shape[0]}")
            offset = (slots * experts).astype(indices.dtype).reshape(-1, *([1] * (indices.ndim - 1)))
            return super().__call__(x, indices + offset)

    WithSlots.__name__ = cls.__name__
    parent.__class__ = WithSlots


def unslot_experts(parent: nn.Module) -> None:
    if getattr(type(parent), "_slot_experts", False):
        parent.__class__ = type(parent).__mro__[1]


def experts(module: nn.Module) -> int | None:
    """The expert count of an MoE expert layer (mlx-lm's SwitchLinear, quantized or not)."""
    weight = getattr(module, "weight", None)
    return weight.shape[0] if type(module).__name__ in ("SwitchLinear", "QuantizedSwitchLinear") else None


def dims(module: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of a linear layer, plain or quantized, or of one expert of an
    MoE expert layer; None for another kind."""
    if type(module).__name__ == "QuantizedSwitchLinear":
        return module.scales.shape[-1] * module.group_size, module.weight.shape[1]
    if type(module).__name__ == "SwitchLinear":
        return module.weight.shape[2], module.weight.shape[1]
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
