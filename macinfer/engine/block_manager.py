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
from macinfer.engine.state_group import StateGroup
from macinfer.kv.spec import CacheGroup, FullAttention, cdiv


def block_hash(parent: bytes, tokens: list[int], salt: str | None, images: bytes = b"") -> bytes:
    """A block's key: its tokens, its parent's key, the request's salt, and the content of
    any image whose placeholder tokens it holds (the tokens alone are the same for all images)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    if images:
        h.update(b"\x00image\x00" + images)
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


NULL_BLOCK = 0  # a bounded group's placeholder for a released block (never allocated)


class BlockPool:
    """The blocks of one group: reference counts, the LRU free queue, the hash index."""

    def __init__(self, num_blocks: int, reserve_null: bool = False):
        self.blocks = [Block(i) for i in range(num_blocks)]
        first = 1 if reserve_null else 0
        # Free blocks in eviction order (least recently freed first).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_usable = num_blocks - first
        self.on_evict = None  # (block id, hash) of a cached block about to be reused: the disk tier

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self.free_blocks)

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
                if self.on_evict is not None:
                    self.on_evict(block_id, block.block_hash)
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


class GroupBlocks:
    """One cache group's blocks and its rules (vLLM v1's single-type managers, in one class:
    the kinds differ only in `key_floor`, the lowest key a query reads).

    A bounded kind (sliding window, chunked local) never reads a key below the floor
    of the step's first query, so its blocks that end before it are released while the
    sequence runs (the table keeps `NULL_BLOCK` in their place, so a position's block
    index is the same in every group). Released blocks keep their hash in the LRU
    queue, as in vLLM: a later request with the same prefix can still hit them. A
    prefix hit of m blocks needs, in this group, the blocks from the floor of the
    position after the hit up to m (for full attention: all m)."""

    def __init__(self, group: CacheGroup, block_size: int):
        self.group, self.kind, self.block_size = group, group.kind, block_size
        self.index = group.index  # its block tables in `seq.block_tables`, its records' key on the disk
        self.pool = BlockPool(group.num_blocks, reserve_null=group.kind.bounded)
        if self.pool.num_usable < 1:
            raise ValueError(f"the KV cache group of {group.kind.describe()} needs at least one block")

    def first_block(self, position: int) -> int:
        """Index of the first block a query at `position` (or later) reads."""
        return int(self.kind.key_floor(position)) // self.block_size

    def release_unreachable(self, seq: Sequence) -> None:
        """Give back the blocks no query of `seq` will read again (bounded kinds)."""
        if not self.kind.bounded:
            return
        g = self.group.index
        table = seq.block_tables[g]
        first = min(self.first_block(seq.num_computed_tokens), len(table))
        for i in range(seq.num_released_blocks[g], first):
            if table[i] != NULL_BLOCK:
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
        seq.num_released_blocks[g] = max(seq.num_released_blocks[g], first)

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Whether `num_tokens` tokens of `seq` fit leaving `reserve` blocks free; first
        releases its unreachable blocks."""
        self.release_unreachable(seq)
        return self.blocks_needed(seq, num_tokens) + reserve <= len(self.pool.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        table = seq.block_tables[self.group.index]
        start = max(len(table), self.first_block(seq.num_computed_tokens)) if self.kind.bounded else len(table)
        return max(0, cdiv(self.kind.stored_keys(num_tokens), self.block_size) - start)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        table = seq.block_tables[self.group.index]
        if self.kind.bounded:
            first = self.first_block(seq.num_computed_tokens)
            while len(table) < first:  # positions already behind the floor: never stored
                table.append(NULL_BLOCK)
        while len(table) < cdiv(self.kind.stored_keys(num_tokens), self.block_size):
            table.append(self.pool.take())

    def longest_hit(self, hashes: list[bytes], limit: int, disk=None) -> int:
        """The most leading blocks (at most `limit`) this group can serve as a prefix hit,
        from memory or from the disk tier."""
        cached, g = self.pool.cached, self.group.index
        run, n = [], 0  # run[i]: cached blocks ending at block i, consecutive
        for h in hashes[:limit]:
            n = n + 1 if h in cached or (disk is not None and disk.has_block(g, h)) else 0
            run.append(n)
        m = limit
        while m and (span := self.hit_range(m)) and run[span.stop - 1] < len(span):
            m -= 1
        return m

    def hit_range(self, hits: int) -> range:
        """The block indices a hit of `hits` blocks takes in this group."""
        n = hits * self.block_size
        return range(self.first_block(n) if hits else 0, cdiv(self.kind.stored_keys(n), self.block_size))

    def read_disk(self, hashes: list[bytes], hits: int, reads: dict, disk) -> int | None:
        """Read the hit's blocks memory lacks into `reads` ((group, index) -> arrays); None
        when all read back and fit the free blocks, else the block count the hit must stay under."""
        cached, gi = self.pool.cached, self.group.index
        span = self.hit_range(hits)
        free = len(self.pool.free_blocks) - sum(
            1 for i in span if hashes[i] in cached and self.pool.blocks[cached[hashes[i]]].ref_count == 0)
        for i in span:
            if hashes[i] in cached or (gi, i) in reads:
                continue
            if free <= 0:
                return i
            record = disk.read_block(gi, hashes[i])
            if record is None:  # corrupt, or gone since the lookup: recomputed from here on
                return i
            reads[gi, i] = record
            free -= 1
        return None

    def attach(self, seq: Sequence, hashes: list[bytes], hits: int, reads: dict | None = None,
               disk=None) -> int:
        """Take the hit blocks: those in memory by reference, then (`reads`: (group, index)
        -> arrays read from the disk tier) fresh blocks filled from the disk. Returns how
        many came from the disk."""
        table = seq.block_tables[self.group.index]
        span = self.hit_range(hits)
        table.extend([NULL_BLOCK] * span.start)
        seq.num_released_blocks[self.group.index] = span.start
        ids = []
        for i in span:  # memory first: a take below must not evict a block of this hit
            block_id = self.pool.cached.get(hashes[i])
            if block_id is not None:
                self.pool.hit(block_id)
            ids.append(block_id)
        restored = []
        for k, i in enumerate(span):
            if ids[k] is None:
                ids[k] = self.pool.take()
                restored.append((ids[k], reads[self.group.index, i]))
                self.pool.publish(ids[k], hashes[i])
        if restored:
            disk.restore_blocks(self.group.index, restored)
        table.extend(ids)
        return len(restored)

    def publish(self, seq: Sequence, start: int, end: int) -> None:
        table = seq.block_tables[self.group.index]
        for i in range(start, min(end, len(table))):
            if table[i] != NULL_BLOCK or not self.kind.bounded:
                self.pool.publish(table[i], seq.block_hashes[i])

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the shared-prefix heads.
        tables = seq.block_tables
        for bid in reversed(tables[self.group.index] if self.group.index < len(tables) else []):
            if bid != NULL_BLOCK or not self.kind.bounded:
                self.pool.release(bid)

    def drop_cache(self) -> None:
        self.pool.drop_cache()

    def attach_disk(self, disk) -> None:
        self.pool.on_evict = lambda block_id, h: disk.evicted_block(self.index, block_id, h)

    def disk_entries(self, disk) -> list[tuple[str, int, int]]:
        """What the disk tier writes at close: every cached block it lacks."""
        return [(disk.block_key(self.index, h), self.index, bid) for h, bid in list(self.pool.cached.items())
                if disk.block_key(self.index, h) not in disk.store]

    def stats(self) -> dict:
        return {"kind": self.kind.describe(), "layers": list(self.group.layers), "block_size": self.block_size,
                "blocks_total": self.pool.num_usable, "blocks_used": self.pool.num_used,
                "blocks_cached": len(self.pool.cached)}


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
        max_blocks = (seq.num_tokens - 1) // self.block_size
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
        full = num_computed_tokens // self.block_size
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
