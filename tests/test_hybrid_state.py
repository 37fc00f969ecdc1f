"""Hybrid and recurrent models on the paged engine (issue #22): the state plan, slots,
snapshots for prefix hits, agent loops, speculation and grammars on recurrent state.

Every family's parity with mlx-lm (chunked prefill, requests joining and leaving,
preemption, a prefix hit) is in tests/test_architecture_matrix.py; here the
mechanisms, on tiny Qwen3-Next (Gated DeltaNet + attention) and Mamba-2 (no attention).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.structured import json_schema_grammar
from macinfer.kv.spec import StateSpec
from macinfer.kv.state import StateCall, StatePool, SeqChunk, plan_state, slot_runs
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, save_model_dir
from tests.test_architecture_matrix import _reference_greedy
from tests.zoo import tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_next", "mamba2"])
def hybrid(request, tmp_path_factory):
    config = tiny_config(request.param)
    model = make_mlx_lm_model(config, seed=3)
    return save_model_dir(str(tmp_path_factory.mktemp(request.param)), config, model), model


def _engine(path, **kw):
    kw = {"kv_cache_gb": 0.02, "state_snapshot_interval": 32, **kw}
    return LLMEngine(path, EngineConfig(model_impl="mlx-lm", **kw))


def test_plan_groups_equal_chunks_and_cuts_segments():
    """Decodes run as one call, prompt chunks of equal length as another; a cut splits a
    chunk into rounds; the inverse permutation puts rows back in order."""
    chunks = [SeqChunk(0, 1, 5, False), SeqChunk(1, 1, 6, False), SeqChunk(2, 4, 7, True),
              SeqChunk(6, 4, 8, True), SeqChunk(10, 3, 9, False, cuts=[(1, 40), (3, 41)])]
    plan = plan_state(chunks)
    first = [(c.n, c.length, c.fresh, c.slots.tolist()) for c in plan.rounds[0]]
    # the cut sequence's first token runs with the decodes
    assert first == [(3, 1, False, [5, 6, 9]), (2, 4, True, [7, 8])]
    assert [(c.n, c.length) for c in plan.rounds[1]] == [(1, 2)]
    assert plan.rounds[0][0].saves == [(2, 40)] and plan.rounds[1][0].saves == [(0, 41)]
    assert plan.rounds[0][0].runs == [(0, 5, 2), (2, 9, 1)]  # slots 5, 6 then 9
    order = np.concatenate([np.array(c.rows) for r in plan.rounds for c in r])
    assert np.array(order)[np.array(plan.inverse)].tolist() == list(range(13))


def test_state_slots_are_budgeted_and_given_back(hybrid):
    path, _ = hybrid
    engine = _engine(path, max_num_seqs=4)
    pool = engine.kv_cache.states
    assert pool is not None and pool.num_slots >= 2 * 4
    assert pool.bytes_per_slot == sum(s.nbytes for s in engine.state_specs) > 0
    assert engine.kv_cache.nbytes >= pool.nbytes  # counted with the K/V
    generate(engine, [list(range(5, 60)), list(range(70, 90))], GREEDY)
    assert len(engine.block_manager.state.free_running) == 4  # every running slot is back
    assert engine.block_manager.stats()[-1]["kind"] == "recurrent state"


def test_agent_loop_hits_the_previous_turn(hybrid):
    """Five turns, each the previous prompt + its answer + a tool result: from turn 2 on
    most of the prompt is cached and the tokens equal a cold engine's."""
    path, _ = hybrid
    warm, cold = _engine(path), _engine(path, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 290, 70).tolist()
    fractions = []
    for turn in range(5):
        out = generate(warm, [prompt], GREEDY)[0]
        assert out.token_ids == generate(cold, [prompt], GREEDY)[0].token_ids
        if turn:
            fractions.append(out.num_cached_tokens / len(prompt))
        prompt = prompt + out.token_ids + rng.integers(3, 290, 9).tolist()
    assert min(fractions) > 0.6, fractions


