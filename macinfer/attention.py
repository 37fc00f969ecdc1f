"""Attention over the paged KV cache.

`paged_attention` is the one entry point the model calls. It writes the new
K/V rows into their slots, then attends. The portable reference path (gather
blocks through the block table, then `mx.fast.scaled_dot_product_attention`)
works on every MLX backend. Decodes
go to the paged-attention Metal kernel when `macinfer.kernels.mode()` says so
(on a Mac by default; `MACINFER_KERNELS` forces a choice). Prefill chunks use
the gather + SDPA path on every backend for now.

The flat token batch is ordered decodes first (one query token per sequence),
then prefill chunks. Decodes are attended together as one padded-by-blocks
batch with a length mask; each prefill chunk is attended on its own with a
causal mask aligned to the end of its context (cached prefix + chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from macinfer import kernels
from macinfer.kernels import paged_attention as paged_kernels
from macinfer.kernels.call import launch
from macinfer.kv_cache import KVCache


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the flat batch
    length: int  # tokens in this chunk
    context_len: int  # tokens in cache after this chunk (prefix + chunk)
    block_table: mx.array  # [num_blocks_for_context] int32


@dataclass
class AttentionMetadata:
    kv_cache: KVCache
    positions: mx.array  # [T] int32
    slot_mapping: mx.array  # [T] int32
    num_decodes: int = 0
    decode_block_tables: mx.array | None = None  # [B, max_blocks] int32
    decode_context_lens: mx.array | None = None  # [B] int32
    decode_max_context: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)


def _decode_attention(q: mx.array, meta: AttentionMetadata, layer: int, scale: float) -> mx.array:
    cache = meta.kv_cache
    backend = kernels.mode()
    if (backend != "reference" and not cache.quantized
            and paged_kernels.supported(q.shape[-1], q.shape[1] // cache.num_kv_heads)):
        k_rows, v_rows = cache.pools(layer)
        calls = paged_kernels.decode_calls(
            q, k_rows, v_rows, meta.decode_block_tables, meta.decode_context_lens, scale,
            cache.block_size, meta.decode_max_context,
        )
        return launch(calls, emulate=backend == "emulate")
    k, v = cache.gather(layer, meta.decode_block_tables)  # [B, kvh, L, d]
    return reference_decode_attention(q, k, v, meta.decode_context_lens, scale)


def reference_decode_attention(
    q: mx.array, k: mx.array, v: mx.array, context_lens: mx.array, scale: float
) -> mx.array:
    """q [B, H, d] against gathered k, v [B, kvh, L, d], keys past each length masked."""
    L = k.shape[2]
    mask = mx.arange(L)[None, :] < context_lens[:, None]  # [B, L]
    out = mx.fast.scaled_dot_product_attention(
        q[:, :, None, :], k, v, scale=scale, mask=mask[:, None, None, :]
    )
    return out[:, :, 0, :]  # [B, H, d]


def _prefill_attention(q: mx.array, meta: AttentionMetadata, layer: int, span: PrefillSpan, scale: float) -> mx.array:
    k, v = meta.kv_cache.gather(layer, span.block_table)
    k, v = k[None, :, : span.context_len], v[None, :, : span.context_len]
    # "causal" in MLX aligns the last query with the last key, which is exactly
    # a chunk that continues a cached prefix.
    out = mx.fast.scaled_dot_product_attention(
        mx.swapaxes(q, 0, 1)[None], k, v, scale=scale, mask="causal"
    )
    return mx.swapaxes(out[0], 0, 1)  # [n, H, d]


def paged_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> mx.array:
    """q: [T, H, d]; k, v: [T, kv_heads, d] for the new tokens. Returns [T, H, d]."""
    meta.kv_cache.write(layer, meta.slot_mapping, k, v)
    outs = []
    if meta.num_decodes:
        outs.append(_decode_attention(q[: meta.num_decodes], meta, layer, scale))
    for span in meta.prefills:
        qs = q[span.start : span.start + span.length]
        outs.append(_prefill_attention(qs, meta, layer, span, scale))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out.astype(q.dtype)
