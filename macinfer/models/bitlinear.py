"""BitNet's ternary layers (mlx-lm's `BitLinear`) on every backend. mlx-lm computes them
with a Metal kernel only; here, where Metal is absent, the same product is formed from the
unpacked weights with plain MLX ops (`patch_bitlinear`), and the loader expands each layer
once to a float Linear on the CPU backend (`expand`), as it does quantized layers.

The packing (the kernel's): byte `w` of packed row r, column k holds output rows
r + i * (out / 4) for i = 0..3 in its bit pairs i, each value `((w >> 2i) & 3) - 1`;
the output is scaled by the layer's `weight_scale` (divided by it unless the checkpoint's
`linear_class` is "autobitlinear").
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def unpack(packed: mx.array, out_features: int) -> mx.array:
    """Ternary weights [out, in] (int8 in {-1, 0, 1}) from the packed [out / 4, in] bytes."""
    rows = [((packed >> (2 * i)) & 3).astype(mx.int8) - 1 for i in range(4)]
    return mx.concatenate(rows, axis=0)[:out_features]


def scale_of(layer: Any) -> mx.array:
    return 1.0 / layer.weight_scale if layer.invert_weight_scales else layer.weight_scale


def expand(layer: Any) -> nn.Linear:
    """A float32 Linear computing what `layer` computes (weights unpacked and scaled)."""
    w = unpack(layer.weight, layer.out_features).astype(mx.float32) * scale_of(layer).astype(mx.float32)
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    linear.weight = w
    if layer.bias is not None:
        linear.bias = layer.bias
    return linear


def is_bitlinear(module: Any) -> bool:
    return type(module).__name__ == "BitLinear" and "weight_scale" in module


def patch_bitlinear(mod: Any) -> None:
    """mlx-lm's BitLinear: its Metal kernel where Metal runs, the unpacked product elsewhere."""
    cls = getattr(mod, "BitLinear", None)
    if cls is None or getattr(cls, "_portable", False) or mx.metal.is_available():
        return

    def __call__(self, x: mx.array) -> mx.array:
        w = unpack(self.weight, self.out_features).astype(x.dtype)
        y = (x @ w.T) * scale_of(self).astype(x.dtype)
        return y if self.bias is None else y + self.bias

    cls.__call__ = __call__
    cls._portable = True
