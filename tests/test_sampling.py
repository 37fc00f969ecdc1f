"""Sampler: masks, penalties, logprobs, seeded reproducibility alone vs batched."""

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine import sampler
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.sampler import sample, uniform_noise
from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate

V = 50


def _logits(rows: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=(rows, V)).astype(np.float32) * 3)


def _seqs(params: SamplingParams, rows: int, seed0: int = 0, outputs: int = 0) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", [1, 2, 3], params, seed0 + i) for i in range(rows)]
    for s in seqs:
        s.output_token_ids = [4] * outputs
    return seqs


def _draws(logits: mx.array, params: SamplingParams, n: int = 300) -> np.ndarray:
    """n draws per row, each with a different seed."""
    rows = logits.shape[0]
    return np.array([sample(logits, _seqs(params, rows, seed0=k * rows)).token_ids for k in range(n)])


def test_greedy_is_argmax():
    logits = _logits(4)
    assert sample(logits, _seqs(SamplingParams(temperature=0), 4)).token_ids == np.argmax(np.array(logits), -1).tolist()


def test_top_k_only_draws_from_the_k_best():
    logits = _logits(3)
    draws = _draws(logits, SamplingParams(temperature=1.5, top_k=3))
    top3 = np.argsort(-np.array(logits), axis=-1)[:, :3]
    for r in range(3):
        assert set(draws[:, r]) <= set(top3[r])
        assert len(set(draws[:, r])) == 3  # and not just the argmax


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = _logits(2, seed=3) / 3  # flat enough that several tokens make up 60%
    draws = _draws(logits, SamplingParams(temperature=1.0, top_p=0.6))
    probs = np.exp(np.array(logits)) / np.exp(np.array(logits)).sum(-1, keepdims=True)
    for r in range(2):
        order = np.argsort(-probs[r])
        before = np.cumsum(probs[r][order]) - probs[r][order]
        allowed = set(order[before < 0.6])
        assert len(allowed) > 1
        assert set(draws[:, r]) <= allowed
        assert len(set(draws[:, r])) > 1


def test_min_p_drops_unlikely_tokens():
    logits = _logits(2, seed=5)
    draws = _draws(logits, SamplingParams(temperature=1.0, min_p=0.2))
    probs = np.exp(np.array(logits)) / np.exp(np.array(logits)).sum(-1, keepdims=True)
    for r in range(2):
        assert set(draws[:, r]) <= set(np.nonzero(probs[r] >= 0.2 * probs[r].max())[0])


def test_sampling_follows_the_distribution():
    logits = mx.array([[0.0, np.log(3.0), -30.0] + [-30.0] * (V - 3)])
    draws = _draws(logits, SamplingParams(temperature=1.0), n=2000)[:, 0]
    assert set(draws) <= {0, 1}
    assert abs((draws == 1).mean() - 0.75) < 0.04


def test_penalties_change_the_choice():
    logits = mx.array([[5.0, 4.9] + [0.0] * (V - 2)])
    seq = Sequence("r", [7], SamplingParams(temperature=0, frequency_penalty=0.5), 0)
    seq.output_token_ids = [0]
    assert sample(logits, [seq]).token_ids == [1]
    rep = Sequence("r", [0], SamplingParams(temperature=0, repetition_penalty=1.5), 0)
    assert sample(logits, [rep]).token_ids == [1]  # 5.0 / 1.5 < 4.9, prompt tokens count
    plain = Sequence("r", [0], SamplingParams(temperature=0), 0)
    assert sample(logits, [plain]).token_ids == [0]


def test_logprobs_are_raw_log_softmax_top_k():
    logits = _logits(2)
    out = sample(logits, _seqs(SamplingParams(temperature=0, logprobs=3), 2))
    ref = np.array(logits) - np.log(np.exp(np.array(logits)).sum(-1, keepdims=True))
    for r in range(2):
        lp, top = out.logprobs[r]
        assert lp == pytest.approx(ref[r].max(), abs=1e-5)
        assert [t for t, _ in top] == np.argsort(-ref[r])[:3].tolist()


def test_invalid_values_are_rejected():
    for kwargs in [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2),
                   dict(max_tokens=0), dict(repetition_penalty=0), dict(presence_penalty=3), dict(n=0), dict(logprobs=50)]:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)


def _generate(engine, prompts, params_list):
    return [o.token_ids for o in generate(engine, prompts, params_list)]


def test_seeded_request_is_reproducible_alone_and_in_a_batch(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, block_size=4, max_num_batched_tokens=24))
    target = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _generate(engine, [target], [params])[0]
    again = _generate(engine, [target], [params])[0]
    rng = np.random.default_rng(0)
    others = [rng.integers(3, 300, size=n).tolist() for n in (3, 17, 30, 9)]
    other_params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in (5, 30, 12, 20)]
    batched = _generate(engine, others[:2] + [target] + others[2:], other_params[:2] + [params] + other_params[2:])[2]
    different_seed = _generate(engine, [target], [SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=99, max_tokens=24, ignore_eos=True)])[0]
    assert alone == again == batched
    assert different_seed != alone


