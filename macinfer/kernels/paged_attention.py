"""Wrappers that launch the paged decode attention Metal kernels.

`decode_kernel_call` describes one launch (kernel object, inputs, templates,
grid) so the same description runs on Metal (`mx.fast.metal_kernel`) or in the
CPU emulator, which compiles exactly the source MLX generates for it.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from macinfer.kernels.call import KernelCall, kernel_source, launch

DECODE_INPUTS = ["q", "k_pool", "v_pool", "block_tables", "context_lens", "scale"]
MERGE_INPUTS = ["tmp_out", "tmp_ml"]
PARTITION_SIZE = 512  # tokens per split-K partition
THREADGROUP_MEMORY = 32 * 1024  # bytes of threadgroup memory on Apple GPUs


@lru_cache(maxsize=None)
def _kernel(partitioned: bool):
    src = kernel_source("paged_attention_decode")
    src = f"#define MACINFER_PARTITIONED {int(partitioned)}\n{src}\n#undef MACINFER_PARTITIONED\n"
    outputs = ["tmp_out", "tmp_ml"] if partitioned else ["out"]
    return mx.fast.metal_kernel(
        name="macinfer_paged_decode" + ("_split" if partitioned else ""),
        input_names=DECODE_INPUTS,
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


def num_simdgroups(head_dim: int, gqa: int) -> int:
    """Most simdgroups (<= 4) whose merge state fits in threadgroup memory."""
    for nsg in (4, 2, 1):
        if nsg * gqa * (head_dim + 2) * 4 <= THREADGROUP_MEMORY:
            return nsg
    return 0


def supported(head_dim: int, gqa: int) -> bool:
    return head_dim % 32 == 0 and num_simdgroups(head_dim, gqa) > 0


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
) -> list[KernelCall]:
    """The launches for q [B, H, D] over pools [num_blocks, KVH, block_size, D].

    One launch when the longest context fits one partition; otherwise the
    split-K launch plus a merge launch (its inputs are the split outputs,
    filled in by `launch`)."""
    B, H, D = q.shape
    kvh = k_pool.shape[1]
    gqa = H // kvh
    nsg = num_simdgroups(D, gqa)
    assert partition_size % block_size == 0
    parts = max(1, -(-max_context // partition_size))
    template = [("T", q.dtype), ("D", D), ("BS", block_size), ("GQA", gqa), ("NSG", nsg), ("PART", partition_size),
                ("WINDOW", window or 0)]
    inputs = [q, k_pool, v_pool, block_tables.astype(mx.int32), context_lens.astype(mx.int32),
              mx.array([scale], dtype=mx.float32)]
    grid = (32 * nsg * kvh, B, parts)
    tg = (32 * nsg, 1, 1)
    if parts == 1:
        return [KernelCall(_kernel(False), inputs, template, grid, tg, [(B, H, D)], [q.dtype],
                           DECODE_INPUTS, ["out"])]
    split = KernelCall(_kernel(True), inputs, template, grid, tg,
                       [(B, H, parts, D), (B, H, parts, 2)], [mx.float32, mx.float32],
                       DECODE_INPUTS, ["tmp_out", "tmp_ml"])
    merge = KernelCall(_merge_kernel(), [], [("T", q.dtype), ("D", D)], (32, B * H, 1), (32, 1, 1),
                       [(B, H, D)], [q.dtype], MERGE_INPUTS, ["out"])
    return [split, merge]


def paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale, block_size, max_context) -> mx.array:
    return launch(decode_calls(q, k_pool, v_pool, block_tables, context_lens, scale, block_size, max_context))
