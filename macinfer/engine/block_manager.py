"""Block manager: which KV blocks each sequence owns, and the prefix cache.

Blocks are fixed-size (block_size tokens) slabs of the paged KV cache. A
sequence's block table lists its block ids in order; token i lives in slot
`block_table[i // block_size] * block_size + i % block_size`.

Prefix caching (vLLM v1's design): a *full* block is named by a hash chained
over its tokens, its parent block's hash and the request's cache salt. A new
sequence takes every cached block of its longest cached prefix by reference
(ref_count += 1, no copy) and computes only the rest. Blocks are never
written once full, so sharing is safe: a sequence's first divergent token
always lands in a block of its own. Freed blocks keep their hash and sit in
an LRU free queue; they are evicted (hash dropped) only when reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from macinfer.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes, tokens: list[int], salt: str | None) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


NULL_BLOCK = 0  # a window table's placeholder for a released block (never allocated)


class BlockPool:
    """The blocks of one KV pool: reference counts, the LRU free queue, the hash index."""

    def __init__(self, num_blocks: int, reserve_null: bool = False):
        self.blocks = [Block(i) for i in range(num_blocks)]
        first = 1 if reserve_null else 0
        # Free blocks in eviction order (least recently freed first).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_usable = num_blocks - first

    def hit(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def take(self) -> int:
        """The least recently freed block, its cached contents evicted."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.block_hash is None:
                self.free_blocks.move_to_end(block_id, last=False)  # nothing cached: reuse first

    def publish(self, block_id: int, h: bytes) -> None:
        block = self.blocks[block_id]
        if block.block_hash is None:
            block.block_hash = h
            self.cached.setdefault(h, block_id)

    def drop_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()


