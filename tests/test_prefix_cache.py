"""Prefix caching end to end on a tiny model: reuse, isolation, preemption, no leaks."""

import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    from macinfer.loading.loader import load

    return load(tiny_llama)


def _engine(loaded, **kw):
    return LLMEngine(loaded, EngineConfig(kv_cache_gb=kw.pop("kv_cache_gb", 0.02), max_model_len=2048, **kw))


def _engine_with_blocks(loaded, num_blocks, **kw):
    from macinfer.kv.cache import bytes_per_block

    per_block = bytes_per_block(2, 2, 16, 16, _engine(loaded, kv_cache_gb=0.001).kv_cache.dtype)
    engine = LLMEngine(loaded, EngineConfig(kv_cache_gb=num_blocks * per_block / 2**30, **kw))
    assert engine.block_manager.num_blocks == num_blocks
    return engine


def _run(engine, rid, prompt, params=GREEDY, salt=None):
    engine.add_request(prompt, params, rid, cache_salt=salt)
    while True:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o


def test_second_request_prefills_only_its_new_tokens(loaded):
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 300, size=1000).tolist()
    first, second = prefix + rng.integers(3, 300, size=20).tolist(), prefix + rng.integers(3, 300, size=15).tolist()
    engine = _engine(loaded)
    _run(engine, "a", first)
    before = engine.stats["prompt_tokens"]
    hot = _run(engine, "b", second)
    assert hot.num_cached_tokens == 992  # 62 full 16-token blocks of the shared 1,000
    assert engine.stats["prompt_tokens"] - before == len(second) - 992
    cold = _run(_engine(loaded, enable_prefix_caching=False), "b", second)
    assert cold.num_cached_tokens == 0
    assert hot.token_ids == cold.token_ids
    # Salted requests neither see nor expose unsalted entries, only their own salt's.
    assert _run(engine, "c", second, salt="tenant-1").num_cached_tokens == 0
    assert _run(engine, "d", second, salt="tenant-2").num_cached_tokens == 0
    assert _run(engine, "e", second, salt="tenant-1").num_cached_tokens == 1008
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_choices_admitted_together_share_prompt_blocks(loaded):
    engine = _engine(loaded)
    prompt = list(range(5, 70))
    for i in range(3):
        engine.add_request(prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=4), f"n{i}")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["n0"].num_cached_tokens == 0
    assert outs["n1"].num_cached_tokens == outs["n2"].num_cached_tokens == 64
    assert engine.stats["prompt_tokens"] == 65 + 1 + 1


def test_preempted_sequence_finds_its_blocks_again(loaded):
    engine = _engine_with_blocks(loaded, 12, max_num_batched_tokens=64)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, size=40).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hits > 0  # resumed sequences reused their blocks
    roomy = _engine(loaded, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == _run(roomy, f"r{i}", p, params).token_ids


def test_no_block_leaks_after_random_requests_with_aborts(loaded):
    rng = np.random.default_rng(3)
    engine = _engine_with_blocks(loaded, 24, max_num_seqs=8, max_num_batched_tokens=96)
    bm = engine.block_manager
    shared = [rng.integers(3, 300, size=80).tolist() for _ in range(3)]
    live: list[str] = []
    for i in range(200):
        prompt = shared[rng.integers(3)][: rng.integers(0, 80)] + rng.integers(3, 300, size=rng.integers(1, 30)).tolist()
        params = SamplingParams(temperature=float(rng.choice([0.0, 1.0])), max_tokens=int(rng.integers(1, 12)),
                                seed=i, ignore_eos=True)
        live.append(engine.add_request(prompt, params, f"q{i}", cache_salt=str(rng.choice(["", "s"])) or None))
        if rng.random() < 0.25:
            engine.abort_request(live.pop(rng.integers(len(live))))
        for _ in range(int(rng.integers(0, 3))):
            for o in engine.step():
                if o.finished:
                    live.remove(o.request_id)
        owned = {}
        for seq in engine.scheduler.running:
            for b in seq.block_table:
                owned[b] = owned.get(b, 0) + 1
        assert all(bm.blocks[b].ref_count == owned.get(b, 0) for b in range(bm.num_blocks))
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.prefix_hits > 0 and engine.scheduler.num_preemptions > 0
