"""The next decode step built ahead (`engine/lookahead.py`), and a pipeline's two steps in
flight (`engine.multi_rank.pipelined_step`): the same tokens as one step at a time, whatever
happens to the sequences between the step that built or scheduled them and the step that
takes their tokens."""

import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams


def _run(model: str, async_scheduling: bool, num_kv_blocks: int | None = None, depth: int = 1
         ) -> tuple[dict, LLMEngine]:
    """A workload where sequences join, finish on their length, get aborted, (with few
    blocks) preempted and have tokens forced on them while others decode; per request:
    tokens and logprobs."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=num_kv_blocks,
                                           async_scheduling=async_scheduling))
    engine.scheduler.depth = depth  # (one process: what a pipeline's driver runs, without the ranks)
    kinds = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=33, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=3, max_tokens=25,
                       min_tokens=5),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),  # finishes in its prefill step
        SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=30, ignore_eos=True,
                       logit_bias={7: 3.0}),
    ]
    arrivals = {0: [0, 1], 3: [2, 3], 6: [4, 0], 9: [1, 2, 3, 4]}  # step -> kinds arriving
    done: dict[str, tuple] = {}
    step, n, forced = 0, 0, False
    while step in arrivals or engine.has_unfinished_requests():
        for kind in arrivals.get(step, []):
            prompt = [(5 * n + 3 * j) % 200 + 10 for j in range(6 + 5 * n)]
            engine.add_request(prompt, kinds[kind], request_id=f"r{n}")
            n += 1
        if step == 12:
            engine.abort_request("r2")
        r0 = engine.requests.get("r0")
        if r0 is not None and r0.seq.num_output_tokens >= 10 and not forced:
            r0.seq.forced_token_ids = [42, 43]  # a thinking budget's closing marker replaces two draws
            forced = True
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, [lp.logprob for lp in out.logprobs or []],
                                        out.finish_reason)
        step += 1
    return done, engine


@pytest.mark.parametrize("blocks", [None, 24])
def test_the_same_tokens_with_and_without_lookahead(tiny_llama, blocks):
    """Greedy and seeded rows, penalties, logprobs, min_tokens, a bias; sequences finishing
    on their length, one aborted, and with 24 blocks of 16 tokens several preempted: every
    request gives the same tokens and logprobs as the engine that never looks ahead, and
    most decode rows came from a lookahead."""
    plain, off = _run(tiny_llama, False, blocks)
    ahead, on = _run(tiny_llama, True, blocks)
    assert set(plain) == set(ahead) and len(plain) == 9 and "r2" not in plain  # r2: aborted
    for rid in plain:
        assert ahead[rid][0] == plain[rid][0], rid
        assert ahead[rid][1] == pytest.approx(plain[rid][1], abs=1e-5), rid
        assert ahead[rid][2] == plain[rid][2], rid
    assert off.runner.ahead_rows == 0
    generated = sum(len(t) for t, _, _ in plain.values())
    assert on.runner.ahead_rows > 0.8 * generated, (on.runner.ahead_rows, generated)
    if blocks:
        assert on.scheduler.num_preemptions > 0 and on.scheduler.num_preemptions == off.scheduler.num_preemptions
    # Nothing left behind: every block back in the pool.
    assert on.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("blocks", [None, 24])
def test_the_same_tokens_with_two_steps_in_flight(tiny_llama, blocks):
    """A pipeline's scheduling with two steps in flight, run in one process: each step is
    scheduled before the previous one's tokens are taken, without its sequences (never
    preempted while in flight), the aborted one's tokens dropped. Every request's tokens,
    logprobs and finish reason are those of one step at a time; most steps went in while
    another was in flight, and every block is back at the end."""
    plain, _ = _run(tiny_llama, False, blocks)
    flight, engine = _run(tiny_llama, False, blocks, depth=2)
    assert set(flight) == set(plain) and "r2" not in flight
    for rid in plain:
        assert flight[rid][0] == plain[rid][0], rid
        assert flight[rid][1] == pytest.approx(plain[rid][1], abs=1e-5), rid
        assert flight[rid][2] == plain[rid][2], rid
    assert engine.overlapped_steps > 20 and engine._in_flight is None and not engine.scheduler.in_flight
    if blocks:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0


def test_every_token_after_the_first_comes_from_a_lookahead(tiny_llama):
    """One request, 8 tokens: the prompt step draws the first and builds the step of the
    second; each decode builds the next, except the one that draws the last (it would stop
    on its length), so 7 rows are built and all 7 taken."""
    engine = LLMEngine(tiny_llama, EngineConfig(max_num_seqs=4, max_model_len=256))
    engine.add_request(list(range(10, 50)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.ahead_built == 7 and engine.runner.ahead_rows == 7
    assert engine.block_manager.num_used_blocks == 0


def _recurrent_model(family: str, tmp_path) -> str:
    from tests.helpers import make_mlx_lm_model, save_model_dir
    from tests.zoo import tiny_config

    config = tiny_config(family)
    return save_model_dir(str(tmp_path / family), config, make_mlx_lm_model(config))


# Qwen3-Next: Gated DeltaNet + attention; RWKV-7: two modules share a layer's state cache.
@pytest.mark.parametrize("family,blocks", [("qwen3_next", None), ("qwen3_next", 24), ("rwkv7", None)])
def test_recurrent_models_look_ahead_with_the_same_tokens(tmp_path, family, blocks):
    """The step built ahead sets its recurrent states aside; the next step commits the rows
    it takes. Sequences that finish (a slot moves), get aborted or preempted leave their
    states untouched by the lookahead: every request's tokens and logprobs equal one step
    at a time, most decode rows came from a lookahead, every state slot is back."""
    path = _recurrent_model(family, tmp_path)
    plain, off = _run(path, False, blocks)
    ahead, on = _run(path, True, blocks)
    assert set(plain) == set(ahead) and len(plain) == 9
    for rid in plain:
        assert ahead[rid][0] == plain[rid][0], rid
        assert ahead[rid][1] == pytest.approx(plain[rid][1], abs=1e-5), rid
        assert ahead[rid][2] == plain[rid][2], rid
    generated = sum(len(t) for t, _, _ in plain.values())
    assert off.runner.ahead_rows == 0 and on.runner.ahead_rows > 0.8 * generated, (on.runner.ahead_rows, generated)
    assert on.scheduler.num_preemptions == off.scheduler.num_preemptions
    assert len(on.block_manager.state.free_running) == 8 and on.block_manager.num_used_blocks == 0


def test_a_lookahead_takes_the_snapshots_its_steps_take(tmp_path):
    """A decode token that completes a block keeps the sequence's state there (its mark, what
    an agent's next turn resumes from). With the step built ahead that happens when the next
    step takes it: each turn hits exactly as far into the previous answer as one step at a
    time does, and gives the same tokens."""
    path = _recurrent_model("qwen3_next", tmp_path)
    runs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(path, EngineConfig(max_num_seqs=4, max_model_len=512, async_scheduling=async_scheduling))
        prompt, turns = [(7 * j) % 250 + 5 for j in range(21)], []
        for turn in range(3):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=37, ignore_eos=True), request_id=f"t{turn}")
            finished = []
            while engine.has_unfinished_requests():
                finished += [o for o in engine.step() if o.finished]
            out = finished[0]
            turns.append((out.token_ids, out.num_cached_tokens, len(prompt)))
            prompt = prompt + out.token_ids + [11, 12, 13]
        runs.append(turns)
        assert (engine.runner.ahead_rows > 60) == async_scheduling, engine.runner.ahead_rows
    assert runs[0] == runs[1]
    # turn 2 resumes inside turn 1's answer (21 + 37 tokens: the boundary at 48), not at its prompt's end
    assert runs[1][1][1] == 48, runs
