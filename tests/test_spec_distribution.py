"""Speculative decoding keeps the target's distribution: for every drafter kind, the second
token sampled at temperature 1 over many seeds (a token that comes out of a verify step)
follows the target's exact marginal (chi-square), and a seed repeats its tokens."""

import math

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, tiny_model_dir

SAMPLES = 1200
PROMPT = [1, 40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42]
# Prompt lookup (n-grams from 1 token): every token once, so any first token has a draft.
LOOKUP_PROMPT = [1, *range(3, 300)]


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """P(chi-square >= the statistic), bins of expected count under 5 lumped together
    (Wilson-Hilferty's normal approximation of the chi-square tail)."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    k = int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _marginal_second(engine: LLMEngine, prompt: list[int]) -> np.ndarray:
    """P(second token = v) = sum over first tokens t of p(t | prompt) p(v | prompt, t), from
    the target's own forward (mlx-lm's, one position at a time)."""
    model = engine.model
    first = mx.softmax(model.reference_logits(prompt, [len(prompt)])[-1].astype(mx.float32))
    total = np.zeros(first.shape[0])
    for t in range(first.shape[0]):
        p = float(first[t].item())
        if p > 1e-7:
            nxt = mx.softmax(model.reference_logits(prompt + [t], [len(prompt) + 1])[-1].astype(mx.float32))
            total += p * np.array(nxt)
    return total / total.sum()


def _pair(kind: str, root) -> tuple[str, dict]:
    if kind == "ngram":
        return tiny_model_dir(root, num_hidden_layers=2, seed=3)[0], {"prompt_lookup_min": 1}
    if kind == "draft":
        from tests.test_draft_model import _target

        class Factory:  # the draft-model test's helpers take a tmp_path_factory
            def mktemp(self, name):
                (root / name).mkdir(exist_ok=True)
                return root / name

        return _target(Factory(), "llama"), {"draft_model": _target(Factory(), "llama", noise=0.3)}
    if kind == "mtp":
        from tests.mtp_heads import mtp_target

        return mtp_target(root, "qwen3_5"), {"speculative_method": "mtp"}
    if kind in ("assistant", "dflash"):  # Gemma 4's assistant over a tiny Gemma 4; DFlash over a Qwen3
        from tests.helpers import make_mlx_lm_model, save_model_dir
        from tests.test_dflash import make_dflash
        from tests.test_gemma4_assistant import make_assistant
        from tests.zoo import tiny_config

        config = tiny_config("gemma4_text") if kind == "assistant" else tiny_config("qwen3", num_hidden_layers=4)
        target = save_model_dir(str(root / "target"), config, make_mlx_lm_model(config, seed=3))
        (make_assistant if kind == "assistant" else make_dflash)(str(root / kind), config)
        return target, {"draft_model": str(root / kind)}
    from tests.test_eagle3 import eagle3_pair

    target, head = eagle3_pair(root)
    return target, {"draft_model": head}


@pytest.mark.parametrize("kind", ["ngram", "draft", "mtp", "eagle3", "assistant", "dflash"])
def test_the_second_token_follows_the_targets_marginal(tmp_path, kind):
    target, extra = _pair(kind, tmp_path)
    cfg = dict(num_kv_blocks=256, block_size=16, max_num_seqs=64, speculative_max_batch=64, model_impl="mlx-lm",
               num_speculative_tokens=2, **extra)
    engine = LLMEngine(target, EngineConfig(**cfg))
    prompt = LOOKUP_PROMPT if kind == "ngram" else PROMPT
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=s) for s in range(SAMPLES)]
    outs = generate(engine, [prompt] * SAMPLES, params)
    st = engine.stats
    assert st["spec_drafted_by_position"][0] > SAMPLES // 2, st  # verify steps drew most second tokens
    second = np.bincount([o.token_ids[1] for o in outs], minlength=engine.model.args.vocab_size)
    expected = SAMPLES * _marginal_second(engine, prompt)
    assert chi_square_p(second.astype(float), expected) > 1e-3
    again = generate(engine, [prompt] * 16, params[:16])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:16]]  # seeded: repeats exactly


def test_the_chi_square_check_rejects_a_wrong_distribution():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(50))
    fair = np.bincount(rng.choice(50, SAMPLES, p=p), minlength=50).astype(float)
    assert chi_square_p(fair, SAMPLES * p) > 1e-3
    skewed = np.roll(p, 1)
    assert chi_square_p(fair, SAMPLES * skewed) < 1e-6
