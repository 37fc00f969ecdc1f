"""The paged KV cache: one K pool and one V pool per layer.

Layout: `[num_blocks, block_size, num_kv_heads, head_dim]` per layer, viewed
flat as `[num_blocks * block_size, num_kv_heads, head_dim]` for writes, so a
token's *slot* (`block_id * block_size + offset`) is a single row index and the
write for a whole ragged batch is one scatter. Token-major rows keep every
head of a token contiguous (one write per token), and a block read through a
block table is a contiguous `[block_size, kv_heads, head_dim]` slab, the unit a
paged-attention kernel loads.
"""

from __future__ import annotations

import os

import mlx.core as mx

DEFAULT_BLOCK_SIZE = 16


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: mx.Dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.size


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
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
    ):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.k, self.v)

    @property
    def nbytes(self) -> int:
        return bytes_per_block(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
        ) * self.num_blocks

    def write(self, layer: int, slot_mapping: mx.array, k: mx.array, v: mx.array) -> None:
        """Scatter new K/V rows ([T, kv_heads, head_dim]) into their slots."""
        self.k[layer][slot_mapping] = k.astype(self.dtype)
        self.v[layer][slot_mapping] = v.astype(self.dtype)

    def blocks(self, layer: int) -> tuple[mx.array, mx.array]:
        """K and V pools of one layer viewed as [num_blocks, block_size, kvh, d]."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].reshape(shape), self.v[layer].reshape(shape)

    def state(self) -> list[mx.array]:
        return self.k + self.v
