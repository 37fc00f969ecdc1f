"""Scheduler: chunked prefill, budgets, preemption and resume on a tiny model."""

import numpy as np
import pytest

from macinfer.engine.block_manager import BlockManager
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.scheduler import Scheduler
from macinfer.engine.sequence import Sequence, SequenceStatus
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate


def _seq(n, name, start=3):
    return Sequence(name, list(range(start, start + n)), SamplingParams(), 0)


def test_token_budget_chunks_prefill_and_puts_decodes_first():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _seq(25, "a"), _seq(4, "b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled == [(a, 10)]  # budget exhausted by a's first chunk
    a.num_computed_tokens += 10
    out = sched.schedule()
    assert out.scheduled == [(a, 10)]
    a.num_computed_tokens += 10
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 5), ("b", 4)]
    a.num_computed_tokens += 5
    b.num_computed_tokens += 4
    a.output_token_ids.append(7)
    b.output_token_ids.append(7)
    c = _seq(30, "c", start=100)  # no prefix in common with a
    sched.add(c)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 1), ("c", 8)]


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(_seq(3, f"s{i}"))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_block_shortage_preempts_newest():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    old, new = _seq(8, "old"), _seq(8, "new")
    sched.add(old)
    sched.add(new)
    sched.schedule()
    for s in (old, new):
        s.num_computed_tokens = 8
        s.output_token_ids.append(5)
    out = sched.schedule()  # both need a 3rd block; only the newest gives way
    assert out.preempted == [new]
    assert [s for s, _ in out.scheduled] == [old]
    assert new.status == SequenceStatus.WAITING and new.num_computed_tokens == 0 and not new.block_table
    assert sched.waiting[0] is new


def _run(engine: LLMEngine, prompts, params):
    return [o.token_ids for o in generate(engine, prompts, params)]


@pytest.mark.parametrize("sampled", [False, True])
def test_preemption_and_resume_give_the_same_tokens(tiny_llama, sampled):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in rng.integers(5, 40, size=6)]
    params = SamplingParams(temperature=0.8 if sampled else 0.0, seed=11, max_tokens=40, ignore_eos=True)
    roomy = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, block_size=4))
    expected = _run(roomy, prompts, params)
    # 24 blocks of 4 tokens cannot hold six sequences of up to 79 tokens: forced preemption.
    tight = _tight_engine(tiny_llama, num_blocks=24)
    assert tight.block_manager.num_blocks == 24
    got = _run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def _tight_engine(path, num_blocks):
    from macinfer.kv.cache import bytes_per_block

    probe = LLMEngine(path, EngineConfig(kv_cache_gb=0.001, block_size=4))
    per_block = bytes_per_block(2, 2, 16, 4, probe.kv_cache.dtype)
    return LLMEngine(probe.loaded, EngineConfig(kv_cache_gb=num_blocks * per_block / 2**30, block_size=4, max_num_batched_tokens=16))


def test_token_slice_equals_slicing_the_full_token_list():
    seq = Sequence("a", [1, 2, 3], SamplingParams(), 0)
    seq.output_token_ids = [4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert seq.token_slice(start, end) == seq.token_ids[start:end]


def test_prefill_cap_while_decoding_bounds_the_step():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=32, max_prefill_with_decodes=6)
    a, long = _seq(5, "a"), _seq(40, "long", start=200)
    sched.add(a)
    out = sched.schedule()
    assert out.scheduled == [(a, 5)]  # nothing decodes yet: the whole budget
    a.num_computed_tokens += 5
    a.output_token_ids.append(7)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_tokens:
        out = sched.schedule()
        assert out.scheduled[0] == (a, 1)  # the decode goes on every step
        chunks.append(sum(n for s, n in out.scheduled if s is long))
        for s, n in out.scheduled:
            s.num_computed_tokens += n
        a.output_token_ids.append(7)
    assert chunks == [6] * 6 + [4]  # at most 6 prompt tokens a step while `a` decodes
    sched.finish(a, "stop")
    long.output_token_ids.append(7)
    other = _seq(40, "other", start=400)
    sched.add(other)
    out = sched.schedule()  # `long` decodes now, so `other` is capped too
    assert [(s.request_id, n) for s, n in out.scheduled] == [("long", 1), ("other", 6)]


def test_under_the_cap_prompts_go_shortest_remaining_first():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=32, max_prefill_with_decodes=6)
    a, long = _seq(5, "a"), _seq(40, "long", start=200)
    sched.add(a)
    a.num_computed_tokens += sched.schedule().num_tokens
    a.output_token_ids.append(7)
    sched.add(long)

    def step() -> dict[str, int]:
        out = sched.schedule()
        for s, n in out.scheduled:
            s.num_computed_tokens += n
        a.output_token_ids.append(7)
        return {s.request_id: n for s, n in out.scheduled}

    assert step() == {"a": 1, "long": 6}
    short = _seq(8, "short", start=400)  # arrives while `long` is mid-prompt
    sched.add(short)
    assert step() == {"a": 1, "short": 6}  # 8 left beats 34 left
    assert step() == {"a": 1, "short": 2, "long": 4}
    short.output_token_ids.append(7)
    assert step() == {"a": 1, "short": 1, "long": 6}  # both decode; `long` goes on


def test_a_zero_prefill_cap_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="max_prefill_with_decodes"):
        LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, max_prefill_with_decodes=0))
