"""Block manager: ownership, refcounts, prefix-cache sharing, LRU eviction, no leaks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from macinfer.engine.block_manager import BlockManager
from macinfer.engine.kv_groups import NULL_BLOCK
from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams


def _seq(tokens, name="s", salt=None) -> Sequence:
    if isinstance(tokens, int):
        tokens = list(range(tokens))
    return Sequence(name, list(tokens), SamplingParams(), 0, cache_salt=salt)


def _check(bm: BlockManager, live: list[Sequence]) -> None:
    null = bm.groups[0].kind.holds_null  # (block 0 then stands for given-back blocks: nobody's)
    owners: dict[int, int] = {}
    for s in live:
        table = [b for b in s.block_table if not (null and b == NULL_BLOCK)]
        assert len(set(table)) == len(table)
        for b in table:
            owners[b] = owners.get(b, 0) + 1
    for b in range(null, bm.num_blocks):
        assert bm.blocks[b].ref_count == owners.get(b, 0)
    free = set(bm.free_block_ids)
    assert free.isdisjoint(owners), "a block is both free and owned"
    assert len(free) + len(owners) == bm.num_blocks - null
    for h, b in bm.cached.items():
        assert bm.blocks[b].block_hash == h


def _admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a whole-prompt admission."""
    cached = bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens)
    bm.commit(seq, seq.num_tokens)
    return cached


def test_allocate_grows_by_blocks_and_slots_are_distinct():
    bm = BlockManager(8, 4)
    a, b = _seq(5, "a"), _seq(3, "b")
    bm.allocate(a, 5)
    bm.allocate(b, 3)
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    bm.allocate(a, 8)
    assert len(a.block_table) == 2
    bm.allocate(a, 9)
    assert len(a.block_table) == 3
    slots = [bm.slot(a, i) for i in range(9)] + [bm.slot(b, i) for i in range(3)]
    assert len(set(slots)) == len(slots)
    _check(bm, [a, b])
    assert not bm.can_allocate(_seq(40), 40)


def test_shared_prefix_is_taken_by_reference():
    bm = BlockManager(16, 4)
    a = _seq(list(range(10)), "a")
    assert _admit(bm, a) == 0
    b = _seq(list(range(8)) + [99, 98, 97], "b")  # same first two blocks, then diverges
    assert _admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert all(bm.blocks[x].ref_count == 2 for x in a.block_table[:2])
    _check(bm, [a, b])
    # A prompt that is exactly cached keeps its last block to compute (logits need a token).
    c = _seq(list(range(8)), "c")
    assert _admit(bm, c) == 4
    _check(bm, [a, b, c])


def test_salt_isolates_cache_entries():
    bm = BlockManager(16, 4)
    _admit(bm, _seq(list(range(9)), "a", salt="alice"))
    assert _admit(bm, _seq(list(range(9)), "b", salt="bob")) == 0
    assert _admit(bm, _seq(list(range(9)), "c")) == 0
    assert _admit(bm, _seq(list(range(9)), "d", salt="alice")) == 8


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    bm = BlockManager(4, 4)
    old, new = _seq([1] * 8, "old"), _seq([2] * 8, "new")
    _admit(bm, old)
    bm.free(old)
    _admit(bm, new)
    bm.free(new)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 4
    # Two fresh blocks are needed: the least recently freed ones ("old") are evicted.
    x = _seq([3] * 4 + [9], "x")
    _admit(bm, x)
    assert bm.num_cached_blocks == 3  # new's two + x's full block
    bm.free(x)
    assert bm.match_prefix(_seq([1] * 8 + [5], "old2")) == 0
    new2 = _seq([2] * 8 + [5], "new2")
    assert bm.match_prefix(new2) == 8
    _check(bm, [new2])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "free"]), st.integers(0, 50), st.integers(1, 30)), max_size=80))
def test_random_interleavings_keep_invariants(ops):
    bm = BlockManager(24, 4)
    prefixes = [list(range(100, 120)), list(range(200, 220))]  # shared prefixes -> cache hits
    live: list[Sequence] = []
    for op, pick, n in ops:
        if op == "new":
            s = _seq(prefixes[pick % 2][: pick % 20] + [pick] * n, f"s{pick}")
            cached = bm.match_prefix(s)
            assert cached % 4 == 0 and cached < s.num_tokens
            if bm.can_allocate(s, s.num_tokens):
                bm.allocate(s, s.num_tokens)
                bm.commit(s, s.num_tokens)
                live.append(s)
            else:
                bm.free(s)
        elif op == "grow" and live:
            s = live[pick % len(live)]
            s.output_token_ids += [7] * n
            if bm.can_allocate(s, s.num_tokens):
                bm.allocate(s, s.num_tokens)
                bm.commit(s, s.num_tokens)
            else:
                s.output_token_ids = s.output_token_ids[:-n]
        elif op == "free" and live:
            bm.free(live.pop(pick % len(live)))
        _check(bm, live)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_hash_chains_are_rooted_in_the_model():
    a, b = BlockManager(8, 4, cache_key="model-a"), BlockManager(8, 4, cache_key="model-b")
    sa, sb = _seq(list(range(9)), "a"), _seq(list(range(9)), "b")
    _admit(a, sa)
    _admit(b, sb)
    assert sa.block_hashes and set(sa.block_hashes).isdisjoint(sb.block_hashes)


def test_blocks_past_the_prompt_and_its_window_are_never_shared():
    """Under a prompt-and-window kind (Unlimited-OCR), K/V past a sequence's prompt + window
    depend on where its prompt ended: they are neither published nor taken from the cache
    (a causal prompt's blocks at those positions would be wrong for it)."""
    from macinfer.kv.spec import CacheGroup, PromptAndWindow

    bm = BlockManager([CacheGroup(0, PromptAndWindow(4), (0,), num_blocks=32)], 4)
    a = _seq(list(range(6)), "a")  # prompt of 6; blocks whole below 6 + 4 = 10: the first two
    _admit(bm, a)
    a.output_token_ids = list(range(6, 20))
    bm.allocate(a, 20)
    bm.commit(a, 20)
    assert len(bm.cached) == 2
    # A prompt of all 20 tokens (causal throughout) publishes its four full blocks...
    b = _seq(list(range(20)) + [99], "b")
    assert _admit(bm, b) == 8
    assert len(bm.cached) == 5
    # ...which a sequence whose prompt ends at 6 (a preempted one, recomputing) takes only up to 8.
    c = _seq(list(range(6)), "c")
    c.output_token_ids = list(range(6, 21))
    assert bm.match_prefix(c) == 8
    _check(bm, [a, b, c])


def test_blocks_behind_the_window_after_the_prompt_are_given_back():
    """The prompt-and-window kind releases its output's blocks once every later query's
    window has passed them (the hole between prompt and window); the prompt's blocks and
    the window's stay, so a long output holds prompt + window blocks, not all of them."""
    from macinfer.kv.spec import CacheGroup, PromptAndWindow

    bm = BlockManager([CacheGroup(0, PromptAndWindow(4), (0,), num_blocks=32)], 4)
    a = _seq(list(range(6)), "a")  # prompt of 6: blocks 0-1 hold it
    _admit(bm, a)
    most = 0
    for n in range(7, 41):  # decode: the next query at n - 1 reads keys >= n - 4 after the prompt
        a.output_token_ids.append(n)
        a.num_computed_tokens = n - 1
        assert bm.can_allocate(a, n)
        bm.allocate(a, n)
        table = a.block_tables[0]
        hole = range(2, (n - 1 - 4 + 1) // 4)
        assert [i for i, b in enumerate(table) if b == NULL_BLOCK] == list(hole)
        assert bm.num_used_blocks == len(table) - len(hole)
        most = max(most, bm.num_used_blocks)
        _check(bm, [a])
    assert most == 2 + 2  # the prompt's two; the window's 4 keys and the next token straddle two
    assert len(a.block_tables[0]) == 10
    bm.free(a)
    _check(bm, [])
    assert bm.num_used_blocks == 0
