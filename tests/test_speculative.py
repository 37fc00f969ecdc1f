"""Speculative decoding by prompt lookup: drafts, verification, and the same tokens
as without it (greedy and seeded sampling, penalties, stops, prefix cache)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from macinfer.engine.kv_groups import block_hash
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.sampler import sample
from macinfer.engine.sequence import Sequence
from macinfer.engine.speculative import SpeculativeConfig, accepted_tokens, propose_ngram, verify_rows
from macinfer.sampling_params import SamplingParams
from tests.helpers import tiny_model_dir

REPEAT = list(range(3, 23)) * 3  # a prompt whose continuation the lookup can guess


def test_lookup_takes_what_followed_the_latest_longest_match():
    t = np.array([5, 6, 7, 8, 1, 5, 6, 9, 9, 5, 6])
    # suffix [5, 6]: latest earlier occurrence at 5 -> followed by 9, 9, 5
    assert propose_ngram(t, 3, 2, 4) == [9, 9, 5]
    # a longer suffix wins over a later short one: [1, 2, 3] recurs at 0, [2, 3] at 5 too
    t = np.array([1, 2, 3, 40, 41, 2, 3, 50, 1, 2, 3])
    assert propose_ngram(t, 2, 2, 3) == [40, 41]
    assert propose_ngram(t, 2, 2, 2) == [50, 1]


def test_lookup_without_a_match_or_room():
    assert propose_ngram(np.array([1, 2, 3, 4]), 4, 2, 4) == []
    assert propose_ngram(np.array([7, 7]), 4, 2, 4) == []  # the suffix itself is no match
    assert propose_ngram(np.array([7, 7, 7]), 4, 1, 2) == [7]  # only one token follows the match
    assert propose_ngram(np.array([9]), 4, 1, 4) == []


def test_acceptance_keeps_the_confirmed_prefix_and_one_more():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all: plus the bonus token
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # first mismatch is the correction
    assert accepted_tokens([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accepted_tokens([], [3]) == [3]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_each_draft_row_samples_as_if_its_drafts_were_output(seed):
    """Same noise position and penalty history as the sequence itself would have."""
    import mlx.core as mx

    params = SamplingParams(temperature=1.0, seed=seed, repetition_penalty=1.5, frequency_penalty=0.5)
    seq = Sequence("r", [1, 2, 3], params, seed, output_token_ids=[4, 5])
    seq.spec_token_ids = [6, 7, 6]
    logits = mx.array(np.random.default_rng(seed).normal(size=(4, 12)).astype(np.float32))
    got = sample(logits, verify_rows(seq)).token_ids
    for j in range(4):
        alone = Sequence("r", [1, 2, 3], params, seed, output_token_ids=[4, 5] + seq.spec_token_ids[:j])
        assert got[j] == sample(logits[j : j + 1], [alone]).token_ids[0]


def test_config_is_checked():
    with pytest.raises(ValueError):
        SpeculativeConfig(0)
    with pytest.raises(ValueError):
        SpeculativeConfig(3, min_n=3, max_n=2)


def _run(engine, prompts, params_list):
    """Outputs in order; every streamed delta is checked to add up to the final output."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    text = {i: "" for i in ids}
    toks = {i: [] for i in ids}
    done = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        _check_committed_blocks(engine)
        for o in outputs:
            text[o.request_id] += o.delta_text
            toks[o.request_id] += o.delta_token_ids
            if o.finished:
                done[o.request_id] = o
    for i in ids:
        assert text[i] == done[i].text and toks[i] == done[i].token_ids
    return [done[i] for i in ids]


def _check_committed_blocks(engine):
    """Published blocks hold computed, verified tokens only, hashed as they are."""
    bm = engine.block_manager
    for seq in engine.scheduler.running:
        assert seq.num_committed_blocks * bm.block_size <= seq.num_computed_tokens
        parent = bm.root_hash
        for i in range(seq.num_committed_blocks):
            parent = block_hash(parent, seq.token_ids[i * bm.block_size : (i + 1) * bm.block_size], seq.cache_salt)
            assert seq.block_hashes[i] == parent


def _engine(path, **kw):
    kw.setdefault("speculative_max_batch", 4)  # a fixed threshold (None: measured, tested below)
    return LLMEngine(path, EngineConfig(kv_cache_gb=0.01, max_model_len=2048, **kw))


MIXED = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=40,
                   ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # ends inside an accepted run
    SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[9], ignore_eos=True),
]


