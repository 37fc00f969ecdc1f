"""The paged KV cache: one K pool and one V pool per layer.

Layout: `[num_blocks, num_kv_heads, block_size, head_dim]` per layer (head-major
inside a block, like vLLM's paged kernels), stored flat as rows
`[num_blocks * num_kv_heads * block_size, head_dim]`. A token's *slot*
(`block_id * block_size + offset`, vLLM's slot mapping) becomes one row per KV
head (`kv_rows`), so the write for a whole ragged batch is one scatter. A
(block, head) pair is a contiguous `[block_size, head_dim]` matrix: decode
attention multiplies queries against it in place through the block table
(`mx.gather_mm`), with no gathered copy of the context, and a paged-attention
kernel reads it with unit stride.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

DEFAULT_BLOCK_SIZE = 16


KV_CACHE_DTYPES = ("auto", "int8")
KV_QUANT_BITS = 8


def kv_group_size(head_dim: int) -> int:
    return 64 if head_dim % 64 == 0 else 32


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: mx.Dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    per_head = head_dim * dtype.size
    if kv_cache_dtype == "int8":  # 1 byte a value + a scale and a bias per group
        per_head = head_dim + 2 * (head_dim // kv_group_size(head_dim)) * dtype.size
    return 2 * num_layers * block_size * num_kv_heads * per_head


def kv_rows(slots: np.ndarray, num_kv_heads: int, block_size: int) -> np.ndarray:
    """Pool rows of `slots` ([T]), one per KV head: [T * num_kv_heads], token-major."""
    block, offset = np.divmod(np.asarray(slots, dtype=np.int64), block_size)
    heads = np.arange(num_kv_heads)
    return (((block[:, None] * num_kv_heads + heads) * block_size) + offset[:, None]).reshape(-1)


def gather_blocks(blocks: mx.array, block_table: mx.array) -> mx.array:
    """The blocks ([num_blocks, kvh, bs, X]) in `block_table` ([..., nb]) as one
    copy per head: [..., kvh, nb * bs, X]."""
    g = mx.moveaxis(blocks[block_table], -3, -4)  # [..., kvh, nb, bs, X]
    *lead, kvh, nb, bs, x = g.shape
    return g.reshape(*lead, kvh, nb * bs, x)


def plan_blocks(budget_bytes: int, per_layer_block: int, num_layers: int, num_window_layers: int,
                window_cap: int) -> tuple[int, int]:
    """(full-attention blocks, window blocks) that fit `budget_bytes`.

    Window layers never need more blocks than the full-attention layers hold, nor
    more than `window_cap` (every running sequence's window plus a step's tokens),
    so once the window pool reaches its cap the rest of the budget buys
    full-attention blocks only. The window pool has one more block: the null block.
    """
    units = budget_bytes // per_layer_block  # layer-blocks the budget buys
    if num_window_layers in (0, num_layers):
        return units // num_layers, 0
    full = (units - num_window_layers) // num_layers  # while the window pool follows the full one
    if full > window_cap:
        full = (units - num_window_layers * (window_cap + 1)) // (num_layers - num_window_layers)
    full = max(full, 0)
    return full, min(full, window_cap) + 1


def available_memory_bytes() -> int:
    """What the machine can give the KV cache before model weights are counted.

    On a Mac: MLX's recommended working set (what Metal lets a process keep
    resident). Elsewhere: the memory the OS reports as available right now.
    """
    if mx.metal.is_available():
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return int(info["max_recommended_working_set_size"])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class KVCache:
    """Per-layer K and V pools; with kv_cache_dtype="int8", each row is stored
    MLX-affine-quantized (8 bits, group-wise scale and bias) and dequantized on
    read, which halves (fp16) or quarters (fp32) the KV memory.

    Sliding-window layers (`window_layers`) get pools of `num_window_blocks`
    blocks, addressed by the window block tables (see `BlockManager`)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        kv_cache_dtype: str = "auto",
        window_layers: frozenset[int] = frozenset(),
        num_window_blocks: int = 0,
    ):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = kv_cache_dtype == "int8"
        self.group_size = kv_group_size(head_dim)
        if self.quantized and head_dim % self.group_size:
            raise ValueError(f"--kv-cache-dtype int8 needs a head size divisible by 32; this model's is {head_dim}")
        self.window_layers = frozenset(window_layers)
        self.num_window_blocks = num_window_blocks

        def pool(slots: int) -> list[mx.array]:
            rows = slots * num_kv_heads
            if not self.quantized:
                return [mx.zeros((rows, head_dim), dtype=dtype)]
            groups = head_dim // self.group_size
            return [mx.zeros((rows, head_dim * KV_QUANT_BITS // 32), dtype=mx.uint32),
                    mx.zeros((rows, groups), dtype=dtype),
                    mx.zeros((rows, groups), dtype=dtype)]

        # k[layer] / v[layer]: [values] or [packed values, scales, biases]
        self._pool = pool
        self.reset()

    def reset(self) -> None:
        """Fresh zeroed pools. After a failed step the old ones cannot be trusted:
        MLX marks an array whose evaluation raised as evaluated, so a pool written
        by the failed graph reads back as whatever its buffer held."""
        slots = [(self.num_window_blocks if i in self.window_layers else self.num_blocks) * self.block_size
                 for i in range(self.num_layers)]
        self.k = [self._pool(n) for n in slots]
        self.v = [self._pool(n) for n in slots]
        mx.eval(self.state())

    @property
    def nbytes(self) -> int:
        per_layer_block = bytes_per_block(
            1, self.num_kv_heads, self.head_dim, self.block_size, self.dtype, self.kv_cache_dtype)
        n_window = len(self.window_layers)
        return per_layer_block * ((self.num_layers - n_window) * self.num_blocks + n_window * self.num_window_blocks)

    def _encode(self, x: mx.array) -> list[mx.array]:
        x = x.reshape(-1, self.head_dim).astype(self.dtype)  # one row per (token, head)
        if not self.quantized:
            return [x]
        return list(mx.quantize(x, group_size=self.group_size, bits=KV_QUANT_BITS))

    def write(self, layer: int, rows: mx.array, k: mx.array, v: mx.array) -> None:
        """Scatter new K/V ([T, kv_heads, head_dim]) into their pool rows
        ([T * kv_heads], from `kv_rows`)."""
        for pools, x in ((self.k[layer], k), (self.v[layer], v)):
            for pool, values in zip(pools, self._encode(x)):
                pool[rows] = values

    def _decode(self, parts: list[mx.array]) -> mx.array:
        if not self.quantized:
            return parts[0]
        return mx.dequantize(*parts, group_size=self.group_size, bits=KV_QUANT_BITS)

    def _blocks(self, pool: mx.array) -> mx.array:
        return pool.reshape(-1, self.num_kv_heads, self.block_size, pool.shape[-1])

    def gather(self, layer: int, block_table: mx.array) -> tuple[mx.array, mx.array]:
        """K and V of the blocks in `block_table` ([..., nb]), dequantized, as
        [..., kvh, nb*bs, d]."""
        return tuple(
            self._decode([gather_blocks(self._blocks(p), block_table) for p in pools])
            for pools in (self.k[layer], self.v[layer])
        )

    def blocks(self, layer: int) -> tuple[mx.array, mx.array]:
        """K and V of one layer as [num_blocks, kvh, bs, d] views (unquantized caches only)."""
        assert not self.quantized
        return self._blocks(self.k[layer][0]), self._blocks(self.v[layer][0])

    def attention_blocks(self, layer: int, block_tables: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(K blocks, V blocks, block tables) for attention over `block_tables` ([B, nb]).
        Unquantized: the pools in place. int8: the tables' blocks dequantized into a
        copy ([B * nb, kvh, bs, d]) with tables renumbered into it."""
        if not self.quantized:
            return *self.blocks(layer), block_tables

        def dequantized(pools: list[mx.array]) -> mx.array:
            blocks = self._decode([self._blocks(p)[block_tables] for p in pools])  # [B, nb, kvh, bs, d]
            return blocks.reshape(-1, *blocks.shape[-3:])

        k, v = dequantized(self.k[layer]), dequantized(self.v[layer])
        return k, v, mx.arange(k.shape[0], dtype=mx.int32).reshape(block_tables.shape)

    def state(self) -> list[mx.array]:
        return [a for pools in self.k + self.v for a in pools]
