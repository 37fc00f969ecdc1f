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

from macinfer.engine.kv_groups import Block, BlockPool, GroupBlocks, block_hash
from macinfer.engine.sequence import Sequence
from macinfer.engine.state_group import StateGroup
from macinfer.kv.spec import CacheGroup, FullAttention


class BlockManager:
    """Block tables of every sequence, one per K/V cache group (`macinfer.kv.spec`), the
    recurrent state's group where the model has one, and the prefix cache. The groups
    share one hash chain: a block index names the same tokens in every group. A prefix
    hit is the longest that every group can serve. Every rule of a kind of cache lives in
    its group class (`GroupBlocks`, `StateGroup`); this class only iterates them."""

    def __init__(self, groups: list[CacheGroup] | int, block_size: int, enable_prefix_caching: bool = True,
                 cache_key: str = "", state: StateGroup | None = None):
        if isinstance(groups, int):  # one full-attention group of this many blocks
            groups = [CacheGroup(0, FullAttention(), (), num_blocks=groups)]
        if groups and groups[0].num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Root of every hash chain: the model (and adapter, when there are any), so
        # a cache can never be matched across weights.
        self.root_hash = hashlib.blake2b(b"macinfer:" + cache_key.encode(), digest_size=16).digest()
        self.kv_groups = [GroupBlocks(g, block_size) for g in groups]
        # Kinds whose K/V past some position depend on where a sequence's prompt ended
        # (`PromptAndWindow`): blocks past it are never shared.
        self.shared_limits = [g.kind.shared_positions for g in groups if hasattr(g.kind, "shared_positions")]
        # Recurrent state (hybrid and recurrent models): a slot per sequence, snapshots for hits.
        self.state = state
        self.groups: list[GroupBlocks | StateGroup] = [*self.kv_groups, *([state] if state is not None else [])]
        # A model with no attention (Mamba, RWKV) has no K/V groups: nothing to count.
        self.pool = self.kv_groups[0].pool if self.kv_groups else BlockPool(0)
        self.num_blocks = groups[0].num_blocks if groups else 0
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found in the cache
        self.disk = None  # the prefix cache's disk tier (`engine/disk_cache.py`), when on

    def attach_disk(self, disk) -> None:
        self.disk = disk
        for g in self.groups:
            g.attach_disk(disk)

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
        return self.pool.num_used

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    def _tables(self, seq: Sequence) -> None:
        if len(seq.block_tables) != len(self.kv_groups):
            seq.block_tables = [[] for _ in self.kv_groups]
            seq.num_released_blocks = [0] * len(self.kv_groups)

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
            images = seq.images.block_key(i * bs, (i + 1) * bs) if seq.images is not None else b""
            hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs], seq.cache_salt, images))
        return hashes[:num_full_blocks]

    # -- allocation -------------------------------------------------------------
    def match_prefix(self, seq: Sequence, limit: int | None = None) -> int:
        """Attach the longest cached prefix (at most `limit` tokens) to a sequence with no
        blocks yet.

        Returns the number of tokens now cached (a multiple of block_size). At
        least one token is always left to compute, so the step yields logits.
        """
        self._tables(seq)
        assert not any(seq.block_tables)
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position's logits
        max_blocks = min((seq.num_tokens - 1) // self.block_size, self._shareable(seq))
        if limit is not None:
            max_blocks = min(max_blocks, limit // self.block_size)
        self.prefix_queries += seq.num_tokens
        hashes = self._hashes(seq, max_blocks)
        disk = self.disk if self.disk is not None and self.disk.enabled else None
        reads: dict = {}
        hits = self._agree(hashes, max_blocks, disk)
        while disk is not None and hits:  # what memory lacks comes from the disk, if it reads back whole
            bad = self._read_disk(hashes, hits, reads)
            if bad is None:
                break
            hits = self._agree(hashes, bad, disk)
        restored = [g.attach(seq, hashes, hits, reads, disk) for g in self.groups]
        self.prefix_hits += hits * self.block_size
        if disk is not None and restored:  # tokens the disk served (the first group's)
            disk.hit_tokens += restored[0] * self.block_size
        return hits * self.block_size

    def _shareable(self, seq: Sequence) -> int:
        """The blocks of `seq` another sequence may share: all, or those below where its
        groups' kinds say its K/V stop being what any sequence computes alike."""
        return min((limit(seq.num_prompt_tokens) for limit in self.shared_limits), default=1 << 62) // self.block_size

    def _agree(self, hashes: list[bytes], limit: int, disk) -> int:
        """The longest hit (at most `limit` blocks) every group can serve."""
        hits, prev = limit, -1
        while hits != prev:  # each group may shorten the hit; stop when all agree
            prev = hits
            for g in self.groups:
                hits = g.longest_hit(hashes, hits, disk)
        return hits

    def _read_disk(self, hashes: list[bytes], hits: int, reads: dict) -> int | None:
        """Read what memory lacks of the hit into `reads`; None when all read back and fit,
        else the block count the hit must stay under."""
        for g in self.groups:
            bad = g.read_disk(hashes, hits, reads, self.disk)
            if bad is not None:
                return bad
        return None

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs in the first group so that `num_tokens` tokens fit."""
        self._tables(seq)
        return self.kv_groups[0].blocks_needed(seq, num_tokens) if self.kv_groups else 0

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Whether `num_tokens` tokens fit, leaving `reserve` free blocks in every group;
        first releases `seq`'s unreachable blocks."""
        self._tables(seq)
        return all(g.can_allocate(seq, num_tokens, reserve) for g in self.groups)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block tables to hold `num_tokens` tokens, evicting LRU cached blocks."""
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError("out of KV blocks; call can_allocate first")
        for g in self.groups:
            g.allocate(seq, num_tokens)

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish the hashes of blocks that are full once `num_computed_tokens`
        tokens are in the cache. Called at schedule time: any sequence that
        matches them reads them in the same forward pass or later, after the
        batch's K/V writes, so they are complete by then. If that forward pass
        fails, the engine withdraws every published hash (`drop_cache`)."""
        if not self.enable_prefix_caching:
            return
        full = min(num_computed_tokens // self.block_size, self._shareable(seq))
        start = seq.num_committed_blocks  # only new full blocks: host work per step stays flat
        if full <= start:
            return
        self._hashes(seq, full)
        seq.num_committed_blocks = full
        for g in self.groups:
            g.publish(seq, start, full)

    def drop_cache(self) -> None:
        """Forget every cached block: after a failed step the K/V pools are reset, so
        no hash, published in that step or earlier, names real K/V any more."""
        for g in self.groups:
            g.drop_cache()

    def free(self, seq: Sequence) -> None:
        for g in self.groups:
            g.free(seq)
        seq.block_tables = [[] for _ in self.kv_groups]
        seq.num_released_blocks = [0] * len(self.kv_groups)
        seq.num_committed_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def stats(self) -> list[dict]:
        """Per group: its kind, layers, blocks (or state slots) total and in use."""
        return [g.stats() for g in self.groups]
