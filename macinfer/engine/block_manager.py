"""Block manager: which KV blocks each sequence owns.

Blocks are fixed-size (block_size tokens) slabs of the paged KV cache. A
sequence's block table lists its block ids in order; token i lives in slot
`block_table[i // block_size] * block_size + i % block_size`. Reference
counts let several sequences share a block (forked prompts); a block returns
to the free list when its count drops to zero.
"""

from __future__ import annotations

from collections import deque

from macinfer.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Block:
    __slots__ = ("block_id", "ref_count")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that `num_tokens` tokens fit in its table."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_block_ids):
            raise RuntimeError("out of KV blocks; call can_allocate first")
        for _ in range(need):
            block = self.blocks[self.free_block_ids.popleft()]
            assert block.ref_count == 0
            block.ref_count = 1
            seq.block_table.append(block.block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's blocks with the child (copy-on-write is the caller's job)."""
        for bid in parent.block_table:
            self.blocks[bid].ref_count += 1
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                self.free_block_ids.append(bid)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
