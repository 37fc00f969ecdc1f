"""Block manager invariants: no block owned twice, refcounts, nothing leaks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from macinfer.engine.block_manager import BlockManager
from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams


def _seq(n: int, name: str = "s") -> Sequence:
    return Sequence(name, list(range(n)), SamplingParams(), 0)


def _check(bm: BlockManager, live: list[Sequence]) -> None:
    owners: dict[int, int] = {}
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            owners[b] = owners.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm.blocks[b].ref_count == owners.get(b, 0)
    free = set(bm.free_block_ids)
    assert len(free) == len(bm.free_block_ids), "a block is on the free list twice"
    assert free.isdisjoint(owners), "a block is both free and owned"
    assert len(free) + len(owners) == bm.num_blocks


def test_allocate_grows_by_blocks_and_slots_are_distinct():
    bm = BlockManager(8, 4)
    a, b = _seq(5, "a"), _seq(3, "b")
    bm.allocate(a, 5)
    bm.allocate(b, 3)
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    bm.allocate(a, 8)  # still fits in 2 blocks
    assert len(a.block_table) == 2
    bm.allocate(a, 9)
    assert len(a.block_table) == 3
    slots = [bm.slot(a, i) for i in range(9)] + [bm.slot(b, i) for i in range(3)]
    assert len(set(slots)) == len(slots)
    _check(bm, [a, b])


def test_cannot_allocate_beyond_pool():
    bm = BlockManager(2, 4)
    s = _seq(9)
    assert not bm.can_allocate(s, 9)
    assert bm.can_allocate(s, 8)


def test_fork_shares_blocks_and_free_respects_refcounts():
    bm = BlockManager(6, 4)
    parent, child = _seq(8, "p"), _seq(8, "c")
    bm.allocate(parent, 8)
    bm.fork(parent, child)
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    _check(bm, [parent, child])
    bm.free(parent)
    assert bm.num_free_blocks == 4  # the child still holds both
    _check(bm, [child])
    bm.free(child)
    assert bm.num_free_blocks == 6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 50), st.integers(1, 40)), max_size=80))
def test_random_interleavings_keep_invariants(ops):
    bm = BlockManager(24, 4)
    live: list[Sequence] = []
    for op, pick, n in ops:
        if op == "new":
            s = _seq(n, f"s{len(live)}")
            if bm.can_allocate(s, n):
                bm.allocate(s, n)
                live.append(s)
        elif op == "grow" and live:
            s = live[pick % len(live)]
            target = len(s.block_table) * 4 + n
            if bm.can_allocate(s, target):
                bm.allocate(s, target)
        elif op == "fork" and live:
            c = _seq(1, "fork")
            bm.fork(live[pick % len(live)], c)
            live.append(c)
        elif op == "free" and live:
            bm.free(live.pop(pick % len(live)))
        _check(bm, live)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks
