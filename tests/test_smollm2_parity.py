"""Greedy parity with mlx-lm on the real bundled model (SmolLM2-135M Q4_1)."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
FILLERS = [
    "Hi",
    "Explain photosynthesis in one long sentence, please, with details about light.",
    "2+2=",
    "Name a color.",
    "Tell me about the history of Rome, the Republic, the Empire and its fall.",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompts(smollm2_engine):
    tok = smollm2_engine.tokenizer
    chat = lambda q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))  # noqa: E731
    return [chat(q) for q in QUESTIONS], [chat(q) for q in FILLERS]


@pytest.fixture(scope="module")
def reference(smollm2_mlx_dir, prompts):
    model, _ = mlx_lm_load(smollm2_mlx_dir)
    out = []
    for ids in prompts[0]:
        gen = generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1))
        out.append([int(t) for t, _ in gen])
    return out


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_greedy_alone_matches_mlx_lm(smollm2_engine, prompts, reference):
    for ids, ref in zip(prompts[0], reference):
        rid = smollm2_engine.add_request(ids, _greedy())
        done = None
        while done is None:
            done = next((o for o in smollm2_engine.step() if o.request_id == rid and o.finished), None)
        assert done.token_ids == ref


def test_greedy_batched_with_joiners_matches_mlx_lm(smollm2_gguf, prompts, reference):
    # A small token budget forces chunked prefill to share steps with decodes.
    engine = LLMEngine(smollm2_gguf, EngineConfig(kv_cache_gb=0.1, max_model_len=1024, max_num_batched_tokens=48))
    targets, fillers = prompts
    arrivals = {0: [("t0", targets[0]), ("f0", fillers[0])], 1: [("f1", fillers[1])],
                2: [("t1", targets[1]), ("f2", fillers[2])], 4: [("f3", fillers[3])],
                5: [("t2", targets[2])], 7: [("f4", fillers[4])]}
    finished, step, max_batch = {}, 0, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, ids in arrivals.get(step, []):
            # Fillers get varied lengths, so sequences leave at different steps too.
            engine.add_request(ids, _greedy() if rid[0] == "t" else SamplingParams(temperature=0, max_tokens=6 + step, ignore_eos=True), rid)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        max_batch = max(max_batch, engine.num_running)
        step += 1
    assert max_batch >= 5, "the requests never actually shared a batch"
    assert [finished[f"t{i}"] for i in range(3)] == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
