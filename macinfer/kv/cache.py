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

from dataclasses import dataclass

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from macinfer.kv.channel_keys import BlockRewrite, read_keys, rewrite_plan, write_keys
from macinfer.kv.spec import CacheGroup, FirstTokens, LayerKV
from macinfer.kv.state import StatePool

DEFAULT_BLOCK_SIZE = 16


# "auto": the projections' dtype; "intN": MLX-affine N-bit rows (group-wise scale and bias);
# "k8v4": 8-bit keys, 4-bit values (keys carry the outliers); a trailing "r": the rows
# turned by a fixed rotation first (`rotation`); a trailing "c": keys quantized per
# channel across a block's tokens (`CHANNEL_KEYS`). Each: (K bits, V bits).
KV_QUANT_BITS = {"int8": (8, 8), "int4": (4, 4), "int3": (3, 3), "int4r": (4, 4), "int3r": (3, 3),
                 "int4c": (4, 4), "int3c": (3, 3), "k8v4": (8, 4), "k8v4r": (8, 4)}
KV_CACHE_DTYPES = ("auto", *KV_QUANT_BITS)
# Keys quantized per channel over a block's tokens (KIVI's layout), values per row: a key
# channel keeps a near-constant offset across tokens (RoPE pairs that turn slowly,
# outlier channels), which a per-row group's one scale must span and a per-channel
# group takes out as its bias. SmolLM2, 4 bits: +18.8% perplexity per row, +2.4% per channel
# (scripts/kv_quality.py, docs/benchmarks.md). The block is the group, so the block size must be one MLX
# quantizes in (32 by default for these dtypes, `EngineConfig`).
CHANNEL_KEYS = ("int4c", "int3c")


def rotation(d: int, dtype: mx.Dtype) -> mx.array:
    """An orthogonal d x d matrix applied to K and V rows before they are quantized (and to
    the queries, and back on the attention output, so attention is unchanged): it spreads a
    few outlier channels over all of them, so a group's scale fits the rest (QuaRot's and
    TurboQuant's idea). The normalized Hadamard matrix where d is a power of two, else a
    fixed random orthogonal one."""
    if d & (d - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        r = h / np.sqrt(d)
    else:
        r, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(d, d)))
    return mx.array(r.astype(np.float32)).astype(dtype)


KV_GROUP_SIZES = (32, 64, 128)  # what MLX's affine quantization takes


def kv_group_size(head_dim: int, configured: int | None = None, bits: int | None = None) -> int:
    """Values sharing a scale and bias: `configured` (`--kv-group-size`), else for 8 bits the
    widest group that divides the row (a row of 128 one group: 256 levels span a row's range
    with room, +0.03% perplexity on SmolLM2, whose rows are one group of 64 either way, and
    1.94x fp16's rows where groups of 64 give 1.88x), else 64 where it divides the row
    (mlx-lm's default), else 32."""
    if configured:
        return configured
    widths = (128, 64, 32) if bits == 8 else (64, 32)
    return next((g for g in widths if head_dim % g == 0), 32)


def quantized_row_bytes(head_dim: int, scale_itemsize: int, bits: int = 8, group: int | None = None) -> int:
    """Bytes of one quantized row: `bits` a value + a scale and a bias per group."""
    return head_dim * bits // 8 + 2 * (head_dim // kv_group_size(head_dim, group, bits)) * scale_itemsize


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: mx.Dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    """K + V bytes of one block in `num_layers` layers of one shape."""
    spec = LayerKV(None, num_kv_heads, head_dim, head_dim)
    return num_layers * layer_bytes_per_block(spec, dtype, block_size, kv_cache_dtype)


def layer_bytes_per_block(spec: LayerKV, dtype: mx.Dtype, block_size: int, kv_cache_dtype: str = "auto",
                          group: int | None = None) -> int:
    """K + V bytes one block of `spec`'s layer holds."""
    if kv_cache_dtype not in KV_QUANT_BITS:
        return block_size * spec.bytes_per_token(dtype.size)
    kb, vb = KV_QUANT_BITS[kv_cache_dtype]
    if kv_cache_dtype in CHANNEL_KEYS:  # a block's K: d rows of block_size values, one group each
        v = 0 if spec.v_in_k else block_size * quantized_row_bytes(spec.v_head_dim, dtype.size, vb, group)
        return spec.num_kv_heads * (spec.head_dim * quantized_row_bytes(block_size, dtype.size, kb, block_size) + v)
    return block_size * spec.bytes_per_token(dtype.size, (lambda d: quantized_row_bytes(d, dtype.size, kb, group),
                                                          lambda d: quantized_row_bytes(d, dtype.size, vb, group)))


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