def test_snapshots_are_evicted_least_recently_used(hybrid):
    path, _ = hybrid
    engine = _engine(path, max_num_seqs=2)
    state = engine.block_manager.state
    total = state.pool.num_slots - state.num_running
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 290, 40).tolist() for _ in range(total + 3)]  # more than snapshot slots
    params = SamplingParams(temperature=0, max_tokens=2)
    for p in prompts:
        generate(engine, [p], params)
    assert len(state.snapshots) + len(state.free_snapshots) == total  # no slot leaked
    # the oldest prompt's snapshot was evicted; the newest one's still hits
    assert generate(engine, [prompts[0]], params)[0].num_cached_tokens == 0
    assert generate(engine, [prompts[-1]], params)[0].num_cached_tokens == 32


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=4, max_tokens=30, ignore_eos=True)])
def test_speculation_gives_the_same_tokens(hybrid, params):
    """Rejected drafts leave nothing in the recurrent state: the state before the verify
    step is restored and the accepted tokens are computed again."""
    path, _ = hybrid
    prompts = [[7, 8, 9, 10, 11] * 8, list(range(20, 60)), [40, 41, 42] * 10]
    plain = generate(_engine(path), prompts, params)
    engine = _engine(path, num_speculative_tokens=3, prompt_lookup_min=1)
    spec = generate(engine, prompts, params)
    assert engine.stats["spec_draft_tokens"] > engine.stats["spec_accepted_tokens"]  # some rejected
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_speculation_matches_mlx_lm_greedy(hybrid):
    path, model = hybrid
    prompt = [7, 8, 9, 10, 11] * 8
    engine = _engine(path, num_speculative_tokens=4, prompt_lookup_min=1)
    out = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))[0]
    assert engine.stats["spec_draft_tokens"] > 0
    assert out.token_ids == _reference_greedy(model, prompt, 25, None)


def test_grammar_on_a_hybrid_model(hybrid):
    """Constrained decoding keeps working, speculation on or off."""
    path, _ = hybrid
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0.7, seed=2, max_tokens=40, grammar=json_schema_grammar(schema))
    outs = [generate(_engine(path, num_speculative_tokens=k, prompt_lookup_min=1), [list(range(30, 70))], params)[0]
            for k in (0, 3)]
    assert outs[0].token_ids == outs[1].token_ids
    import json

    assert outs[0].finish_reason == "length" or isinstance(json.loads(outs[0].text)["a"], int)


def test_a_failed_step_resets_states_and_snapshots(hybrid, monkeypatch):
    path, _ = hybrid
    engine = _engine(path)
    want = generate(engine, [list(range(5, 50))], GREEDY)[0].token_ids
    state = engine.block_manager.state
    assert state.snapshots
    calls = {"n": 0}
    original = engine.runner.forward_logits

    def failing(scheduled):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return original(scheduled)

    monkeypatch.setattr(engine.runner, "forward_logits", failing)
    out = generate(engine, [list(range(5, 50)), list(range(100, 130))], GREEDY)
    assert all(o.finish_reason == "error" for o in out)
    assert not state.snapshots and len(state.free_running) == state.num_running
    monkeypatch.setattr(engine.runner, "forward_logits", original)
    assert generate(engine, [list(range(5, 50))], GREEDY)[0].token_ids == want


def test_accepted_and_rejected_drafts_keep_the_right_state(hybrid, monkeypatch):
    """An oracle drafter (the true continuation, its last draft wrong every other step):
    accepted runs and rejections both leave the state after the last accepted token."""
    from macinfer.engine import scheduler

    path, _ = hybrid
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = list(range(30, 70))
    want = generate(_engine(path), [prompt], params)[0].token_ids
    calls = {"n": 0}

    def oracle(seq, k, min_n, max_n):
        drafts = list(want[seq.num_output_tokens : seq.num_output_tokens + k])
        calls["n"] += 1
        if calls["n"] % 2 and len(drafts) > 1:
            drafts[-1] = 3 + (drafts[-1] + 1) % 290
        return drafts

    monkeypatch.setattr(scheduler, "propose", oracle)
    engine = _engine(path, num_speculative_tokens=3)
    assert generate(engine, [prompt], params)[0].token_ids == want
    st = engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st


