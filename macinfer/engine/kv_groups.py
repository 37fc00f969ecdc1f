"""One cache group's blocks (vLLM v1's block pool and single-type managers): the pool of a
group's block ids with its prefix-cache hashes and LRU free queue (`BlockPool`), and the
group's rules for allocating, releasing, prefix hits and publishing, which differ by kind
only through the kind's `key_floor` and `stored_keys` (`GroupBlocks`). `BlockManager`
(`block_manager.py`) holds one a group and iterates them."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from macinfer.engine.sequence import Sequence
from macinfer.kv.spec import CacheGroup, cdiv


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
    the kinds differ in `key_floor`, the lowest key a query reads, and `unread_blocks`).

    A bounded kind (sliding window, chunked local) never reads a key below the floor
    of the step's first query, so its blocks that end before it are released while the
    sequence runs (the table keeps `NULL_BLOCK` in their place, so a position's block
    index is the same in every group); the prompt-and-window kind releases its output's
    blocks behind the window, a hole between the prompt and the window. Released blocks
    keep their hash in the LRU queue, as in vLLM: a later request with the same prefix can
    still hit them. A prefix hit of m blocks needs, in this group, the blocks from the floor
    of the position after the hit up to m (for full attention: all m)."""

    def __init__(self, group: CacheGroup, block_size: int):
        self.group, self.kind, self.block_size = group, group.kind, block_size
        self.index = group.index  # its block tables in `seq.block_tables`, its records' key on the disk
        self.pool = BlockPool(group.num_blocks, reserve_null=group.kind.holds_null)
        if self.pool.num_usable < 1:
            raise ValueError(f"the KV cache group of {group.kind.describe()} needs at least one block")

    def first_block(self, position: int) -> int:
        """Index of the first block a query at `position` (or later) reads."""
        return int(self.kind.key_floor(position)) // self.block_size

    def release_unreachable(self, seq: Sequence) -> None:
        """Give back the blocks no query of `seq` will read again (the kind's `unread_blocks`)."""
        if not self.kind.holds_null:
            return
        g = self.group.index
        table = seq.block_tables[g]
        span = self.kind.unread_blocks(seq.num_prompt_tokens, seq.num_computed_tokens, self.block_size)
        stop = min(span.stop, len(table))
        for i in range(max(span.start, seq.num_released_blocks[g]), stop):
            if table[i] != NULL_BLOCK:
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
        seq.num_released_blocks[g] = max(seq.num_released_blocks[g], stop)

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
            if table[i] != NULL_BLOCK or not self.kind.holds_null:
                self.pool.publish(table[i], seq.block_hashes[i])

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the shared-prefix heads.
        tables = seq.block_tables
        for bid in reversed(tables[self.group.index] if self.group.index < len(tables) else []):
            if bid != NULL_BLOCK or not self.kind.holds_null:
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
