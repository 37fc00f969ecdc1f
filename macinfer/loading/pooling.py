"""Embedding use a model publishes, and the pooling it asks for.

A decoder model serves `/v1/embeddings` only when it says how: a
sentence-transformers layout (`modules.json` with a Pooling module, and a
Normalize module if the vectors are unit length) or llama.cpp's
`{arch}.pooling_type` in a GGUF. A model that says nothing is refused: a
pooling guessed for a chat model gives vectors that look fine and mean little.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

MODES = ("mean", "last", "cls")
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls"}
_GGUF_MODES = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum llama_pooling_type


@dataclass(frozen=True)
class Pooling:
    mode: str
    normalize: bool

    def __call__(self, hidden: mx.array) -> mx.array:
        """hidden [L, D] of one input -> [D]."""
        if self.mode == "mean":
            v = hidden.astype(mx.float32).mean(axis=0)
        else:
            v = hidden[-1 if self.mode == "last" else 0].astype(mx.float32)
        if self.normalize:
            v = v / mx.maximum(mx.linalg.norm(v), 1e-12)
        return v


def from_dir(path: str) -> Pooling | None:
    modules_path = os.path.join(path, "modules.json")
    if not os.path.exists(modules_path):
        return None
    with open(modules_path) as f:
        modules: list[dict[str, Any]] = json.load(f)
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return None
    with open(os.path.join(path, pooling.get("path", ""), "config.json")) as f:
        cfg = json.load(f)
    mode = next((m for key, m in _ST_MODES.items() if cfg.get(key)), None)
    if mode is None:
        raise ValueError(f"{path}: unsupported sentence-transformers pooling {cfg}")
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    return Pooling(mode, normalize)


def from_gguf(meta: dict[str, Any]) -> Pooling | None:
    value = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    mode = _GGUF_MODES.get(int(value)) if value is not None else None
    return Pooling(mode, True) if mode else None  # llama.cpp normalizes embeddings by default
