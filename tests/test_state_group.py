"""Recurrent state as a cache group (`engine/state_group.py`): the block manager treats it
as any other group, and a step's state transaction survives the next step being built
inside it (a hybrid model speculating while another request joins, with async scheduling)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import macinfer.engine.speculative as speculative
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import make_mlx_lm_model, save_model_dir
from tests.zoo import tiny_config

# Every family of the architecture matrix with recurrent state (the matrix checks this list
# is current: `test_architecture_matrix.py::test_runs_like_mlx_lm`).
STATEFUL = ["bailing_hybrid", "bailing_moe_linear", "falcon_h1", "falcon_mamba", "gear", "granitemoehybrid",
            "jamba", "kimi_k3", "kimi_linear", "lfm2", "lfm2-vl", "lfm2_moe", "mamba", "mamba2", "nemotron_h",
            "longcat_flash_ngram", "olmo_hybrid", "plamo2", "prism_hadamard_qwen35", "qwen3_5", "qwen3_5_moe", "qwen3_next", "recurrent_gemma",
            "rwkv7"]

PARAMS = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, logprobs=1)]


def _run(path: str, spec: bool, async_scheduling: bool) -> tuple[dict, LLMEngine]:
    """One request decoding (speculating: its prompt holds every token, so a draft is always
    found) while two prompts join: `0 < decoding <= speculative_max_batch < running`. Then
    the first prompt once more, which must hit the prefix cache."""
    engine = LLMEngine(path, EngineConfig(
        model_impl="mlx-lm", kv_cache_gb=0.02, state_snapshot_interval=16, max_num_seqs=4, max_model_len=512,
        num_speculative_tokens=3 if spec else 0, speculative_max_batch=1, prompt_lookup_min=1,
        async_scheduling=async_scheduling))
    done: dict[str, tuple] = {}

    def drain(steps: int | None = None) -> None:
        while engine.has_unfinished_requests() and (steps is None or steps > 0):
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = (o.token_ids, [lp.logprob for lp in o.logprobs], o.finish_reason,
                                          o.error, o.num_cached_tokens)
            steps = None if steps is None else steps - 1

    first = list(range(3, 300))
    engine.add_request(first, PARAMS[0], request_id="a")
    drain(1)
    engine.add_request([(7 * j) % 280 + 5 for j in range(40)], PARAMS[1], request_id="b")
    engine.add_request([(11 * j) % 270 + 9 for j in range(24)], PARAMS[0], request_id="c")
    drain()
    engine.add_request(first, PARAMS[0], request_id="again")
    drain()
    return done, engine


@pytest.mark.parametrize("family", STATEFUL)
def test_speculation_with_async_scheduling_on_recurrent_state(family, tmp_path, monkeypatch):
    """n-gram drafts forced (no back-off after rejected drafts): same tokens and logprobs as
    one step at a time and as no speculation, no request in error, drafts rejected (the
    state rewound), the prefix cache intact, every state slot back."""
    monkeypatch.setattr(speculative, "MAX_SKIP", 0)
    config = tiny_config(family)
    path = save_model_dir(str(tmp_path / family), config, make_mlx_lm_model(config, seed=3))
    plain, _ = _run(path, spec=False, async_scheduling=True)
    serial, _ = _run(path, spec=True, async_scheduling=False)
    ahead, engine = _run(path, spec=True, async_scheduling=True)
    assert set(ahead) == set(plain) == {"a", "b", "c", "again"}
    for rid in plain:
        assert ahead[rid][3] is None and ahead[rid][2] == "length", (rid, ahead[rid][3])
        for other in (plain, serial):
            assert ahead[rid][0] == other[rid][0], rid
            assert ahead[rid][1] == pytest.approx(other[rid][1], abs=1e-4), rid
    assert ahead["again"][4] > 0 and ahead["again"][0] == ahead["a"][0]  # the prefix cache survived
    assert engine.stats["spec_draft_tokens"] > 0
    assert engine.runner.ahead_rows > 0
    state = engine.block_manager.state
    assert len(state.free_running) == state.num_running and engine.block_manager.num_used_blocks == 0


def test_a_restore_without_a_keep_is_a_clear_error(tmp_path):
    """The transaction knows what it kept: a rewind of a sequence it never kept raises
    naming the request, never a bare KeyError."""
    config = tiny_config("mamba2")
    path = save_model_dir(str(tmp_path / "m"), config, make_mlx_lm_model(config))
    engine = LLMEngine(path, EngineConfig(model_impl="mlx-lm", kv_cache_gb=0.02, num_speculative_tokens=2))
    engine.add_request([5, 6, 7], PARAMS[0], request_id="x")
    engine.step()
    seq = engine.requests["x"].seq
    step = engine.block_manager.state.begin()
    with pytest.raises(RuntimeError, match="request x"):
        step.restore(seq)


def test_the_block_manager_has_no_state_branch():
    """Every rule of recurrent state lives in its group: the block manager names the state
    only to put it among its groups."""
    src = Path(__file__).parents[1] / "macinfer/engine/block_manager.py"
    tree = ast.parse(src.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            assert "state" not in ast.unparse(node.test), ast.unparse(node.test)
        if isinstance(node, ast.Attribute) and node.attr == "state" and isinstance(node.ctx, ast.Load):
            raise AssertionError(f"block_manager.py reads self.state at line {node.lineno}")