def plan_blocks(groups: list[CacheGroup], budget_bytes: int, caps: list[int], max_blocks: int,
                extra_per_block: float = 0.0, also: Callable[[int], int] | None = None) -> int:
    """The most blocks N the unbounded groups can hold within `budget_bytes` (at most
    `max_blocks`), each bounded group (windows, chunks) holding `min(N, cap) + 1`: once
    its pool holds every running sequence's live blocks (`caps`), the rest of the
    budget buys unbounded blocks only. Groups' `bytes_per_block` must be set.
    `extra_per_block`: what else each block brings (recurrent-state snapshots); `also`:
    bytes bought beside n blocks (a drafter's pool, sized to them)."""

    def cost(n: int) -> int:
        return sum(g.bytes_per_block * g.blocks_for(n, cap) for g, cap in zip(groups, caps)) + \
            int(n * extra_per_block) + (also(n) if also is not None else 0)

    lo, hi = 0, max_blocks
    while lo < hi:  # cost is monotone in n
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget_bytes else (lo, mid - 1)
    return lo


@dataclass(frozen=True)
class QuantizedBlocks:
    """A quantized pool's (block, head) matrices: packed values, scales and biases, each
    [num_blocks * kvh, bs, ...], and how they were packed (`dim`: the values a row)."""
    w: mx.array
    scales: mx.array
    biases: mx.array
    group: int
    bits: int
    dim: int
    # Keys per channel (`channel_keys`): each matrix [d, bs], a row one channel over the
    # block's tokens (`dim`: bs), multiplied with the queries on its left.
    channels: bool = False

    @property
    def tokens(self) -> int:
        """A block's tokens."""
        return self.dim if self.channels else self.w.shape[1]


