"""Qwen3-VL's DeepStack: after each of the first k decoder layers, the image rows' hidden
states get that layer's visual features added (`AttentionMetadata.image_deepstack`, from the
encoder). Those layers' classes are swapped once, at load, for subclasses that add them; the
parameters and their names stay as they are. A step without images runs the layers as before."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.models.paged_layers import _active

_SUBCLASSES: dict[type, type] = {}


def _adding(cls: type) -> type:
    if cls not in _SUBCLASSES:
        def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            h = cls.__call__(self, x, *args, **kwargs)
            forward = _active()
            meta = forward.meta if forward is not None else None
            stack = getattr(meta, "image_deepstack", None)
            if stack is None or self._deepstack_index >= stack.shape[0]:
                return h
            rows = meta.image_rows  # h: [T, 1, hidden], one row per token
            return h.at[rows].add(stack[self._deepstack_index][:, None, :].astype(h.dtype))

        _SUBCLASSES[cls] = type(f"DeepStack{cls.__name__}", (cls,), {"__call__": __call__})
    return _SUBCLASSES[cls]


def install(layers: list[nn.Module], count: int) -> None:
    """The first `count` decoder layers add their DeepStack features."""
    if count > len(layers):
        raise ValueError(f"DeepStack feeds {count} layers; the model has {len(layers)}")
    for i, layer in enumerate(layers[:count]):
        object.__setattr__(layer, "_deepstack_index", i)
        layer.__class__ = _adding(type(layer))
