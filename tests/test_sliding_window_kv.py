"""Sliding-window layers keep only their window in the KV cache.

Their blocks live in a second pool; blocks that end before the window of the
next query are given back while the sequence runs, prefix hits need the
window's tail, and the memory budget buys more full-attention blocks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from macinfer.engine.block_manager import BlockManager
from macinfer.engine.kv_groups import NULL_BLOCK
from macinfer.kv.spec import CacheGroup, ChunkedLocal, FullAttention, SlidingWindow, cdiv
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, mlx_lm_greedy, save_model_dir

W, BS = 8, 4


def _seq(tokens, name="s") -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(), 0)


def _manager(kind, full_blocks=64, bounded_blocks=40) -> BlockManager:
    return BlockManager([CacheGroup(0, FullAttention(), (0,), num_blocks=full_blocks),
                         CacheGroup(1, kind, (1,), num_blocks=bounded_blocks)], BS)


def _check(bm: BlockManager, live: list[Sequence], step_tokens: dict) -> None:
    """Reference counts equal owners in both groups; the null block is never owned or free;
    nothing a query can still read was released."""
    full, bounded = bm.groups
    for g in bm.groups:
        owners: dict[int, int] = {}
        for s in live:
            for b in s.block_tables[g.group.index]:
                if g.kind.bounded and b == NULL_BLOCK:
                    continue
                owners[b] = owners.get(b, 0) + 1
        for block in g.pool.blocks:
            assert block.ref_count == owners.get(block.block_id, 0)
        assert set(g.pool.free_blocks).isdisjoint(owners)
        assert len(g.pool.free_blocks) + len(owners) == g.pool.num_usable
    assert NULL_BLOCK not in bounded.pool.free_blocks
    for s in live:
        first = bounded.first_block(s.num_computed_tokens)
        table = s.block_tables[1]
        assert NULL_BLOCK not in table[first:], "a block a query still reads was released"
        held = sum(b != NULL_BLOCK for b in table)
        # Released at schedule time: the live span plus the last step's tokens stay.
        span = W - 1 if isinstance(bounded.kind, SlidingWindow) else W
        assert held <= cdiv(span + step_tokens[s.request_id], BS) + 1


@pytest.mark.parametrize("kind", [SlidingWindow(W), ChunkedLocal(W)], ids=["window", "chunked"])
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 2)), min_size=1, max_size=40))
def test_bounded_pool_invariants_under_random_schedules(kind, ops):
    bm = _manager(kind)
    live: list[Sequence] = []
    step_tokens: dict[str, int] = {}
    for n, (op, length, prefix) in enumerate(ops):
        if op == 0 or not live:  # admit: a prompt sharing one of three prefixes
            seq = _seq([prefix] * 12 + list(range(100 + n, 100 + n + length)), f"s{n}")
            seq.num_computed_tokens = bm.match_prefix(seq)
            if not bm.can_allocate(seq, seq.num_tokens):
                bm.free(seq)
                continue
            bm.allocate(seq, seq.num_tokens)
            bm.commit(seq, seq.num_tokens)
            step_tokens[seq.request_id] = seq.num_tokens - seq.num_computed_tokens
            seq.num_computed_tokens = seq.num_tokens
            live.append(seq)
        elif op in (1, 2):  # decode a few tokens
            seq = live[length % len(live)]
            for _ in range(op * 3):
                seq.output_token_ids.append(7)
                if not bm.can_allocate(seq, seq.num_tokens):
                    break
                bm.allocate(seq, seq.num_tokens)
                bm.commit(seq, seq.num_tokens)
                step_tokens[seq.request_id] = 1
                seq.num_computed_tokens = seq.num_tokens
        else:
            bm.free(live.pop(length % len(live)))
        _check(bm, live, step_tokens)
    for s in live:
        bm.free(s)
    assert all(g.pool.num_used == 0 for g in bm.groups)


def _cached(kind) -> BlockManager:
    """A manager whose cache holds the blocks of a finished 30-token sequence."""
    bm = _manager(kind, 32, 32)
    a = _seq(range(30), "a")
    bm.allocate(a, 30)
    bm.commit(a, 30)
    a.num_computed_tokens = 30
    bm.free(a)
    return bm


def test_prefix_hit_needs_the_window_tail():
    bm = _cached(SlidingWindow(W))
    window = bm.groups[1]
    b = _seq(range(30), "b")
    assert bm.match_prefix(b) == 28  # 7 full blocks; the last W tokens' blocks are cached
    assert b.block_tables[1][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in b.block_tables[1][5:]
    bm.free(b)
    # Evict the window block holding tokens 24..27: the hit falls back to where a tail is cached.
    victim = window.pool.cached[b.block_hashes[6]]
    window.pool.free_blocks.move_to_end(victim, last=False)  # next in LRU order
    assert window.pool.take() == victim
    c = _seq(range(30), "c")
    assert bm.match_prefix(c) == 24


def test_prefix_hit_needs_the_current_chunk():
    """Chunked local attention: a hit at position p needs the blocks of p's chunk only."""
    bm = _cached(ChunkedLocal(W))
    b = _seq(range(30), "b")
    assert bm.match_prefix(b) == 28
    # position 28's chunk starts at 24: blocks 0..5 are not needed
    assert b.block_tables[1][:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in b.block_tables[1][6:]
    bm.free(b)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    config = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, vocab_size=300,
                  max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=2,
                  query_pre_attn_scalar=32.0, sliding_window=W, sliding_window_pattern=4,
                  rope_local_base_freq=10000.0)
    ref = make_mlx_lm_model(config, seed=3)
    return config, ref, save_model_dir(str(tmp_path_factory.mktemp("gemma3")), config, ref)