def test_logit_bias_moves_one_row_only():
    import mlx.core as mx

    from macinfer.engine.sampler import sample
    from macinfer.engine.sequence import Sequence
    from macinfer.sampling_params import SamplingParams

    logits = mx.zeros((2, 10)).at[:, 3].add(1.0)  # token 3 is the greedy choice
    seqs = [Sequence("a", [1], SamplingParams(temperature=0, logit_bias={7: 5.0}), 0),
            Sequence("b", [1], SamplingParams(temperature=0), 0)]
    assert sample(logits, seqs).token_ids == [7, 3]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 500.0})


def test_noise_is_strictly_inside_the_unit_interval():
    """An exact 1.0 becomes +inf after the Gumbel transform and wins over every mask:
    the old 24-bit form rounded (2^24 - 1) + 0.5 up to 1.0 once per ~350 steps on a
    49k vocabulary. Every value the top bits can take, and 100k (seed, position) pairs."""
    from macinfer.engine.sampler import bits_to_unit

    top = mx.arange(1 << 23, dtype=mx.uint32) << 9  # every value of the top 23 bits ...
    u = mx.concatenate([bits_to_unit(top), bits_to_unit(top | 0x1FF),  # ... with the low bits all 0 or all 1
                        bits_to_unit(mx.array([0, 0xFFFFFFFF, 0xFFFFFF00, 0xFFFFFF80], dtype=mx.uint32))])
    assert mx.min(u).item() > 0.0 and mx.max(u).item() < 1.0
    g = -mx.log(-mx.log(u))
    assert mx.all(mx.isfinite(g)).item()
    seeds = mx.array((np.arange(100_000, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32))
    steps = mx.array(np.arange(100_000, dtype=np.uint32) % 4096, dtype=mx.uint32)
    for lo in range(0, 100_000, 20_000):
        noise = uniform_noise(seeds[lo : lo + 20_000], steps[lo : lo + 20_000], 512)
        assert mx.min(noise).item() > 0.0 and mx.max(noise).item() < 1.0


def test_top_k_one_at_temperature_one_is_greedy_for_every_seed(monkeypatch):
    """On a SmolLM2-sized vocabulary: 2,000 (seed, position) pairs x 49k tokens, where
    the old noise forced a random token ~6 times. The whole vocabulary sorted (with at
    most `MAX_CANDIDATES` only the best token would be a candidate: no mask to beat)."""
    monkeypatch.setattr(sampler, "MAX_CANDIDATES", 0)
    logits = mx.array(np.random.default_rng(11).normal(size=(8, 49152)).astype(np.float32) * 3)
    greedy = np.array(sample(logits, _seqs(SamplingParams(temperature=0), 8)).token_ids)
    for seed0 in range(0, 2000, 8):
        seqs = _seqs(SamplingParams(temperature=1.0, top_k=1), 8, seed0=seed0)
        for s in seqs:
            s.output_token_ids = list(range(seed0 % 97))  # other output positions too
        assert np.array_equal(np.array(sample(logits, seqs).token_ids), greedy)


def test_top_k_candidates_draw_what_the_whole_sorted_vocabulary_draws(monkeypatch):
    """With every row's top-k at most `MAX_CANDIDATES` only that many tokens are sorted: the
    same draws as the whole vocabulary sorted, with top-p and min-p beside top-k (their
    probabilities over the whole vocabulary), a greedy row among them, over 100 seeds."""
    rng = np.random.default_rng(5)
    logits = mx.array(rng.normal(size=(6, 3000)).astype(np.float32) * 2)
    params = [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.7, top_k=5, top_p=0.6),
              SamplingParams(temperature=1.3, top_k=300, min_p=0.05), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_k=300, top_p=0.3)]

    def draws():
        out = []
        for seed0 in range(0, 600, 6):
            seqs = [Sequence(f"r{i}", [1], p, seed0 + i) for i, p in enumerate(params)]
            out.append(sample(logits, seqs).token_ids)
        return np.array(out)

    few = draws()
    monkeypatch.setattr(sampler, "MAX_CANDIDATES", 0)
    whole = draws()
    assert np.array_equal(few, whole)
    assert len(np.unique(few[:, 0])) > 10 and len(np.unique(few[:, 4])) == 1  # top-k 50 varies; top-k 1 does not


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(tiny_llama):
    """vLLM's min_tokens: EOS, stop token ids and stop strings cannot end the output before
    it has that many tokens, then end it as usual; speculation changes nothing."""
    for spec in (0, 4):
        engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, num_speculative_tokens=spec, prompt_lookup_min=1))
        e = min(engine.tokenizer.eos_token_ids)
        eos = SamplingParams(temperature=0, max_tokens=20, logit_bias={e: 100.0})
        assert generate(engine, [[5, 6, 7]], eos)[0].token_ids == [e]  # EOS first (token ids end with it)
        out = generate(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, logit_bias={e: 100.0},
                                                           min_tokens=5))[0]
        assert len(out.token_ids) == 6 and out.finish_reason == "stop" and out.token_ids.index(e) == 5
        out = generate(engine, [[5, 6, 7]], SamplingParams(temperature=0.8, seed=1, max_tokens=20, min_tokens=3,
                                                           stop_token_ids=[9], logit_bias={9: 100.0}))[0]
        assert len(out.token_ids) == 4 and out.token_ids.index(9) == 3 and out.stop_reason == 9
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
