"""The reference decode attention: each row's queries against the paged pool in place, one
matmul per (block, KV head) matrix the row's block table names (`mx.gather_mm`, or
`mx.gather_qmm` over a quantized pool's packed blocks), no copy of the context. Plain
arrays in and out (no step metadata): the engine's decode path, the Metal kernel's
self-check and the emulator tests all call it."""

from __future__ import annotations

import mlx.core as mx

from macinfer.kv.cache import QuantizedBlocks
from macinfer.kv.dense import EXP2_MIN_SCORES, LOG2E, exp2_weights


def block_heads(block_tables: mx.array, num_kv_heads: int) -> mx.array:
    """[B, nb, kvh]: the index of each (block, KV head) matrix in a pool viewed as
    [num_blocks * kvh, bs, d]."""
    return block_tables[:, :, None] * num_kv_heads + mx.arange(num_kv_heads, dtype=block_tables.dtype)


def decode_mask(context_lens: mx.array, length: int, floors: mx.array | None = None, start: int = 0,
                keep: mx.array | None = None) -> mx.array:
    """[B, length]: the keys each decode row attends to: its context, from its floor
    (a sliding window's or a local chunk's first key) when it has one, and the keys below
    `keep` whatever the floor (a prompt read whole: `PromptAndWindow`); none below `start`
    (keys held apart: `FirstTokens`)."""
    pos = mx.arange(length)[None, :]
    mask = pos < context_lens[:, None]
    if floors is not None:
        above = pos >= floors[:, None]
        mask = mask & (above if keep is None else above | (pos < keep[:, None]))
    if start:
        mask = mask & (pos >= start)
    return mask


def reference_decode_attention(
    q: mx.array, k_blocks: mx.array, v_blocks: mx.array, heads: mx.array, mask: mx.array, scale: float,
    sinks: mx.array | None = None, softcap: float | None = None, rot: tuple[mx.array, mx.array] | None = None,
    lead: tuple[mx.array, mx.array] | None = None, lead_blocks: tuple[mx.array, mx.array] | None = None,
) -> mx.array:
    """q [B, H, d] against the paged cache in place: k/v_blocks [num_blocks, kvh, bs, d],
    `heads` from `block_heads` ([B, nb, kvh]), `mask` from `decode_mask` ([B, nb * bs]).
    Or several queries per row sharing its table: q [B, Q, H, d], mask [B, Q, nb * bs]
    (a speculating sequence's token and drafts, each with its own context length).
    `rot`: the pool's K and V rotations (its rows were stored turned: the queries turn
    alike, the output turns back). `lead`: (heads, mask) of more keys, in `lead_blocks`
    (the first tokens kept apart at full precision), joining the same softmax.

    Queries are grouped per KV head, and each group is multiplied with the
    (block, head) matrices its table names (`mx.gather_mm`): K/V are read once,
    where they lie, with no copy of the context (a gather of every block per layer
    per step tripled the KV memory traffic) and no copy per query head. Measured
    on the CPU at 16 sequences x 1k context, SmolLM2 shapes: ~7.5 ms per layer
    against ~20 ms for gather + matmul."""
    single = q.ndim == 3
    if single:
        q, mask = q[:, None], mask[:, None]
        lead = None if lead is None else (lead[0], lead[1][:, None])
    B, Q, H, d = q.shape
    kvh = heads.shape[2]
    g = H // kvh
    rows = Q * g  # the rows of one matmul per (block, head): every query of the group
    # (keys, values, heads, mask, rotation) of each part of the context, in key order
    parts = ([] if lead is None else [(*lead_blocks, *lead, None)]) + [(k_blocks, v_blocks, heads, mask, rot)]
    widths = [p[2].shape[1] * (p[0].tokens if isinstance(p[0], QuantizedBlocks) else p[0].shape[2])
              for p in parts]
    exp2 = B * Q * H * sum(widths) >= EXP2_MIN_SCORES
    units = LOG2E if exp2 else 1.0  # exp2_weights takes scores in log2 units
    qscale = scale if softcap is not None else scale * units
    qg = (q * qscale).reshape(B, Q, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(B, 1, kvh, rows, d)
    scores = [_block_matmul(qg if r is None else qg @ r[0], kb, h, keys=True)  # [B, nb, kvh, rows, bs]
              .transpose(0, 2, 3, 1, 4).reshape(B, kvh, Q, g, w) for (kb, _, h, _, r), w in zip(parts, widths)]
    scores = scores[0] if len(parts) == 1 else mx.concatenate(scores, axis=-1)
    mask = parts[0][3] if len(parts) == 1 else mx.concatenate([p[3] for p in parts], axis=-1)
    width = sum(widths)
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * (softcap * units)
    scores = mx.where(mask[:, None, :, None, :], scores, mx.array(-mx.inf, scores.dtype))
    total = None
    if exp2:
        sink = None if sinks is None else (sinks.astype(scores.dtype) * LOG2E).reshape(1, kvh, 1, g, 1)
        probs, total = exp2_weights(scores, sink)
    elif sinks is not None:  # one more logit per head that only joins the softmax denominator
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, kvh, 1, g, 1), (B, kvh, Q, g, 1))
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :width]
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    probs = probs.reshape(B, kvh, rows, width)
    out, at = None, 0
    for (_, vb, h, _, r), w in zip(parts, widths):
        nb = h.shape[1]
        p = probs[..., at : at + w].reshape(B, kvh, rows, nb, w // nb).transpose(0, 3, 1, 2, 4)  # [B, nb, kvh, rows, bs]
        o = _block_matmul(p, vb, h, keys=False).sum(axis=1)  # [B, kvh, rows, dv] (MLA: V narrower)
        o = o if r is None else o @ r[1].T
        out, at = o if out is None else out + o, at + w
    if total is not None:
        out = out / total.reshape(B, kvh, rows, 1)
    dv = out.shape[-1]
    out = out.reshape(B, kvh, Q, g, dv).transpose(0, 2, 1, 3, 4).reshape(B, Q, H, dv)
    return out[:, 0] if single else out


def _block_matmul(x: mx.array, blocks: "mx.array | QuantizedBlocks", heads: mx.array, keys: bool) -> mx.array:
    """x times each (block, head) matrix `heads` names: K transposed (`keys`), else V; a
    quantized pool's packed matrices through `gather_qmm`, in place (keys stored per channel
    are K already transposed; V read from them, MLA's, transposes)."""
    if isinstance(blocks, QuantizedBlocks):
        b = blocks
        return mx.gather_qmm(x, b.w, b.scales, b.biases, rhs_indices=heads, transpose=keys != b.channels,
                             group_size=b.group, bits=b.bits)
    bs, d = blocks.shape[-2:]
    mats = blocks.reshape(-1, bs, d)
    return mx.gather_mm(x, mats.swapaxes(-1, -2) if keys else mats, None, heads)