@pytest.mark.parametrize("kernels", ["reference", "emulate"])
def test_window_blocks_are_released_and_tokens_match_mlx_lm(gemma3, kernels, monkeypatch):
    monkeypatch.setenv("MACINFER_KERNELS", kernels)
    _, ref, path = gemma3
    prompts = [list(range(3, 53)), list(range(60, 90))]
    want = [mlx_lm_greedy(ref, p, 30) for p in prompts]
    engine = LLMEngine(path, EngineConfig(block_size=BS, kv_cache_gb=0.01, max_num_batched_tokens=16))
    bm = engine.block_manager
    assert [(g["kind"], g["layers"]) for g in engine.cache_groups()] == \
        [("full attention", [3]), (f"sliding window {W}", [0, 1, 2])]
    window = bm.groups[1].pool
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done, peak_window = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        peak_window = max(peak_window, window.num_used)
        if engine.num_running == 2 and not engine.num_waiting:
            # Two sequences of up to 80 tokens hold ~40 full-attention blocks but
            # only their windows (plus a step's tokens) in the window pool.
            assert window.num_used <= 2 * (cdiv(W - 1, BS) + 2) + cdiv(16, BS)
    assert [done[i].token_ids for i in ids] == want
    assert peak_window < cdiv(80 + 60, BS) / 2
    assert all(g.pool.num_used == 0 for g in bm.groups)
    again = generate(engine, [prompts[0]], params)[0]
    assert again.token_ids == want[0] and again.num_cached_tokens == 48


def test_budget_buys_full_attention_blocks(gemma3):
    _, _, path = gemma3
    budget = 0.004
    engine = LLMEngine(path, EngineConfig(block_size=BS, kv_cache_gb=budget, max_num_seqs=4))
    kv = engine.kv_cache
    full, window = kv.groups
    assert kv.nbytes <= budget * 2**30
    assert window.num_blocks == 4 * (cdiv(W - 1, BS) + 2) + cdiv(512, BS) + 1
    # One full-attention layer of four: once the window pool is paid for, the
    # same bytes hold about 4x the tokens of four full-attention layers.
    per_layer_block = 2 * BS * 2 * 32 * kv.dtype.size
    assert full.num_blocks > 3 * (budget * 2**30 // (4 * per_layer_block))
    groups = engine.cache_groups()
    assert [g["bytes_per_token"] for g in groups] == [per_layer_block // BS, 3 * per_layer_block // BS]


def test_speculative_drafts_across_window_blocks_match_mlx_lm(gemma3):
    """Drafts write K/V past the window's tail and are rolled back when rejected:
    greedy tokens still match mlx-lm, and every window block comes back."""
    _, ref, path = gemma3
    prompt = list(range(3, 23)) * 3
    want = mlx_lm_greedy(ref, prompt, 40)
    engine = LLMEngine(path, EngineConfig(block_size=BS, kv_cache_gb=0.01, num_speculative_tokens=4,
                                          prompt_lookup_min=1))
    out = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert engine.stats["spec_draft_tokens"] > 0  # (this random model's drafts are all rejected)
    assert out.token_ids == want
    bm = engine.block_manager
    assert all(g.pool.num_used == 0 for g in bm.groups)
