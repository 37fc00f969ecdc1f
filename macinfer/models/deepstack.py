"""DeepStack: after some decoder layers, the image rows' hidden states get visual features
added (`AttentionMetadata.image_deepstack`, from the encoder: entry k after layer `after[k]`).
Qwen3-VL adds after each of its first layers; Granite 4 Vision before the layers its config
maps (after the one before: the same hidden states). Those layers' classes are swapped once,
at load, for subclasses that add them; the parameters and their names stay as they are. A step without images runs the layers as before."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv.attention import AttentionMetadata
from macinfer.models.paged_layers import _active

_SUBCLASSES: dict[type, type] = {}


def _adding(cls: type) -> type:
    if cls not in _SUBCLASSES:
        def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            h = cls.__call__(self, x, *args, **kwargs)
            # The step's metadata: the engine's own graph passes it, mlx-lm's classes run under it
            meta = next((a for a in args if isinstance(a, AttentionMetadata)), None)
            if meta is None:
                forward = _active()
                meta = forward.meta if forward is not None else None
            stack = getattr(meta, "image_deepstack", None)
            if stack is None or self._deepstack_index >= stack.shape[0]:
                return h
            add = stack[self._deepstack_index].astype(h.dtype)  # h: [T, hidden] or [T, 1, hidden]
            return h.at[meta.image_rows].add(add if h.ndim == 2 else add[:, None, :])

        _SUBCLASSES[cls] = type(f"DeepStack{cls.__name__}", (cls,), {"__call__": __call__})
    return _SUBCLASSES[cls]


def install(layers: list[nn.Module], after: tuple[int, ...]) -> None:
    """Decoder layer `after[k]` adds the image rows' DeepStack entry k."""
    if len(set(after)) != len(after) or any(not 0 <= i < len(layers) for i in after):
        raise ValueError(f"DeepStack adds after layers {list(after)}; the model has {len(layers)}")
    for k, i in enumerate(after):
        object.__setattr__(layers[i], "_deepstack_index", k)
        layers[i].__class__ = _adding(type(layers[i]))
