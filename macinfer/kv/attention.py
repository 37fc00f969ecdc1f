"""Attention over the paged KV cache.

`paged_attention` is the one entry point the model calls. It writes the new
K/V rows into their slots, then attends. The portable reference path works on
every MLX backend: decodes (`decode_attention`) multiply queries against each (block, KV head)
matrix of the pool in place through the block table (`mx.gather_mm`), so no
layer copies its context; prefill chunks gather their blocks once and use
`mx.fast.scaled_dot_product_attention`, or, where that is not a fused kernel
(`AttentionMetadata.explicit_ops`, the CPU), the same attention written out
with a power-of-two softmax. Decodes go to the paged-attention Metal
kernel when the engine's backend chose it at load (`AttentionMetadata.decode_attention`:
on a Mac by default; `MACINFER_KERNELS` forces a choice).

The flat token batch is ordered decodes first (one query token per row: a
decoding sequence, or one token of a speculating sequence's draft, each with
its own context length), then prefill chunks. Decodes are attended together as
one padded-by-blocks batch with a length mask; each prefill chunk is attended
with a causal mask aligned to the end of its context (cached prefix + chunk),
short chunks of similar sizes together in one padded call (`prefill_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from macinfer.kernels import paged_attention as paged_kernels
from macinfer.kernels.call import launch
from macinfer.kv.cache import KVCache, kv_rows
from macinfer.kv.channel_keys import BlockRewrite, rewrite_plan
from macinfer.kv.decode_attention import block_heads, decode_mask, reference_decode_attention
from macinfer.kv.dense import dense_attention, sdpa
from macinfer.kv.prefill_plan import PrefillSpan, SpanBatch, batch_mask, plan_prefills


@dataclass
class AttentionMetadata:
    """One cache group's view of a step (`groups[g]` for every group; the first group's
    is the one the model is handed, and `for_layer` finds a layer's)."""
    kv_cache: KVCache
    positions: mx.array  # [T] int32
    slots: np.ndarray  # [T] this group's slot of each new token (vLLM's slot mapping)
    kind: Any = None  # the group's AttentionKind (None: full attention)
    num_decodes: int = 0
    decode_block_tables: mx.array | None = None  # [B, max_blocks] int32
    decode_context_lens: mx.array | None = None  # [B] int32, counted from the table's first block
    decode_floors: mx.array | None = None  # [B] int32: first key each row reads, same origin (None: 0)
    decode_keep: mx.array | None = None  # [B] int32: keys below it read whatever the floor (a prompt: None)
    decode_max_context: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Decode rows of speculating sequences, (first row, rows), after the plain decodes.
    decode_groups: list[tuple[int, int]] = field(default_factory=list)
    # MLX's fast SDPA and RoPE are not fused kernels on this backend (its CPU): write
    # them in the forms that cost least there (softmax by `exp2_weights`, RoPE tables
    # once a step). Chosen at load, like the kernels.
    explicit_ops: bool = False
    # Query tile for causal prefill when `explicit_ops` (None: one call).
    prefill_tile: int | None = None
    # MLA: prompt chunks this long or longer take the expanded form (`kv/mla.py`; None: none).
    mla_expand_from: int | None = None
    # The Metal decode kernel's split-K partition, in tokens (timed at load on Metal).
    decode_partition: int = paged_kernels.PARTITION_SIZE
    # Decode attention: "metal" (the kernel), "emulate" (its source on the CPU emulator) or
    # "reference" (MLX ops): the engine backend's choice at load (`engine.choices.Paths`).
    decode_attention: str = "reference"
    groups: "list[AttentionMetadata]" = field(default_factory=list)
    state: Any = None  # the step's recurrent-state plan (`kv/state.py`; None: no recurrent layers)
    # Rows whose input is an image's encoded features instead of their token's embedding
    # (`macinfer/vision/`), and those features [len(rows), hidden] (None: no image this step).
    lora_slots: mx.array | None = None  # [T] each row's LoRA adapter slot (None: every row the base's)
    image_rows: mx.array | None = None
    image_features: mx.array | None = None
    image_deepstack: mx.array | None = None  # [early layers, len(image_rows), hidden] (Qwen3-VL's DeepStack)
    # Multimodal RoPE (`models/mrope.py`): each row's three rotary positions [3, T], when a
    # sequence in the step has image positions (None: every row turns by its position).
    rope_positions: mx.array | None = None
    rope_offsets: mx.array | None = None  # [T]: multimodal RoPE rows whose three positions agree
    # Arrays every layer of a step shares (built by the first layer that needs them).
    _memo: dict[Any, mx.array] = field(default_factory=dict)

    def memo(self, key: Any, build: Callable[[], mx.array]) -> mx.array:
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def for_layer(self, layer: int) -> "AttentionMetadata":
        return self.groups[self.kv_cache.group_of[layer]] if self.groups else self

    def write(self, cache: int, k: mx.array, v: mx.array | None) -> None:
        """Scatter this step's K/V ([T, kv_heads, d]; None: V is K's leading values) into
        cache `cache`, and the first tokens' into its store of them where it keeps one."""
        kv = self.kv_cache
        for c in (cache,) if cache not in kv.first_of else (cache, kv.first_of[cache]):
            meta = self.for_layer(c)
            plan = meta.rewrite_plan(k.shape[1]) if kv.pool(c).channel_keys else None
            kv.write(c, meta.kv_rows(k.shape[1]), k, v, plan)

    def kv_rows(self, num_kv_heads: int) -> mx.array:
        """[T * kvh] pool rows of the new K/V, one per head (layers' head counts may differ)."""
        return self.memo(("kv_rows", num_kv_heads), lambda: mx.array(
            kv_rows(self.slots, num_kv_heads, self.kv_cache.block_size), dtype=mx.int32))

    def rewrite_plan(self, num_kv_heads: int) -> BlockRewrite:
        """The blocks keys stored per channel rewrite this step (`kv/channel_keys.py`)."""
        return self.memo(("rewrite_plan", num_kv_heads), lambda: rewrite_plan(
            kv_rows(self.slots, num_kv_heads, self.kv_cache.block_size), self.kv_cache.block_size))

    @property
    def window(self) -> int | None:
        """The sliding window the Metal decode kernel can apply (None: full attention)."""
        return getattr(self.kind, "window", None)