def test_served_over_http(hybrid):
    """A recurrent model behind the server: completions, streamed chat, status and metrics."""
    import httpx

    from tests.server_process import ServerProcess

    path, _ = hybrid
    s = ServerProcess(path, "--served-model-name", "h", "--kv-cache-gb", "0.02", "--max-num-seqs", "4")
    try:
        body = {"model": "h", "prompt": "abc abc", "max_tokens": 5, "temperature": 0}
        a, b = (httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json() for _ in range(2))
        assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["completion_tokens"] == 5
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", timeout=60, json={
                "model": "h", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
            assert r.status_code == 200 and "data: [DONE]" in r.read().decode()
        kv = httpx.get(f"{s.url}/status").json()["kv"]
        assert kv["groups"][-1]["kind"] == "recurrent state" and kv["groups"][-1]["bytes"] > 0
        assert httpx.get(f"{s.url}/metrics").status_code == 200
    finally:
        assert "Traceback" not in s.stop()


def test_states_are_written_in_place_after_requests_finish(hybrid):
    """Steps update the state pool in place, also the steps whose finished requests
    move slots: a slot copy read and written in one graph copied the whole pool array,
    and copies left pending into the next step made every later step copy whole pool
    arrays too (1.5-2x slower decode steps on Mamba-2 at 32 sequences)."""
    path, _ = hybrid
    engine = _engine(path, max_num_seqs=8, kv_cache_gb=0.2, enable_prefix_caching=False)
    largest = max(a.nbytes for a in engine.kv_cache.states.state())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for batch in range(2):  # the first batch's 8 finish together: 4 slots move
        for i in range(8):
            engine.add_request([5 + i, 9, 13, 17 + batch], params)
        peaks = []
        while engine.has_unfinished_requests():
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            engine.step()
            mx.eval(engine.kv_cache.state())
            peaks.append(mx.get_peak_memory() - before)
    assert max(peaks) < largest / 2, (peaks, largest)  # not even the steps that moved slots


def test_resident_states_behave_as_written_slots():
    """The pool keeps a call's new states resident instead of writing them into their
    slots; under any mix of calls, slot copies and snapshot writes, what every read
    sees is what plain slots would hold (a NumPy model of the slots), and a repeated
    call reads its states as they were left, without going through the pool."""
    rng = np.random.default_rng(0)
    specs = [StateSpec(((2, 3), (4,)), (mx.float32, mx.float32)), StateSpec(((5,),), (mx.float32,))]
    pool = StatePool(specs, 12)
    ref = [[np.zeros((12, *s), np.float32) for s in spec.shapes] for spec in specs]

    def call(slots):
        return StateCall(rows=None, n=len(slots), length=1, slots=mx.array(slots, dtype=mx.int32), fresh=False,
                         runs=slot_runs(slots))

    batch = call(list(range(6)))
    for step in range(300):
        op = rng.integers(6)
        cache = int(rng.integers(2))
        if op <= 2:  # a step's call: mostly the same decode batch, sometimes others
            c = batch if op < 2 else call(sorted(rng.choice(12, int(rng.integers(1, 7)), replace=False).tolist()))
            got = pool.gather(cache, c)
            for e, g in enumerate(got):
                np.testing.assert_array_equal(np.array(g), ref[cache][e][np.array(c.slots)])
            new = [None if rng.random() < 0.2 else np.asarray(g) * 0.5 + step for g in got]
            pool.scatter(cache, c, [None if v is None else mx.array(v) for v in new])
            for e, v in enumerate(new):
                if v is not None:
                    ref[cache][e][np.array(c.slots)] = v
            if op < 2 and rng.random() < 0.3:  # a snapshot written from the new state
                dst = int(rng.integers(12))
                vals = [None if v is None else v[:1] for v in new]
                pool.write(cache, dst, [None if v is None else mx.array(v) for v in vals])
                for e, v in enumerate(vals):
                    if v is not None:
                        ref[cache][e][dst] = v[0]
        elif op == 3:  # a slot moved or a snapshot restored: every cache
            src, dst = (int(x) for x in rng.choice(12, 2, replace=False))
            pool.copy(src, dst)
            for entries in ref:
                for a in entries:
                    a[dst] = a[src]
        elif op == 4:
            mx.eval(pool.state())
        else:
            batch = call(sorted(rng.choice(12, 6, replace=False).tolist()))
    assert pool.resident  # the decode batch's states were held, not written back each step
    pool.flush_slots()
    assert not pool.resident
    for entries, ref_entries in zip(pool.arrays, ref):
        for a, r in zip(entries, ref_entries):
            np.testing.assert_array_equal(np.array(a), r)
