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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_key: str = ""):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Root of every hash chain: the model (and adapter, when there are any), so
        # a cache can never be matched across weights.
        self.root_hash = hashlib.blake2b(b"macinfer:" + cache_key.encode(), digest_size=16).digest()
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (least recently freed first).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found in the cache

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

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

    # -- allocation -------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix to a sequence with no blocks yet.

        Returns the number of tokens now cached (a multiple of block_size). At
        least one token is always left to compute, so the step yields logits.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.prefix_queries += seq.num_tokens
        hits = 0
        for h in self._hashes(seq, max_blocks):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            hits += 1
        self.prefix_hits += hits * self.block_size
        return hits * self.block_size

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that `num_tokens` tokens fit in its table."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens, evicting LRU cached blocks."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError("out of KV blocks; call can_allocate first")
        for _ in range(need):
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_count == 0
            if block.block_hash is not None:  # evict its cached contents
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)

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
            h = hashes[i]
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = h
                self.cached.setdefault(h, block.block_id)

    def drop_cache(self) -> None:
        """Forget every cached block: after a failed step the K/V pools are reset, so
        no hash, published in that step or earlier, names real K/V any more."""
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the shared-prefix heads.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_blocks[bid] = None
                    self.free_blocks.move_to_end(bid, last=False)  # nothing cached: reuse first
                else:
                    self.free_blocks[bid] = None
        seq.block_table = []
        seq.num_committed_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
