"""Multimodal RoPE (Qwen2-VL's): each rotary frequency turns by one of three positions
(time, height, width), chosen by the config's `mrope_section` (HunyuanOCR's XD-RoPE: one of
four, sequence, width, height, image). Text tokens have the same
position on all three, so a text-only step is plain RoPE: at the rows' own positions, or at
`AttentionMetadata.rope_offsets` for rows after an image (shifted by its `rope_delta`: a
decode). A step with an image's rows carries the three position rows in
`AttentionMetadata.rope_positions` and this stand-in rotates by them.
It replaces each attention layer's `rope` module once, at load."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.models.paged_layers import _active


def section_axes(section: list[int], half: int, style: str) -> mx.array:
    """Which of the positions each of the `half` frequencies turns by: "chunked"
    (Qwen2/2.5-VL: the first section[0] from time, the next section[1] from height, the
    rest from width; as many axes as sections) or "interleaved" (Qwen3-VL, Qwen3.5: t, h, w, t, h, w, ... while each
    axis has frequencies left in its section, then time)."""
    if sum(section) != half or style not in ("chunked", "interleaved"):
        raise ValueError(f"multimodal RoPE {style!r} with sections {section} over {half} frequencies is not supported")
    if style == "chunked":
        axes = [axis for axis, n in enumerate(section) for _ in range(n)]
    else:
        axes = [i % 3 if i % 3 and i < 3 * section[i % 3] else 0 for i in range(half)]
    return mx.array(axes, dtype=mx.int32)


class MRoPE(nn.Module):
    """Stands in for an attention layer's `nn.RoPE`, rotating the pairs that module does:
    (i, i + D/2), or (2i, 2i + 1) where it is traditional (GLM-4V's even/odd sections)."""

    def __init__(self, rope: nn.Module, section: list[int], style: str = "chunked"):
        super().__init__()
        freqs = getattr(rope, "_freqs", None)  # (a module given its frequencies: Hunyuan's NTK-alpha RoPE)
        if not hasattr(rope, "dims") or (freqs is None and not hasattr(rope, "base")) \
                or getattr(rope, "scale", 1.0) != 1.0:
            raise ValueError("multimodal RoPE over this model's rotary module is not supported")
        self._rope = rope
        self._traditional = bool(getattr(rope, "traditional", False))
        dims = rope.dims
        self._half = dims // 2
        self._axes = section_axes(section, self._half, style)
        self._inv_freq = 1.0 / freqs.astype(mx.float32) if freqs is not None else \
            rope.base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        # Now, in the loading thread: left lazy, they would be computed in the engine's
        # thread against this thread's stream (MLX refuses that).
        mx.eval(self._axes, self._inv_freq)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        forward = _active()  # (mlx-lm's classes: the step's metadata is the active forward's)
        return self.turn(x, forward.meta if forward is not None else None, offset)

    def turn(self, x: mx.array, meta: Any, offset: Any = 0) -> mx.array:
        """x [T, H, 1, D] (a row a token) turned by the step's metadata `meta`'s positions."""
        positions = getattr(meta, "rope_positions", None)
        if positions is None:  # text only: plain RoPE at the rows' positions (shifted past images)
            shifted = getattr(meta, "rope_offsets", None)
            return self._rope(x, offset=offset if shifted is None else shifted)
        # x: [T, H, 1, D] (one row per token); positions [axes, T]
        angles = positions[self._axes].T.astype(mx.float32) * self._inv_freq  # [T, D/2]
        cos, sin = mx.cos(angles)[:, None, None, :], mx.sin(angles)[:, None, None, :]
        h = self._half
        if self._traditional:
            x1, x2 = x[..., 0: 2 * h: 2].astype(mx.float32), x[..., 1: 2 * h: 2].astype(mx.float32)
            pairs = mx.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
            rotated = pairs.reshape(*x.shape[:-1], 2 * h).astype(x.dtype)
        else:
            x1, x2 = x[..., :h].astype(mx.float32), x[..., h: 2 * h].astype(mx.float32)
            rotated = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
        return rotated if x.shape[-1] == 2 * h else mx.concatenate([rotated, x[..., 2 * h:]], axis=-1)


def install(layers: list[nn.Module], section: list[int], style: str = "chunked") -> int:
    """Each decoder layer's attention `rope` replaced by an `MRoPE` over it; how many."""
    n = 0
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        rope = getattr(attn, "rope", None)
        if rope is None or isinstance(rope, MRoPE):
            continue
        attn.rope = MRoPE(rope, section, style)
        n += 1
    return n
