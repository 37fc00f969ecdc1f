"""Wrappers that launch the paged decode attention Metal kernels.

`decode_kernel_call` describes one launch (kernel object, inputs, templates,
grid) so the same description runs on Metal (`mx.fast.metal_kernel`) or in the
CPU emulator, which compiles exactly the source MLX generates for it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx

from macinfer.kernels.call import KernelCall, kernel_source, launch

DECODE_INPUTS = ["q", "k_pool", "v_pool", "block_tables", "context_lens", "scale"]
# The quantized pools' form: packed words, scales and biases of K and of V.
QUANTIZED_INPUTS = ["q", "k_w", "k_s", "k_b", "v_w", "v_s", "v_b", "block_tables", "context_lens", "scale"]
MERGE_INPUTS = ["tmp_out", "tmp_ml"]
PARTITION_SIZE = 512  # tokens per split-K partition
THREADGROUP_MEMORY = 32 * 1024  # bytes of threadgroup memory on Apple GPUs
# Floats of query and accumulator a thread keeps per head block: a GQA group of 8 heads of
# 128 or 256 dims fits whole (as before MLA); MLA's 576-wide latent queries for 128 heads
# are split into blocks of heads, each block reading the latent once for its heads.
REGISTER_FLOATS = 128


@lru_cache(maxsize=None)
def _kernel(partitioned: bool, quantized: bool = False):
    src = kernel_source("paged_attention_decode")
    src = (f"#define MACINFER_PARTITIONED {int(partitioned)}\n#define MACINFER_QUANTIZED {int(quantized)}\n{src}\n"
           "#undef MACINFER_QUANTIZED\n#undef MACINFER_PARTITIONED\n")
    outputs = ["tmp_out", "tmp_ml"] if partitioned else ["out"]
    return mx.fast.metal_kernel(
        name="macinfer_paged_decode" + ("_split" if partitioned else "") + ("_q" if quantized else ""),
        input_names=QUANTIZED_INPUTS if quantized else DECODE_INPUTS,
        output_names=outputs,
        source=src,
    )


@lru_cache(maxsize=None)
def _merge_kernel():
    return mx.fast.metal_kernel(
        name="macinfer_paged_decode_merge",
        input_names=MERGE_INPUTS,
        output_names=["out"],
        source=kernel_source("paged_attention_merge"),
    )


def num_simdgroups(v_dim: int, heads: int) -> int:
    """Most simdgroups (<= 4) whose merge state for `heads` heads fits in threadgroup memory."""
    for nsg in (4, 2, 1):
        if nsg * heads * (v_dim + 2) * 4 <= THREADGROUP_MEMORY:
            return nsg
    return 0


def head_block(head_dim: int, v_dim: int, gqa: int) -> tuple[int, int]:
    """(query heads per threadgroup, simdgroups): the largest divisor of the GQA group whose
    per-thread state stays within REGISTER_FLOATS and whose merge state fits; (0, 0): none."""
    per_head = (head_dim + v_dim) // 32
    for hb in range(gqa, 0, -1):
        if gqa % hb == 0 and (hb * per_head <= REGISTER_FLOATS or hb == 1):
            nsg = num_simdgroups(v_dim, hb)
            if nsg:
                return hb, nsg
    return 0, 0


def supported(head_dim: int, gqa: int, v_dim: int | None = None) -> bool:
    v_dim = head_dim if v_dim is None else v_dim
    return head_dim % 32 == 0 and v_dim % 32 == 0 and head_block(head_dim, v_dim, gqa)[0] > 0


def decode_calls(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    block_size: int,
    max_context: int,
    partition_size: int = PARTITION_SIZE,
    window: int | None = None,
    v_dim: int | None = None,
) -> list[KernelCall]:
    """The launches for q [B, H, D] over pools k [num_blocks, KVH, block_size, D] and
    v [.., VW]; the output is [B, H, v_dim] (default: VW). MLA passes its latent pool as
    both, with `v_dim` the latent's width (V is K's leading columns).

    One launch when the longest context fits one partition; otherwise the
    split-K launch plus a merge launch (its inputs are the split outputs,
    filled in by `launch`)."""
    kvh = k_pool.shape[1]
    dv = v_pool.shape[-1] if v_dim is None else v_dim
    return _calls(q, [k_pool, v_pool], kvh, dv, [], block_tables, context_lens, scale, block_size, max_context,
                  partition_size, window)


def quantized_decode_calls(
    q: mx.array, k: Any, v: Any, num_kv_heads: int, block_tables: mx.array, context_lens: mx.array, scale: float,
    block_size: int, max_context: int, partition_size: int = PARTITION_SIZE, window: int | None = None,
    v_dim: int | None = None,
) -> list[KernelCall]:
    """`decode_calls` over a quantized pool's packed blocks (`kv.cache.QuantizedBlocks`, K
    and V; MLA: K twice, `v_dim` the latent's width): each row dequantized as it is read;
    keys stored per channel (`k.channels`) read by channel at the token's column."""
    assert not v.channels, "V is read by row (MLA's V from keys per channel takes the reference path)"
    def shaped(x: mx.array) -> mx.array:  # [num_blocks * kvh, bs, n] -> [num_blocks, kvh, bs, n]
        return x.reshape(-1, num_kv_heads, *x.shape[1:])

    arrays = [shaped(x) for b in (k, v) for x in (b.w, b.scales, b.biases)]
    template = [("KBITS", k.bits), ("VBITS", v.bits), ("KGROUP", k.group), ("VGROUP", v.group),
                ("KCHAN", int(k.channels))]
    return _calls(q, arrays, num_kv_heads, v.dim if v_dim is None else v_dim, template, block_tables, context_lens,
                  scale, block_size, max_context, partition_size, window)


def _calls(q: mx.array, pools: list[mx.array], kvh: int, dv: int, extra: list, block_tables: mx.array,
           context_lens: mx.array, scale: float, block_size: int, max_context: int, partition_size: int,
           window: int | None) -> list[KernelCall]:
    B, H, D = q.shape
    quantized = len(pools) > 2
    names = QUANTIZED_INPUTS if quantized else DECODE_INPUTS
    gqa = H // kvh
    hb, nsg = head_block(D, dv, gqa)
    assert partition_size % block_size == 0 and hb > 0
    parts = max(1, -(-max_context // partition_size))
    template = [("T", q.dtype), ("D", D), ("DV", dv), ("BS", block_size), ("GQA", gqa), ("HB", hb), ("NSG", nsg),
                ("PART", partition_size), ("WINDOW", window or 0), *extra]
    inputs = [q, *pools, block_tables.astype(mx.int32), context_lens.astype(mx.int32),
              mx.array([scale], dtype=mx.float32)]
    grid = (32 * nsg * kvh * (gqa // hb), B, parts)
    tg = (32 * nsg, 1, 1)
    if parts == 1:
        return [KernelCall(_kernel(False, quantized), inputs, template, grid, tg, [(B, H, dv)], [q.dtype],
                           names, ["out"])]
    split = KernelCall(_kernel(True, quantized), inputs, template, grid, tg,
                       [(B, H, parts, dv), (B, H, parts, 2)], [mx.float32, mx.float32],
                       names, ["tmp_out", "tmp_ml"])
    merge = KernelCall(_merge_kernel(), [], [("T", q.dtype), ("D", dv)], (32, B * H, 1), (32, 1, 1),
                       [(B, H, dv)], [q.dtype], MERGE_INPUTS, ["out"])
    return [split, merge]


def paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale, block_size, max_context) -> mx.array:
    return launch(decode_calls(q, k_pool, v_pool, block_tables, context_lens, scale, block_size, max_context))
