"""Image merges the engine runs itself, for families whose mlx-vlm merge departs from the
published model: LLaVA-NeXT's "anyres" packing (transformers' `pack_image_features`), which
Granite Vision shares (features of several tower layers side by side). The
vision tower and projector stay mlx-vlm's classes; only how their outputs become the
rows of an image's placeholders is written here."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import mlx.core as mx
import numpy as np


def _best_grid(size: tuple[int, int], pinpoints: list, tile: int) -> tuple[int, int]:
    """The (rows, columns) of tiles LLaVA-NeXT cuts an image of `size` (height, width) into."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution(list(size), pinpoints)
    return height // tile, width // tile


def _unpad(x: mx.array, size: tuple[int, int]) -> mx.array:
    """x [D, H, W] with the padding the processor added around an image of `size` cut away."""
    height, width = size
    cur_h, cur_w = x.shape[1:]
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        pad = (cur_h - new_h) // 2
        return x[:, pad: cur_h - pad, :]
    new_w = int(round(width * (cur_h / height), 7))
    pad = (cur_w - new_w) // 2
    return x[:, :, pad: cur_w - pad]


def llava_next(vlm: Any, pixels: dict[str, Any], pinpoints: list) -> mx.array:
    """One image's placeholder rows [n, hidden]: the whole-image tile's features, then the
    high-resolution tiles' features laid out as the picture, its padding cut away, with the
    model's newline embedding after each row. `pinpoints`: the checkpoint's tile layouts."""
    cfg = vlm.config
    size = tuple(int(v) for v in np.asarray(pixels["image_sizes"]).reshape(-1)[:2])
    tile = cfg.vision_config.image_size
    grid_h, grid_w = _best_grid(size, pinpoints, tile)
    values = mx.array(np.asarray(pixels["pixel_values"]))
    values = values.reshape(-1, *values.shape[-3:])[: 1 + grid_h * grid_w]  # the image's tiles, not the padding
    *_, hidden = vlm.vision_tower(values.transpose(0, 2, 3, 1), output_hidden_states=True)
    layers = cfg.vision_feature_layer
    feats = [hidden[i] for i in (layers if isinstance(layers, (list, tuple)) else [layers])]
    if cfg.vision_feature_select_strategy == "default":
        feats = [f[:, 1:] for f in feats]  # without the class token
    feats = vlm.multi_modal_projector(mx.concatenate(feats, axis=-1))  # [tiles, side * side, D]
    base, rest = feats[0], feats[1:]
    if rest.shape[0] == 0:
        return base
    side = tile // cfg.vision_config.patch_size
    d = rest.shape[-1]
    grid = rest.reshape(grid_h, grid_w, side, side, d).transpose(4, 0, 2, 1, 3).reshape(d, grid_h * side, grid_w * side)
    grid = _unpad(grid, size)
    newline = mx.broadcast_to(vlm.image_newline.astype(grid.dtype)[:, None, None], (d, grid.shape[1], 1))
    grid = mx.concatenate([grid, newline], axis=-1).reshape(d, -1).T
    return mx.concatenate([base, grid], axis=0)


Merge = Callable[[Any, dict[str, Any]], mx.array]  # (mlx-vlm's model, one image's encoder inputs) -> rows


def merge_for(config: dict[str, Any]) -> Merge | None:
    """The engine's own merge for this checkpoint's family, or None (mlx-vlm's is used)."""
    if config.get("model_type") in ("llava_next", "granite_vision"):
        pinpoints = config.get("image_grid_pinpoints")
        if not pinpoints:
            raise ValueError("its config names no image_grid_pinpoints")
        return partial(llava_next, pinpoints=pinpoints)
    return None