class LayerPool:
    """One layer's K and V pools, `[num_blocks * kvh * bs, d]` rows each; with a quantized
    kv_cache_dtype (`bits`: K's and V's, 8, 4 or 3), each row is stored MLX-affine-quantized (group-wise
    scale and bias) and dequantized on read: int8 halves fp16's KV memory, int4 takes
    about a quarter (0.31x with its scales, groups of 64), int3 about a fifth."""

    def __init__(self, layer: int, spec: LayerKV, num_blocks: int, block_size: int, dtype: mx.Dtype,
                 bits: tuple[int, int] | None, group: int | None = None, rotated: bool = False,
                 channel_keys: bool = False):
        self.num_kv_heads, self.head_dim, self.v_head_dim = spec.num_kv_heads, spec.head_dim, spec.v_head_dim
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.quantized, self.group = bits is not None, group
        self.k_bits, self.v_bits = bits or (None, None)
        self.name = None if bits is None else (f"int{bits[0]}" if bits[0] == bits[1] else f"k{bits[0]}v{bits[1]}") + \
            ("r" if rotated else "c" if channel_keys else "")
        # K stored per channel across a block's tokens (`kv/channel_keys.py`): the block is its group.
        self.channel_keys = bool(channel_keys and bits)
        if self.channel_keys and block_size not in KV_GROUP_SIZES:
            raise ValueError(f"--kv-cache-dtype {self.name} quantizes each key channel over a block's tokens: "
                             f"the block size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                             f"got {block_size}")
        self.v_in_k = spec.v_in_k  # MLA: V is K's leading values (the latent), not stored
        # Rotated rows (`rotation`): K's and V's matrices; None: stored as they come.
        self.rot_k = rotation(spec.head_dim, dtype) if rotated else None
        self.rot_v = self.rot_k if spec.v_in_k or not rotated else rotation(spec.v_head_dim, dtype)
        sizes = (() if self.channel_keys else (spec.head_dim,)) + (() if spec.v_in_k else (spec.v_head_dim,))
        if self.quantized and any(d % (group or 32) for d in sizes):
            raise ValueError(f"--kv-cache-dtype {self.name} needs head sizes divisible by "
                             f"{group or 32} (its "
                             f"quantization group{'' if group else 's'}); layer {layer} has {spec.head_dim} (K) "
                             f"and {spec.v_head_dim} (V)" + ("; try --kv-group-size 32" if group and group > 32
                                                             else ""))
        self.reset()

    def _pool(self, d: int, bits: int | None, channels: bool = False) -> list[mx.array]:
        rows = self.num_blocks * self.block_size * self.num_kv_heads
        if not self.quantized:
            return [mx.zeros((rows, d), dtype=self.dtype)]
        if channels:  # a row per (block, head, channel), its block's tokens one group
            rows, d = self.num_blocks * self.num_kv_heads * d, self.block_size
        groups = d // (self.block_size if channels else kv_group_size(d, self.group, bits))
        return [mx.zeros((rows, d * bits // 32), dtype=mx.uint32),
                mx.zeros((rows, groups), dtype=self.dtype), mx.zeros((rows, groups), dtype=self.dtype)]

    def reset(self) -> None:
        # k / v: [values] or [packed values, scales, biases]
        self.k = self._pool(self.head_dim, self.k_bits, self.channel_keys)
        self.v = [] if self.v_in_k else self._pool(self.v_head_dim, self.v_bits)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def _encode(self, x: mx.array, bits: int | None) -> list[mx.array]:
        x = x.reshape(-1, x.shape[-1]).astype(self.dtype)  # one row per (token, head)
        if not self.quantized:
            return [x]
        return list(mx.quantize(x, group_size=kv_group_size(x.shape[-1], self.group, bits), bits=bits))

    def block_arrays(self) -> list[tuple[mx.array, int]]:
        """Every pool array with its rows per block (the disk tier copies blocks out and in)."""
        rows = self.num_kv_heads * self.block_size
        return [(a, self.num_kv_heads * self.head_dim if self.channel_keys else rows) for a in self.k] + \
            [(a, rows) for a in self.v]

    def write(self, rows: mx.array, k: mx.array, v: mx.array | None, plan: BlockRewrite | None = None) -> None:
        """Scatter new K/V ([T, kv_heads, d]) into their pool rows ([T * kv_heads], from `kv_rows`);
        keys per channel rewrite their blocks (`plan`: `rewrite_plan` of `rows`, built here if None)."""
        if self.rot_k is not None:
            k, v = k.astype(self.dtype) @ self.rot_k, None if self.v_in_k else v.astype(self.dtype) @ self.rot_v
        parts = [] if self.v_in_k else [(self.v, v, self.v_bits)]
        if self.channel_keys:
            plan = plan or rewrite_plan(np.array(rows), self.block_size)
            write_keys(self.k, plan, k.reshape(-1, k.shape[-1]), self.block_size, self.k_bits, self.dtype)
        else:
            parts.insert(0, (self.k, k, self.k_bits))
        for pools, x, bits in parts:
            for pool, values in zip(pools, self._encode(x, bits)):
                pool[rows] = values

    def _decode(self, parts: list[mx.array], d: int, bits: int | None) -> mx.array:
        if not self.quantized:
            return parts[0]
        return mx.dequantize(*parts, group_size=kv_group_size(d, self.group, bits), bits=bits)

    def _blocks(self, pool: mx.array) -> mx.array:
        return pool.reshape(-1, self.num_kv_heads, self.block_size, pool.shape[-1])

    def gather(self, block_table: mx.array) -> tuple[mx.array, mx.array]:
        """K and V of the blocks in `block_table` ([..., nb]), dequantized, as [..., kvh, nb*bs, d]
        (`v_in_k`: K twice; the attention keeps V's columns of its output, cheaper than
        copying a strided view of K)."""
        if self.channel_keys:
            k = read_keys(self.k, block_table, self.num_kv_heads, self.head_dim, self.block_size, self.k_bits)
        else:
            k = self._decode([gather_blocks(self._blocks(p), block_table) for p in self.k], self.head_dim,
                             self.k_bits)
        if self.rot_k is not None:  # rotated back (R is orthogonal: its inverse is its transpose)
            k = k @ self.rot_k.T
        if self.v_in_k:  # V is K's leading values: the attention reads K and keeps those columns
            return k, k
        v = self._decode([gather_blocks(self._blocks(p), block_table) for p in self.v], self.v_head_dim, self.v_bits)
        return k, v if self.rot_v is None else v @ self.rot_v.T

    def blocks(self) -> tuple[mx.array, mx.array]:
        """K and V as [num_blocks, kvh, bs, d] views (unquantized caches only)."""
        assert not self.quantized
        k = self._blocks(self.k[0])
        return k, k if self.v_in_k else self._blocks(self.v[0])

    def quantized_blocks(self) -> tuple["QuantizedBlocks", "QuantizedBlocks"]:
        """K and V as packed (block, head) matrices, read in place by `gather_qmm`
        (quantized caches only; `v_in_k`: K twice)."""
        assert self.quantized

        def view(parts: list[mx.array], d: int, bits: int) -> QuantizedBlocks:
            w, scales, biases = (p.reshape(-1, self.block_size, p.shape[-1]) for p in parts)
            return QuantizedBlocks(w, scales, biases, kv_group_size(d, self.group, bits), bits, d)

        if self.channel_keys:
            w, scales, biases = (p.reshape(-1, self.head_dim, p.shape[-1]) for p in self.k)
            k = QuantizedBlocks(w, scales, biases, self.block_size, self.k_bits, self.block_size, channels=True)
        else:
            k = view(self.k, self.head_dim, self.k_bits)
        return k, k if self.v_in_k else view(self.v, self.v_head_dim, self.v_bits)

    def state(self) -> list[mx.array]:
        return self.k + self.v


class KVCache:
    """The pools of every cache, each sized by its group's block count (see
    `macinfer.kv.spec`). Indexed by cache; a layer that reads another's K/V is
    routed to that cache by the model."""

    def __init__(self, layers: list[LayerKV], groups: list[CacheGroup], block_size: int, dtype: mx.Dtype,
                 kv_cache_dtype: str = "auto", states: StatePool | None = None, group: int | None = None,
                 first_of: dict[int, int] | None = None):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if group is not None and kv_cache_dtype not in KV_QUANT_BITS:
            raise ValueError("--kv-group-size applies to a quantized KV cache (--kv-cache-dtype int8/int4/...)")
        if group is not None and group not in KV_GROUP_SIZES:
            raise ValueError(f"--kv-group-size {group}: MLX quantizes in groups of {', '.join(map(str, KV_GROUP_SIZES))}")
        self.layers, self.groups = layers, groups
        self.block_size, self.dtype, self.kv_cache_dtype = block_size, dtype, kv_cache_dtype
        self.bits = KV_QUANT_BITS.get(kv_cache_dtype)
        rotated = kv_cache_dtype.endswith("r")
        self.channel_keys = kv_cache_dtype in CHANNEL_KEYS
        self.group = group
        self.quantized = self.bits is not None
        self.group_of = [0] * len(layers)
        for g in groups:
            for i in g.caches:
                self.group_of[i] = g.index
        # A full-attention cache's store of its first tokens (`FirstTokens`, `--kv-quant-start`),
        # kept at full precision: cache -> that store's cache.
        self.first_of = first_of or {}
        self._pools: dict[int, LayerPool] = {}
        for g in groups:
            exact = isinstance(g.kind, FirstTokens)
            for i in g.caches:
                self._pools[i] = LayerPool(i, layers[i], g.num_blocks, block_size, dtype, None if exact else self.bits,
                                           group, rotated and not exact, self.channel_keys and not exact)
        self.states = states  # recurrent layers' state pool (hybrid and recurrent models)
        # The disk tier's hooks (`engine/disk_cache.py`): evicted blocks are copied out
        # before the pools are next written; a reset drops what was queued.
        self.before_write: Callable[[], None] | None = None
        self.on_reset: Callable[[], None] | None = None
        mx.eval(self.state())

    @property
    def num_blocks(self) -> int:
        """Blocks of the first group (the full-attention one when the model has one)."""
        return self.groups[0].num_blocks if self.groups else 0

    def pool(self, cache: int) -> LayerPool:
        return self._pools[cache]

    def write(self, layer: int, rows: mx.array, k: mx.array, v: mx.array, plan: BlockRewrite | None = None) -> None:
        if self.before_write is not None:
            self.before_write()
        self.pool(layer).write(rows, k, v, plan)

    def reset(self) -> None:
        """Fresh zeroed pools. After a failed step the old ones cannot be trusted:
        MLX marks an array whose evaluation raised as evaluated, so a pool written
        by the failed graph reads back as whatever its buffer held."""
        if self.on_reset is not None:
            self.on_reset()
        for p in self._pools.values():
            p.reset()
        if self.states is not None:
            self.states.reset()
        mx.eval(self.state())

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pools.values()) + (self.states.nbytes if self.states else 0)

    def group_nbytes(self, group: CacheGroup) -> int:
        return sum(self._pools[i].nbytes for i in group.caches)

    def state(self) -> list[mx.array]:
        return [a for p in self._pools.values() for a in p.state()] + \
            (self.states.state() if self.states is not None else [])
