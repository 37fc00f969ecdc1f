"""DeepSeek Sparse Attention's key selection on the paged cache (DeepSeek V3.2, GLM-5): a
lightning indexer scores every key of a query's context from an index-key cache of its
own, and the query attends to its `topk` best keys only (all of them while its context is
no longer). Portable MLX ops over the step's block tables: each decode row's index keys
gathered through its table, each prompt chunk's through its span's; the selection is a
boolean mask in the same key layout the attention reads (`attention.py`), which the
layer's latent attention then applies.

The score of key j for a query (per vLLM's and mlx-lm's indexer): the sum over the
indexer's heads h of w_h * relu(q_h . k_j), w the query's head weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from macinfer.kv.attention import AttentionMetadata
from macinfer.kv.decode_attention import decode_mask


@dataclass
class KeySelection:
    """The keys each query row attends to: the decode rows' [B, table width * block size]
    (None: no decode rows), and each prompt chunk's [rows, context] by its first row."""
    decode: mx.array | None = None
    spans: dict[int, mx.array] = field(default_factory=dict)


def _top(scores: mx.array, valid: mx.array, k: int) -> mx.array:
    """`valid` narrowed to each row's `k` best-scoring keys (all of them where a row has
    no more than `k`)."""
    if scores.shape[-1] <= k:
        return valid
    ranked = mx.where(valid, scores, mx.array(-mx.inf, scores.dtype))
    best = mx.argpartition(-ranked, kth=k - 1, axis=-1)[..., :k]
    chosen = mx.put_along_axis(mx.zeros(valid.shape, dtype=mx.bool_), best, mx.array(True), axis=-1)
    return chosen & valid


def _scores(q: mx.array, w: mx.array, k: mx.array) -> mx.array:
    """q [R, H, D], w [R, H], k [R, L, D] (or [L, D] shared) -> [R, L]."""
    s = q @ (k.swapaxes(-1, -2) if k.ndim == 3 else k.T)  # [R, H, L]
    return (mx.maximum(s, 0) * w[:, :, None]).sum(axis=1)


def select_keys(q: mx.array, w: mx.array, meta: AttentionMetadata, layer: int, topk: int) -> KeySelection:
    """The keys each of the step's rows attends to. q [T, H, D]: the indexer's rotated
    queries; w [T, H]: their head weights; `layer`: the index-key cache (this step's rows
    written); `meta`: the step's metadata (decode rows first, then prompt chunks)."""
    g = meta.for_layer(layer)
    pool = g.kv_cache.pool(layer)
    if pool.quantized:
        raise NotImplementedError("the sparse attention indexer reads a full-precision index-key cache")
    out = KeySelection()
    if g.num_decodes:
        blocks = pool.blocks()[0]  # [num_blocks, 1, bs, D]
        tables = g.decode_block_tables
        keys = blocks[tables][:, :, 0].reshape(tables.shape[0], -1, blocks.shape[-1])  # [B, nb * bs, D]
        valid = decode_mask(g.decode_context_lens, keys.shape[1], g.decode_floors)
        n = g.num_decodes
        out.decode = _top(_scores(q[:n], w[:n], keys.astype(q.dtype)), valid, topk)
    for span in g.prefills:
        keys = pool.gather(span.block_table)[0][0, : span.context_len].astype(q.dtype)  # [context, D]
        rows = slice(span.start, span.start + span.length)
        qpos = np.arange(span.context_len - span.length, span.context_len)
        valid = mx.array(np.arange(span.context_len)[None, :] <= qpos[:, None])
        out.spans[span.start] = _top(_scores(q[rows], w[rows], keys), valid, topk)
    return out
