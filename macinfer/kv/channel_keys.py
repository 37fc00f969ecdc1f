"""Keys quantized per channel across a block's tokens (`--kv-cache-dtype int4c/int3c`,
`cache.CHANNEL_KEYS`; KIVI's layout for keys).

A (block, KV head) matrix of keys is stored transposed, [head_dim, block_size], each
row one channel's values over the block's tokens, quantized as one MLX-affine group
(so the block size is the group: 32, 64 or 128). Scores read it in place through
`gather_qmm` with the query on the left (no transpose); a prompt's chunk reads it
dequantized and turned back to [tokens, head_dim].

A block fills over several steps (a decode writes one row a step), while its channel
groups span all its rows. Each write therefore rewrites the whole matrices it touches:
the rows already there (dequantized), this step's new rows, and past the last written
row copies of it (unwritten rows would otherwise drag every channel's range to
whatever they hold; they are masked out of attention and overwritten later). Rows
kept across a rewrite are requantized on a grid that only moves when the new rows
widen a channel's range: the grid is the channel's own minimum and maximum
(`quantize_rows`), so a row already on it maps back to itself. (MLX's `mx.quantize`
snaps its grid so that zero is exact, which moves it on a requantization: SmolLM2, 4
bits, the last 1,024 of 1,536 tokens decoded one at a time, +3.3% perplexity with MLX's
grid, +2.4% with min-max; 2,048 tokens in prompt chunks, +1.9% and +2.4%:
`scripts/kv_quality.py`. The packing is MLX's, so `gather_qmm` and `mx.dequantize` read it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class BlockRewrite:
    """The matrices a step's write touches and where each of their rows comes from."""
    mats: mx.array  # [M]: (block, head) matrix indices
    # [M * bs]: row o of matrix j is old row j * bs + o (the matrix's dequantized rows),
    # or new row M * bs + i (the step's i-th row, `kv_rows` order)
    take: mx.array


def rewrite_plan(rows: np.ndarray, block_size: int) -> BlockRewrite:
    """The rewrite of the matrices that pool rows `rows` (from `kv_rows`, the per-row
    layout's numbering: (block * kvh + head) * bs + offset) fall in."""
    mat, off = np.divmod(np.asarray(rows, dtype=np.int64), block_size)
    mats, j = np.unique(mat, return_inverse=True)
    m = len(mats)
    take = np.arange(m * block_size, dtype=np.int64).reshape(m, block_size)
    take[j, off] = m * block_size + np.arange(len(off))
    last = np.full(m, -1, dtype=np.int64)
    np.maximum.at(last, j, off)
    take = np.where(np.arange(block_size)[None] > last[:, None], take[np.arange(m), last][:, None], take)
    return BlockRewrite(mx.array(mats, dtype=mx.int32), mx.array(take.reshape(-1), dtype=mx.int32))


@lru_cache(maxsize=None)
def _packing(n: int, bits: int) -> tuple[mx.array, ...]:
    """MLX's packing of n values of `bits` bits, one little-endian bit stream over uint32
    words (a 3-bit value may straddle two): each value's shift into its word and back out
    of it into the next, and which words take each ([words, n] 0/1 masks)."""
    pos = np.arange(n) * bits
    word, shift = pos // 32, pos % 32
    straddle = shift + bits > 32
    words = np.arange(n * bits // 32)[:, None]
    return (mx.array(shift.astype(np.uint32)), mx.array(np.where(straddle, 32 - shift, 0).astype(np.uint32)),
            mx.array((word[None] == words).astype(np.uint32)),
            mx.array((straddle[None] & (word[None] + 1 == words)).astype(np.uint32)))


def quantize_rows(x: mx.array, bits: int, dtype: mx.Dtype) -> list[mx.array]:
    """Each row of x ([R, n]) as one affine group on its own [min, max]: (packed values
    [R, n * bits / 32] uint32, scales [R, 1], biases [R, 1]) in MLX's layout."""
    top = 2**bits - 1
    x = x.astype(mx.float32)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    scale = mx.maximum((hi - lo) / top, 1e-7)
    q = mx.clip(mx.round((x - lo) / scale), 0, top).astype(mx.uint32)
    n = x.shape[-1]
    if 32 % bits == 0:  # whole values a word: each word's values shifted into place and summed
        per = 32 // bits
        w = (q.reshape(-1, n // per, per) << mx.arange(0, 32, bits, dtype=mx.uint32)).sum(-1)
    else:
        shift, back, first, second = _packing(n, bits)
        w = ((q << shift)[:, None, :] * first + (q >> back)[:, None, :] * second).sum(-1)
    return [w.astype(mx.uint32), scale.astype(dtype), lo.astype(dtype)]


def matrix_rows(mats: mx.array, dim: int) -> mx.array:
    """Pool rows ([M * dim]) of the transposed matrices `mats`: one row per channel."""
    return (mats[:, None] * dim + mx.arange(dim, dtype=mats.dtype)[None]).reshape(-1)


def write_keys(parts: list[mx.array], plan: BlockRewrite, keys: mx.array, block_size: int, bits: int,
               dtype: mx.Dtype) -> None:
    """Rewrite the matrices `plan` names with the step's `keys` ([N, d], `kv_rows` order)
    in the pool arrays `parts` (packed values, scales, biases: [blocks * kvh * d, ...])."""
    m, d = plan.mats.shape[0], keys.shape[-1]
    if m == 0:
        return
    at = matrix_rows(plan.mats, d)
    old = mx.dequantize(*(p[at] for p in parts), group_size=block_size, bits=bits)  # [M * d, bs]
    old = old.reshape(m, d, block_size).swapaxes(1, 2).reshape(m * block_size, d).astype(dtype)
    rows = mx.concatenate([old, keys.astype(dtype)])[plan.take]  # [M * bs, d]
    rows = rows.reshape(m, block_size, d).swapaxes(1, 2).reshape(m * d, block_size)
    for part, values in zip(parts, quantize_rows(rows, bits, dtype)):
        part[at] = values


def read_keys(parts: list[mx.array], block_table: mx.array, num_kv_heads: int, dim: int, block_size: int,
              bits: int) -> mx.array:
    """The keys of the blocks in `block_table` ([..., nb]), dequantized: [..., kvh, nb * bs, d]."""
    w, s, b = (p.reshape(-1, num_kv_heads, dim, p.shape[-1])[block_table] for p in parts)
    k = mx.dequantize(w, s, b, group_size=block_size, bits=bits)  # [..., nb, kvh, d, bs]
    k = k.swapaxes(-1, -2).swapaxes(-4, -3)  # [..., kvh, nb, bs, d]
    *lead, kvh, nb, bs, d = k.shape
    return k.reshape(*lead, kvh, nb * bs, d)