def _decode_attention(q: mx.array, meta: AttentionMetadata, layer: int, scale: float,
                      sinks: mx.array | None = None, softcap: float | None = None,
                      key_mask: mx.array | None = None) -> mx.array:
    pool = meta.kv_cache.pool(layer)
    first = meta.kv_cache.first_of.get(layer)  # its first tokens kept apart at full precision
    backend = meta.decode_attention
    # (MLA's V read from keys stored per channel is a transposed read the kernel lacks)
    if (backend != "reference" and sinks is None and softcap is None and key_mask is None and first is None
            and not (pool.channel_keys and pool.v_in_k)
            and (meta.kind is None or meta.window is not None or not meta.kind.bounded) and meta.decode_keep is None
            and (pool.head_dim == pool.v_head_dim or pool.v_in_k)
            and paged_kernels.supported(q.shape[-1], q.shape[1] // pool.num_kv_heads, pool.v_head_dim)):
        args = (meta.decode_block_tables, meta.decode_context_lens, scale, pool.block_size, meta.decode_max_context)
        opts = dict(window=meta.window, v_dim=pool.v_head_dim, partition_size=meta.decode_partition)
        if pool.quantized:  # the packed rows dequantized as the kernel reads them (rotated: q turned alike)
            k_q, v_q = pool.quantized_blocks()
            qr = q if pool.rot_k is None else q @ pool.rot_k
            out = launch(paged_kernels.quantized_decode_calls(qr, k_q, v_q, pool.num_kv_heads, *args, **opts),
                         emulate=backend == "emulate")
            return out if pool.rot_v is None else out @ pool.rot_v.T
        k_blocks, v_blocks = pool.blocks()  # MLA: the latent pool twice, V its leading columns
        return launch(paged_kernels.decode_calls(q, k_blocks, v_blocks, *args, **opts), emulate=backend == "emulate")
    # The pools in place; a quantized one's packed blocks through `gather_qmm` (a dequantized
    # copy of the step's blocks was 1.5-3x slower on the CPU: 8 x 2k tokens, SmolLM2's heads).
    blocks = pool.quantized_blocks() if pool.quantized else pool.blocks()
    rot = None if pool.rot_k is None else (pool.rot_k, pool.rot_v)
    return _decode_attention_blocks(q, meta, pool.num_kv_heads, blocks, scale, sinks, softcap, key_mask, rot,
                                    None if first is None else (meta.for_layer(first),
                                                                meta.kv_cache.pool(first).blocks()))


def _decode_attention_blocks(q: mx.array, meta: AttentionMetadata, kvh: int, blocks: tuple, scale: float,
                             sinks: mx.array | None, softcap: float | None, key_mask: mx.array | None = None,
                             rot: tuple[mx.array, mx.array] | None = None,
                             first: tuple[AttentionMetadata, tuple] | None = None) -> mx.array:
    """The reference decode over a pool's (K, V) `blocks`, `kvh` heads a block (plain rows,
    then each speculating group); `key_mask` [B, width]: the keys each row may read beyond
    its context (a sparse attention's selection, `kv/sparse.py`); `rot`: the pool's
    rotations; `first`: (the step's view of the group holding the first tokens apart
    (`FirstTokens`), the layer's blocks there): keys below its count are read from
    there, the rest from `blocks`."""
    # Every layer's tables are the same, so these are built once a step.
    tables = meta.decode_block_tables
    length, lens, floors = tables.shape[1] * meta.kv_cache.block_size, meta.decode_context_lens, meta.decode_floors
    keep = meta.decode_keep
    groups = meta.decode_groups
    plain = groups[0][0] if groups else q.shape[0]
    fm, lead_blocks = first if first is not None else (None, None)
    count = 0 if fm is None else fm.kind.count
    outs = []

    def lead(rows: slice, table_rows: slice, expand: bool) -> tuple[mx.array, mx.array] | None:
        """The first tokens' (block, head) indices and mask for these rows."""
        if fm is None:
            return None
        heads = meta.memo(("lead_heads", kvh, table_rows.start), lambda: block_heads(
            fm.decode_block_tables[table_rows], kvh))
        width = fm.decode_block_tables.shape[1] * meta.kv_cache.block_size
        mask = meta.memo(("lead_mask", rows.start), lambda: decode_mask(fm.decode_context_lens[rows], width))
        return heads, mask[None] if expand else mask

    if plain:
        heads = meta.memo(("block_heads", kvh), lambda: block_heads(tables[:plain], kvh))
        mask = meta.memo("mask", lambda: decode_mask(lens[:plain], length, None if floors is None else floors[:plain],
                                                     count, None if keep is None else keep[:plain]))
        if key_mask is not None:
            mask = mask & key_mask[:plain]
        outs.append(reference_decode_attention(q[:plain], *blocks, heads, mask, scale, sinks, softcap, rot,
                                               lead(slice(0, plain), slice(0, plain), False), lead_blocks))
    for start, count_ in groups:
        # A speculating sequence's rows share one table (the last row's is the longest):
        # its queries go through each (block, head) matrix together, read once.
        end = start + count_
        heads = meta.memo(("block_heads", kvh, start), lambda: block_heads(tables[end - 1 : end], kvh))
        mask = meta.memo(("mask", start), lambda: decode_mask(
            lens[start:end], length, None if floors is None else floors[start:end], count,
            None if keep is None else keep[start:end])[None])
        if key_mask is not None:
            mask = mask & key_mask[None, start:end]
        outs.append(reference_decode_attention(q[None, start:end], *blocks, heads, mask, scale, sinks, softcap, rot,
                                               lead(slice(start, end), slice(end - 1, end), True), lead_blocks)[0])
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def gather_context(meta: AttentionMetadata, layer: int, spans: list[PrefillSpan],
                   tables: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """K and V of cache `layer` over prompt chunks' block tables, dequantized: [kvh, L, d]
    for one span, [n, kvh, L, d] for a batch's padded `tables`. Where the cache keeps its
    first tokens apart at full precision (`FirstTokens`), those keys come from there."""
    k, v = meta.kv_cache.pool(layer).gather(spans[0].block_table if tables is None else tables)
    first = meta.kv_cache.first_of.get(layer)
    if first is None:
        return k, v
    fm = meta.for_layer(first)

    def first_tables() -> mx.array:  # the same chunks' tables in the first tokens' group
        by_start = {s.start: s for s in fm.prefills}
        ts = [np.array(by_start[s.start].block_table) for s in spans]
        out = np.zeros((len(ts), max(len(t) for t in ts)), np.int32)
        for i, t in enumerate(ts):
            out[i, : len(t)] = t
        return mx.array(out)

    ft = meta.memo(("first_tables", tuple(s.start for s in spans)), first_tables)
    fk, fv = meta.kv_cache.pool(first).gather(ft if tables is not None else ft[0])
    n = min(fk.shape[-2], fm.kind.count, k.shape[-2])
    k, v = (mx.concatenate([f[..., :n, :].astype(x.dtype), x[..., n:, :]], axis=-2) for f, x in ((fk, k), (fv, v)))
    return k, v


def _prefill_attention(q: mx.array, meta: AttentionMetadata, layer: int, span: PrefillSpan, scale: float,
                       sinks: mx.array | None = None, softcap: float | None = None,
                       key_mask: mx.array | None = None) -> mx.array:
    k, v = gather_context(meta, layer, [span])  # [kvh, L, d]
    k, v = (x[None, :, : span.context_len] for x in (k, v))  # [1, kvh, ctx, d]
    # "causal" in MLX aligns the last query with the last key, which is exactly
    # a chunk that continues a cached prefix.
    mask = meta.memo(("span_mask", span.start), lambda: span_mask(span, meta.kind))
    if key_mask is not None:  # a sparse attention's selection ([rows, context], within the causal keys)
        mask = key_mask if isinstance(mask, str) else mask & key_mask
    qh = mx.swapaxes(q, 0, 1)[None]
    out = dense_attention(qh, k, v, scale, mask, meta.explicit_ops, meta.prefill_tile, sinks, softcap)
    return mx.swapaxes(out[0], 0, 1)  # [n, H, d]


def span_mask(span: PrefillSpan, kind) -> mx.array | str:
    """"causal", or [Lq, Lk] where the group's kind puts a floor above the table's first key,
    or where queries read past themselves (`PrefillSpan.key_ceilings`)."""
    qpos = np.arange(span.context_len - span.length, span.context_len) + span.key_offset  # absolute
    floors = kind.key_floor(qpos) - span.key_offset if kind is not None and kind.bounded else None
    if span.prompt_len is not None:  # a window after the prompt (`PromptAndWindow`): keys between unread
        floors = kind.window_floor(qpos)
    if (floors is None or floors.max() <= 0) and span.key_ceilings is None:
        return "causal"
    kpos = np.arange(span.context_len)[None, :]
    top = (qpos if span.key_ceilings is None else span.key_ceilings) - span.key_offset
    mask = kpos <= top[:, None]
    if floors is not None:
        mask &= (kpos >= floors[:, None]) | (kpos < (span.prompt_len or 0))
    return mx.array(mask)


def _batched_prefill_attention(q: mx.array, meta: AttentionMetadata, layer: int, b: SpanBatch, scale: float,
                               sinks: mx.array | None, softcap: float | None) -> mx.array:
    """A group of spans in one padded call: [n * length, H, d] (padding rows included)."""
    n, H, d = len(b.spans), q.shape[1], q.shape[2]
    qb = q[b.q_rows].reshape(n, b.length, H, d).transpose(0, 2, 1, 3)
    k, v = (x[:, :, : b.context] for x in gather_context(meta, layer, [meta.prefills[i] for i in b.spans], b.tables))
    mask = meta.memo(("batch_mask", id(b)), lambda: batch_mask(b, meta.kind))
    out = sdpa(qb, k, v, scale, mask, sinks, softcap, explicit=meta.explicit_ops)
    return out.transpose(0, 2, 1, 3).reshape(n * b.length, H, v.shape[-1])


SPLIT = None  # an `engine.device_split.DeviceSplit` while `macinfer bench profile` splits device time


def attend(q: mx.array, meta: AttentionMetadata, layer: int, scale: float,
           sinks: mx.array | None = None, softcap: float | None = None, select: Any = None) -> mx.array:
    """q: [T, H, d] against the paged cache `layer` (this step's K/V already written; a
    layer that reads another's K/V passes that cache). Which keys each query reads is
    the cache group's kind, narrowed by `select` (a sparse attention's `KeySelection`).
    `sinks`: per-head attention-sink logits; `softcap`: attention logit soft-capping."""
    if SPLIT is not None:
        return SPLIT.timed("attention", lambda: _attend(q, meta, layer, scale, sinks, softcap, select), q)
    return _attend(q, meta, layer, scale, sinks, softcap, select)


def _attend(q: mx.array, meta: AttentionMetadata, layer: int, scale: float,
            sinks: mx.array | None, softcap: float | None, select: Any = None) -> mx.array:
    meta = meta.for_layer(layer)
    outs = []
    if meta.num_decodes:
        outs.append(_decode_attention(q[: meta.num_decodes], meta, layer, scale, sinks, softcap,
                                      None if select is None else select.decode))
    if meta.prefills and select is not None:  # each chunk alone, with its own selection
        for span in meta.prefills:
            qs = q[span.start : span.start + span.length]
            outs.append(_prefill_attention(qs, meta, layer, span, scale, sinks, softcap, select.spans[span.start]))
    elif meta.prefills:
        batches, alone, index = meta.memo("prefill_plan", lambda: plan_prefills(meta.prefills))
        parts = [_batched_prefill_attention(q, meta, layer, b, scale, sinks, softcap) for b in batches]
        for i in alone:
            span = meta.prefills[i]
            qs = q[span.start : span.start + span.length]
            parts.append(_prefill_attention(qs, meta, layer, span, scale, sinks, softcap))
        if index is not None:
            parts = [mx.concatenate(parts, axis=0)[index]]
        outs.extend(parts)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    pool = meta.kv_cache.pool(layer)
    if pool.v_in_k:  # MLA: values were read as all of K; V is its leading columns (the latent)
        out = out[..., : pool.v_head_dim]
    return out.astype(q.dtype)


def paged_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> mx.array:
    """q: [T, H, d]; k, v: [T, kv_heads, d] for the new tokens. Returns [T, H, d]."""
    meta.write(layer, k, v)
    return attend(q, meta, layer, scale)
