"""mlx-lm's fused Metal kernels (`mlx_lm/kernels/`, Muse Spark's) in plain MLX ops, for every
backend without Metal: the same math in float32 with the same roundings to the model's dtype,
each checked against the kernel's own source run in the project's emulator
(`tests/test_portable_kernels.py`). `patch_kernels(module)` swaps them into a model module
that imported the Metal ones."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
from mlx import nn

F32 = mx.float32


def _rms(x: mx.array, eps: float) -> mx.array:
    """1 / sqrt(mean(x^2) + eps) over the last axis (x float32)."""
    return mx.rsqrt((x * x).sum(-1, keepdims=True) / x.shape[-1] + eps)


def _heads(qkvg: mx.array, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, query_scale: float):
    """The q and k heads (the first two parts of each row) normed in float32, rounded once,
    the q ones scaled and rounded again."""
    h = n_heads + n_kv_heads
    x = qkvg[..., : h * head_dim].astype(F32).reshape(*qkvg.shape[:-1], h, head_dim)
    y = (x * _rms(x, eps)).astype(qkvg.dtype)
    q = (y[..., :n_heads, :].astype(F32) * query_scale).astype(qkvg.dtype)
    return q, y[..., n_heads:, :]


def qk_norm(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
            query_scale: float) -> list[mx.array]:
    return list(_heads(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale))


def _rotate(x: mx.array, pos: mx.array, log2_base: float) -> mx.array:
    """Adjacent pairs rotated (mx.fast.rope's traditional form) at `pos` (x's leading shape
    but the heads), in float32 from x's rounded values, rounded once."""
    d = x.shape[-1]
    inv = mx.power(2.0, -(mx.arange(d // 2, dtype=F32) / (d // 2)) * log2_base)
    theta = pos.astype(F32)[..., None, None] * inv  # [..., 1 (heads), d / 2]
    c, s = mx.cos(theta), mx.sin(theta)
    xf = x.astype(F32)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = mx.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


def qk_norm_rope(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
                 query_scale: float, rope_base: float, offset: int | mx.array) -> list[mx.array]:
    q, k = _heads(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale)
    tokens = qkvg.shape[:-1]
    length = tokens[-1]
    steps = mx.arange(length, dtype=mx.int32)
    if isinstance(offset, mx.array) and offset.size > 1:  # one offset a batch row
        pos = offset.reshape(-1, 1).astype(mx.int32) + steps
    else:
        pos = (offset.reshape(-1)[0] if isinstance(offset, mx.array) else offset) + steps
    pos = mx.broadcast_to(pos, (math.prod(tokens) // length, length)).reshape(tokens)
    log2_base = math.log2(rope_base)  # (the kernel takes it as a float32 scalar; so does the product)
    return [_rotate(q, pos, log2_base), _rotate(k, pos, log2_base)]


def rms_norm_sigmoid_gate(x: mx.array, gate: mx.array, *, eps: float) -> mx.array:
    """rms_norm(x) * sigmoid(gate) a head, float32, one rounding: x (B, H, L, D), gate
    (B, L, H * D) -> (B, L, H * D)."""
    B, H, L, D = x.shape
    xf = x.astype(F32).transpose(0, 2, 1, 3)
    g = gate.astype(F32).reshape(B, L, H, D)
    return (xf * _rms(xf, eps) * mx.sigmoid(g)).astype(x.dtype).reshape(B, L, H * D)


def expert_routing(logits: mx.array, expert_bias: mx.array, *, top_k: int, multiplier: float, score_eps: float,
                   route_scale: float) -> list[mx.array]:
    """The top_k experts by sigmoid score + bias (best first), weights their scores
    normalised and scaled."""
    score = mx.sigmoid(logits.astype(F32) * multiplier)
    biased = score + expert_bias.astype(F32)
    # One expert at a time, as the kernel picks them: on a tie (saturated sigmoids tie
    # exactly) the lowest index, which argmax gives and a sort need not.
    picks = []
    for _ in range(top_k):
        best = mx.argmax(biased, axis=-1, keepdims=True)
        picks.append(best)
        biased = mx.put_along_axis(biased, best, mx.array(-mx.inf, F32), axis=-1)
    inds = mx.concatenate(picks, axis=-1)
    w = mx.take_along_axis(score, inds, axis=-1)
    return [inds.astype(mx.uint32), w / (w.sum(-1, keepdims=True) + score_eps) * route_scale]


def _pre(s: mx.array, weight: mx.array, eps: float, dtype: mx.Dtype) -> mx.array:
    return (s * _rms(s, eps) * weight.astype(F32)).astype(dtype)


def norm_add_norm(branch: mx.array, stream: mx.array, *, alpha: mx.array, beta: mx.array,
                  post_weight: mx.array | None, post_eps: float,
                  next_norm: nn.RMSNorm | None) -> tuple[mx.array, mx.array | None]:
    """The branch post-normed (its weight scaling it in the model's dtype first), added to
    the float32 stream with the gate weights; the sum pre-normed with next_norm."""
    dtype = branch.dtype
    v = branch.astype(F32)
    if post_weight is not None:
        v = (post_weight.astype(dtype).astype(F32) * v).astype(dtype).astype(F32)
    n = (v * _rms(v, post_eps)).astype(dtype).astype(F32)
    s = alpha.astype(F32) * stream.astype(F32) + beta.astype(F32) * n
    return s, None if next_norm is None else _pre(s, next_norm.weight, next_norm.eps, dtype)


def pre_norm(stream: mx.array, norm: nn.RMSNorm, *, dtype: mx.Dtype) -> mx.array:
    return _pre(stream.astype(F32), norm.weight, norm.eps, dtype)


def post_expert_norm_combine(experts: mx.array, weights: mx.array, *, norm_weight: mx.array,
                             eps: float) -> mx.array:
    """Each expert output normed with norm_weight as its input scale, the experts added
    with their weights in order, the sum rounded after each."""
    dtype = experts.dtype
    v = experts.astype(F32) * norm_weight.astype(F32)
    v = v * _rms(v, eps) * weights.astype(dtype).astype(F32)[..., None]
    acc = mx.zeros(v.shape[:-2] + v.shape[-1:], dtype=F32)
    for k in range(v.shape[-2]):
        acc = (acc + v[..., k, :]).astype(dtype).astype(F32)
    return acc.astype(dtype)


PORTABLE = {"qk_norm": qk_norm, "qk_norm_rope": qk_norm_rope, "rms_norm_sigmoid_gate": rms_norm_sigmoid_gate,
            "expert_routing": expert_routing, "norm_add_norm": norm_add_norm, "pre_norm": pre_norm,
            "post_expert_norm_combine": post_expert_norm_combine}


def patch_kernels(mod: Any) -> None:
    """A model module's imported mlx-lm kernels -> these, where Metal is absent."""
    if mx.metal.is_available():
        return
    for name, portable in PORTABLE.items():
        current = getattr(mod, name, None)
        if current is not None and getattr(current, "__module__", "").startswith("mlx_lm.kernels"):
            setattr(mod, name, portable)