@pytest.fixture(scope="module")
def head32(tmp_path_factory):
    """head_dim 32: what an int8 KV cache needs."""
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("head32"), "llama", num_attention_heads=2,
                             num_key_value_heads=1)
    return path


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_same_tokens_with_and_without_speculation(head32, kv_cache_dtype):
    prompts = [REPEAT, REPEAT[5:], REPEAT[2:], REPEAT, [9, 10, 11, 12, 13] * 6]
    plain = _run(_engine(head32, kv_cache_dtype=kv_cache_dtype), prompts, MIXED)
    engine = _engine(head32, num_speculative_tokens=4, speculative_max_batch=8, kv_cache_dtype=kv_cache_dtype)
    spec = _run(engine, prompts, MIXED)
    assert engine.stats["spec_draft_tokens"] > 0 and engine.stats["spec_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert b.text == a.text
        assert [lp.token_id for lp in b.logprobs] == [lp.token_id for lp in a.logprobs]
        np.testing.assert_allclose([lp.logprob for lp in b.logprobs], [lp.logprob for lp in a.logprobs],
                                   rtol=1e-4, atol=1e-4)
    assert engine.block_manager.num_used_blocks == 0


def test_prefix_cache_holds_only_verified_tokens(tiny_llama):
    """Blocks written while drafts were checked are reused by a later request whose
    prompt is the first one's prompt + output: it must see the accepted tokens' K/V."""
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine = _engine(tiny_llama, num_speculative_tokens=5, block_size=16)
    first = _run(engine, [REPEAT], [greedy])[0]
    assert engine.stats["spec_accepted_tokens"] > 0
    follow = REPEAT + first.token_ids + [4, 5]
    again = _run(engine, [follow], [greedy])[0]
    assert again.num_cached_tokens >= 96
    cold = _run(_engine(tiny_llama), [follow], [greedy])[0]
    assert again.token_ids == cold.token_ids


def test_no_drafts_above_the_batch_limit_or_without_blocks(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = _engine(tiny_llama, num_speculative_tokens=4, speculative_max_batch=2)
    _run(engine, [REPEAT] * 3, [greedy] * 3)  # three decode together: never speculates
    assert engine.stats["spec_draft_tokens"] == 0
    _run(engine, [REPEAT] * 2, [greedy] * 2)
    assert engine.stats["spec_draft_tokens"] > 0
    # A pool with exactly the blocks the sequence needs: no block is spent on drafts.
    tight = LLMEngine(tiny_llama, EngineConfig(num_kv_blocks=6, block_size=16, num_speculative_tokens=4))
    out = _run(tight, [REPEAT], [SamplingParams(temperature=0, max_tokens=34, ignore_eos=True)])[0]
    assert len(out.token_ids) == 34 and tight.scheduler.num_preemptions == 0


def test_grammar_requests_speculate_within_the_grammar(tiny_llama):
    """Drafts are cut where the grammar refuses them and every draft row is masked for
    the state after the drafts before it: same output as without speculation."""
    from llguidance import grammar_from

    grammar = grammar_from("regex", "(abc ){6}")
    params = [SamplingParams(temperature=0, max_tokens=30, grammar=grammar),
              SamplingParams(temperature=0.8, seed=4, max_tokens=30, grammar=grammar)]
    prompts = ["abc abc abc abc abc abc ", "abc abc abc "]
    plain = _run(_engine(tiny_llama), prompts, params)
    engine = _engine(tiny_llama, num_speculative_tokens=4)
    spec = _run(engine, prompts, params)
    assert engine.stats["spec_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.text == "abc " * 6


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(3, 20), st.integers(2, 30), st.booleans()),
                min_size=1, max_size=6),
       st.integers(5, 12))
def test_tight_pool_preemption_and_aborts_keep_speculation_exact(tiny_llama, requests, num_blocks):
    """Random requests (repeating prompts of random period and length, random max_tokens,
    some aborted) on a pool small enough to preempt: the ones that finish match a plain
    engine's greedy tokens, and every block comes back."""
    prompts = [[3 + (i % period) for i in range(length)] for period, length, _, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, _, n, _ in requests]
    config = dict(num_kv_blocks=num_blocks, block_size=8, max_model_len=64, max_num_batched_tokens=32)
    want = _run(LLMEngine(tiny_llama, EngineConfig(**config)), prompts, params)  # the same context limit
    engine = LLMEngine(tiny_llama, EngineConfig(**config, num_speculative_tokens=4))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if steps == 3:
            for rid, (_, _, _, abort) in zip(ids, requests):
                if abort and rid not in done:
                    engine.abort_request(rid)
        _check_committed_blocks(engine)
    for rid, w in zip(ids, want):
        if rid in done:
            assert done[rid].token_ids == w.token_ids
    assert engine.block_manager.num_used_blocks == 0


def test_the_speculation_batch_threshold_is_the_first_batch_past_the_cost():
    from macinfer.engine.spec_batch import threshold

    assert threshold({1: 1.2, 2: 1.3, 4: 1.45, 8: 2.0}) == 4
    assert threshold({1: 1.2, 2: 1.6, 4: 1.1}) == 1  # a noisy cheap batch past a costly one does not count
    assert threshold({1: 1.9, 2: 2.5}) == 1  # a single stream asked to speculate still may


def test_the_speculation_batch_is_measured_once_per_device_and_cached(tiny_llama, monkeypatch):
    from macinfer.engine import spec_batch

    calls = []
    measure = spec_batch.measure
    monkeypatch.setattr(spec_batch, "measure", lambda *a: calls.append(a) or measure(*a))
    engine = _engine(tiny_llama, num_speculative_tokens=3, max_num_seqs=4, speculative_max_batch=None)
    assert len(calls) == 1 and engine.block_manager.num_used_blocks == 0  # the probe's blocks given back
    ratios = measure(engine, 3, [1, 2, 4])
    assert set(ratios) == {1, 2, 4} and all(r > 0 for r in ratios.values())
    assert 1 <= engine.scheduler.speculative.max_batch <= 4
    again = _engine(tiny_llama, num_speculative_tokens=3, max_num_seqs=4, speculative_max_batch=None)
    assert len(calls) == 1 and again.scheduler.speculative.max_batch == engine.scheduler.speculative.max_batch
    assert _engine(tiny_llama, num_speculative_tokens=3, speculative_max_batch=2).scheduler.speculative.max_batch == 2
    monkeypatch.setenv("MACINFER_AUTOTUNE", "0")
    assert _engine(tiny_llama, num_speculative_tokens=5, max_num_seqs=4,
                   speculative_max_batch=None).scheduler.speculative.max_batch == \
        spec_batch.DEFAULT
    assert len(calls) == 1
