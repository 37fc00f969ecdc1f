"""Image merges the engine runs itself, for families whose mlx-vlm merge departs from the
published model: LLaVA-NeXT's "anyres" packing (transformers' `pack_image_features`), which
Granite Vision shares (features of several tower layers side by side); Granite 4 Vision's
features for several decoder layers (mlx-vlm's merge, its rows taken per layer). The
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


def granite4_targets(config: dict[str, Any]) -> list[int]:
    """The decoder layer each of Granite 4 Vision's projectors feeds (before it), in mlx-vlm's
    order of its features: the DeepStack layer map's, then the spatial projectors'."""
    layers = [int(llm) for _, llm in config.get("deepstack_layer_map") or []]
    if config.get("use_spatial_sampling", True):
        layers += [int(llm) for llm in config.get("spatial_target_layers") or []]
    return layers


def granite4_vision(vlm: Any, pixels: dict[str, Any], targets: list[int], scale: float) -> mx.array:
    """One image's rows [1 + layers, n, hidden]: its input rows, then what is added before each
    later layer its projectors target (in layer order; `families.deepstack_layers`). mlx-vlm's
    merge (anyres packing, as transformers') zeroes the image's input rows and adds each
    projector's features before its layer; the engine's model multiplies given rows by the
    embedding multiplier (`scale`), so the first layer's features go in divided by it."""
    ids = mx.array(np.asarray(pixels["input_ids"], dtype=np.int32))[None]
    out = vlm.get_input_embeddings(ids, mx.array(np.asarray(pixels["pixel_values"])),
                                   image_sizes=np.asarray(pixels["image_sizes"]))
    rows = mx.array(np.nonzero(np.asarray(out.visual_pos_masks).reshape(-1))[0].astype(np.int32))
    feats = out.deepstack_visual_embeds[:, rows]  # [projectors, n, hidden]
    by_layer = {layer: sum(feats[k] for k, t in enumerate(targets) if t == layer) for layer in sorted(set(targets))}
    first = by_layer.pop(0) / scale if 0 in by_layer else mx.zeros(feats.shape[1:], dtype=feats.dtype)
    return mx.stack([first, *by_layer.values()])


Merge = Callable[[Any, dict[str, Any]], mx.array]  # (mlx-vlm's model, one image's encoder inputs) -> rows


def merge_for(config: dict[str, Any]) -> Merge | None:
    """The engine's own merge for this checkpoint's family, or None (mlx-vlm's is used)."""
    if config.get("model_type") in ("llava_next", "granite_vision"):
        pinpoints = config.get("image_grid_pinpoints")
        if not pinpoints:
            raise ValueError("its config names no image_grid_pinpoints")
        return partial(llava_next, pinpoints=pinpoints)
    if config.get("model_type") == "granite4_vision":
        targets = granite4_targets(config)
        if not targets:
            raise ValueError("its config maps no projector to a decoder layer (deepstack_layer_map)")
        text = config.get("text_config") or {}
        return partial(granite4_vision, targets=targets, scale=float(text.get("embedding_multiplier", 1.0)))
    return None