class BlockManager:
    """Block tables of every sequence over the full-attention pool and, for a model
    with sliding-window layers, a second, smaller pool for those layers.

    A window layer never reads a key older than W tokens before the step's first
    query, so its blocks that end before that point are released while the
    sequence runs (the table keeps `NULL_BLOCK` in their place, so a position's
    block index is the same in both tables). Released blocks keep their hash in
    the LRU queue, as in vLLM: a later request with the same prefix can still hit
    them. A prefix hit needs its full-attention blocks and, in the window pool,
    the blocks covering the last W tokens before the hit's end.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_key: str = "", window: int | None = None, num_window_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Root of every hash chain: the model (and adapter, when there are any), so
        # a cache can never be matched across weights.
        self.root_hash = hashlib.blake2b(b"macinfer:" + cache_key.encode(), digest_size=16).digest()
        self.pool = BlockPool(num_blocks)
        self.window = window
        self.window_pool = BlockPool(num_window_blocks, reserve_null=True) if window else None
        if self.window_pool is not None and self.window_pool.num_usable < 1:
            raise ValueError("the sliding-window KV pool needs at least one block")
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found in the cache

    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def cached(self) -> dict[bytes, int]:
        return self.pool.cached

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.pool.free_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.pool.free_blocks)

    @property
    def num_used_window_blocks(self) -> int:
        wp = self.window_pool
        return 0 if wp is None else wp.num_usable - len(wp.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    # -- hashing --------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Chained hashes of seq's first num_full_blocks blocks (memoised on seq)."""
        hashes = seq.block_hashes
        tokens = None
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            tokens = tokens or seq.token_ids
            i = len(hashes)
            parent = hashes[-1] if hashes else self.root_hash
            hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs], seq.cache_salt))
        return hashes[:num_full_blocks]

    def first_window_block(self, position: int) -> int:
        """Index of the first block a query at `position` (or later) can read in a window layer."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0

    # -- allocation -------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix to a sequence with no blocks yet.

        Returns the number of tokens now cached (a multiple of block_size). At
        least one token is always left to compute, so the step yields logits.
        """
        assert not seq.block_table and not seq.window_block_table
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position's logits
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.prefix_queries += seq.num_tokens
        hashes = self._hashes(seq, max_blocks)
        hits = 0
        while hits < max_blocks and hashes[hits] in self.pool.cached:
            hits += 1
        if self.window_pool is not None:
            # run[i]: cached window blocks ending at block i (consecutive)
            wcached = self.window_pool.cached
            run, n = [], 0
            for h in hashes[:hits]:
                n = n + 1 if h in wcached else 0
                run.append(n)
            while hits and run[hits - 1] < hits - self.first_window_block(hits * self.block_size):
                hits -= 1
        for h in hashes[:hits]:
            block_id = self.pool.cached[h]
            self.pool.hit(block_id)
            seq.block_table.append(block_id)
        if self.window_pool is not None and hits:
            first = self.first_window_block(hits * self.block_size)
            seq.window_block_table.extend([NULL_BLOCK] * first)
            for h in hashes[first:hits]:
                block_id = self.window_pool.cached[h]
                self.window_pool.hit(block_id)
                seq.window_block_table.append(block_id)
        self.prefix_hits += hits * self.block_size
        return hits * self.block_size

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back the window-pool blocks no query of `seq` will read again."""
        if self.window_pool is None:
            return
        table = seq.window_block_table
        for i in range(seq.num_released_window_blocks, self.first_window_block(seq.num_computed_tokens)):
            if table[i] != NULL_BLOCK:
                self.window_pool.release(table[i])
                table[i] = NULL_BLOCK
        seq.num_released_window_blocks = max(seq.num_released_window_blocks,
                                             self.first_window_block(seq.num_computed_tokens))

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New full-attention blocks `seq` needs so that `num_tokens` tokens fit in its table."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit; first releases `seq`'s out-of-window blocks."""
        if self.blocks_needed(seq, num_tokens) > len(self.pool.free_blocks):
            return False
        if self.window_pool is None:
            return True
        self.release_out_of_window(seq)
        need = max(0, cdiv(num_tokens, self.block_size) - len(seq.window_block_table))
        return need <= len(self.window_pool.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block tables to hold `num_tokens` tokens, evicting LRU cached blocks."""
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError("out of KV blocks; call can_allocate first")
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self.pool.take())
        if self.window_pool is not None:
            table = seq.window_block_table
            first = self.first_window_block(seq.num_computed_tokens)
            while len(table) < first:  # positions already behind the window: never stored
                table.append(NULL_BLOCK)
            while len(table) < cdiv(num_tokens, self.block_size):
                table.append(self.window_pool.take())

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish the hashes of blocks that are full once `num_computed_tokens`
        tokens are in the cache. Called at schedule time: any sequence that
        matches them reads them in the same forward pass or later, after the
        batch's K/V writes, so they are complete by then. If that forward pass
        fails, the engine withdraws every published hash (`drop_cache`)."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        start = seq.num_committed_blocks  # only new full blocks: host work per step stays flat
        if full <= start:
            return
        self._hashes(seq, full)
        hashes = seq.block_hashes  # memoised, at least `full` long now (no slice copy)
        seq.num_committed_blocks = full
        for i in range(start, full):
            self.pool.publish(seq.block_table[i], hashes[i])
            if self.window_pool is not None and seq.window_block_table[i] != NULL_BLOCK:
                self.window_pool.publish(seq.window_block_table[i], hashes[i])

    def drop_cache(self) -> None:
        """Forget every cached block: after a failed step the K/V pools are reset, so
        no hash, published in that step or earlier, names real K/V any more."""
        for pool in (self.pool, self.window_pool):
            if pool is not None:
                pool.drop_cache()

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the shared-prefix heads.
        for bid in reversed(seq.block_table):
            self.pool.release(bid)
        for bid in reversed(seq.window_block_table):
            if bid != NULL_BLOCK:
                self.window_pool.release(bid)
        seq.block_table = []
        seq.window_block_table = []
        seq.num_committed_blocks = 0
        seq.num_released_window_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
