"""Attention of a prompt chunk over its gathered (dense) context: MLX's fast SDPA, or, where
that is not a fused kernel (`AttentionMetadata.explicit_ops`: MLX's CPU backend), the same
attention written out in the ops that cost least there.

On the CPU a long prompt's time is the score matrix's elementwise work (max, exponentials;
each a single-threaded op over chunk x context scores), not its matmuls. So the written-out
causal form: splits each chunk into query tiles against only the keys they see, runs the tiles
on two CPU streams (MLX runs each stream on its own thread: two cores instead of one), masks only
the keys the chunk itself adds (the cached prefix before it is visible to every query), and
takes the softmax denominator from the PV matmul (a column of ones beside V) instead of a
separate reduction. SmolLM2-135M on 2 cores: an 8,000-token prompt 118 -> 83 s, 4,096 tokens
130 -> 175 tok/s (docs/benchmarks.md)."""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx

from macinfer.kernels.streams import work_streams

LOG2E = math.log2(math.e)
# Below this many scores a softmax's exponentials cost less than the ops `exp2_weights` adds.
EXP2_MIN_SCORES = 16384


def exp2_weights(scores: mx.array, sinks: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Unnormalised softmax weights and their sum over the last axis, for scores in
    log2 units (logits * log2 e, folded into the query scale): 2^(s - max).

    The same softmax as `mx.softmax` (to ~1e-6) with the division moved after the
    PV matmul, onto [.., d] rows instead of [.., keys]. Written with `mx.power(2, .)`
    because MLX's CPU `exp` costs ~15 ns an element against ~5 for `power` (measured
    on this project's machines; numpy's exp: 0.6): exponentials are most of the
    attention time on the CPU. `sinks` ([.., 1], log2 units): a logit per row that
    only joins the denominator."""
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = mx.maximum(top, sinks)
    weights = mx.power(2.0, scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + mx.power(2.0, sinks - top)
    return weights, total


@partial(mx.compile, shapeless=True)
def _pow2_from(scores: mx.array, top: mx.array) -> mx.array:
    """2^(scores - top) as one fused op (one pass over the scores instead of two); shapeless,
    so a new context length is not a new compilation."""
    return mx.power(2.0, scores - top)


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask, sinks: mx.array | None,
         softcap: float | None, explicit: bool = False) -> mx.array:
    """q [B, H, Lq, d], k/v [B, kvh, Lk, d]; `mask` None, "causal" (aligned to the end),
    a boolean [Lq, Lk] or [B, 1, Lq, Lk]. MLX's fused SDPA, or written out (`explicit`, for a backend
    where MLX's SDPA is not a fused kernel, so each op's cost is what it is; and for
    logit soft-capping, which the fused SDPA lacks): GQA by folding each KV head's
    query heads into the rows of one matmul, softmax by `exp2_weights`."""
    if softcap is None and not explicit and v.shape[-1] == q.shape[-1]:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    if isinstance(mask, str) and softcap is None and k.shape[2] >= q.shape[2]:
        return _causal(q, k, _with_ones(v), scale, sinks)
    B, H, Lq, d = q.shape
    kvh, Lk = k.shape[1], k.shape[2]
    g = H // kvh
    qscale = scale if softcap is not None else scale * LOG2E
    scores = (q * qscale).reshape(B, kvh, g * Lq, d) @ k.swapaxes(-1, -2)  # [B, kvh, g * Lq, Lk]
    scores = scores.reshape(B, kvh, g, Lq, Lk)
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * (softcap * LOG2E)
    if isinstance(mask, str):
        mask = mx.arange(Lk)[None, :] <= mx.arange(Lk - Lq, Lk)[:, None]
    if mask is not None:
        mask = mask[:, :, None] if mask.ndim == 4 else mask  # [B, 1, Lq, Lk] -> over the group axis too
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    sink = None if sinks is None else (sinks.astype(scores.dtype) * LOG2E).reshape(1, kvh, g, 1, 1)
    weights, total = exp2_weights(scores, sink)
    out = (weights.reshape(B, kvh, g * Lq, Lk) @ v) / total.reshape(B, kvh, g * Lq, 1)
    return out.reshape(B, H, Lq, v.shape[-1])  # V may be narrower than K (MLA)


def _with_ones(v: mx.array) -> mx.array:
    """V with a column of ones after its last: the PV matmul then also sums the weights."""
    return mx.concatenate([v, mx.ones((*v.shape[:3], 1), v.dtype)], axis=-1)


def _causal(q: mx.array, k: mx.array, vx: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
    """Causal attention of a chunk at the end of its context, written out: the keys before the
    chunk need no mask, so only the chunk's own [Lq, Lq] scores are masked; the softmax
    denominator comes out of the PV matmul as its last column (`vx`: V `_with_ones`)."""
    B, H, Lq, d = q.shape
    kvh, Lk = k.shape[1], k.shape[2]
    g, prefix = H // kvh, Lk - Lq
    qs = (q * (scale * LOG2E)).reshape(B, kvh, g * Lq, d)
    own = (qs @ k[:, :, prefix:].swapaxes(-1, -2)).reshape(B, kvh, g, Lq, Lq)
    seen = mx.arange(Lq)[None, :] <= mx.arange(Lq)[:, None]
    own = mx.where(seen, own, mx.array(-mx.inf, own.dtype)).reshape(B, kvh, g * Lq, Lq)
    top = own.max(axis=-1, keepdims=True)
    if prefix:
        before = qs @ k[:, :, :prefix].swapaxes(-1, -2)
        top = mx.maximum(top, before.max(axis=-1, keepdims=True))
    sink = None
    if sinks is not None:  # a logit per head that joins only the denominator
        sink = mx.repeat((sinks.astype(own.dtype) * LOG2E).reshape(1, kvh, g, 1), Lq, axis=3)
        top = mx.maximum(top, sink.reshape(1, kvh, g * Lq, 1))
    acc = _pow2_from(own, top) @ vx[:, :, prefix:]
    if prefix:
        acc = acc + _pow2_from(before, top) @ vx[:, :, :prefix]
    total = acc[..., -1:]
    if sink is not None:
        total = total + _pow2_from(sink.reshape(1, kvh, g * Lq, 1), top)
    return (acc[..., :-1] / total).reshape(B, H, Lq, vx.shape[-1] - 1)


def dense_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str,
                    explicit_ops: bool, tile: int | None, sinks: mx.array | None = None,
                    softcap: float | None = None) -> mx.array:
    """One chunk's queries [1, H, n, d] over its gathered context [1, kvh, c, d]: causal
    chunks in query tiles where SDPA is not a fused kernel (`explicit_ops`)."""
    if isinstance(mask, str) and explicit_ops and tile and q.shape[2] > tile:
        return _causal_tiles(q, k, v, scale, sinks, softcap, tile)
    return sdpa(q, k, v, scale, mask, sinks, softcap, explicit=explicit_ops)


def _causal_tiles(q: mx.array, k: mx.array, v: mx.array, scale: float, sinks: mx.array | None,
                  softcap: float | None, tile: int) -> mx.array:
    """Causal attention in query tiles, each against the keys up to its last query:
    what a fused kernel does by skipping fully masked tiles, for SDPA that computes
    every score and masks afterwards (MLX's fallback). A 1,024-token prompt does ~56%
    of the score and softmax work (128-token tiles); exact, since query rows are
    independent. On the CPU tiles alternate between two streams, so two run at once.
    q [1, H, Lq, d], k/v [1, kvh, Lk, d], the chunk at the end of k."""
    lq, lk = q.shape[2], k.shape[2]
    outs = []
    streams = work_streams()
    vx = _with_ones(v) if softcap is None else None  # once for every tile
    for i, start in enumerate(range(0, lq, tile)):
        end = min(start + tile, lq)
        keys = lk - lq + end  # "causal" aligns this tile's last query with the last key kept
        with mx.stream(streams[i % len(streams)]):
            if vx is not None:
                outs.append(_causal(q[:, :, start:end], k[:, :, :keys], vx[:, :, :keys], scale, sinks))
            else:
                outs.append(sdpa(q[:, :, start:end], k[:, :, :keys], v[:, :, :keys], scale, "causal", sinks,
                                 softcap, explicit=True))
    return mx.concatenate(outs, axis=2)
