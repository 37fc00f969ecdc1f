"""DeepSeek Sparse Attention on the paged cache (`kv/sparse.py`, `models/paged_indexer.py`):
DeepSeek V3.2 and GLM-5 (`glm_moe_dsa`) with an 8-key budget at contexts past it give
mlx-lm's tokens (alone, batched, through chunked prefill: the architecture matrix runs
them with prefix hits and preemption too), and the selection is what the model reads: a
far token no query selects changes nothing, a selected one changes the answer."""

import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, mlx_lm_greedy, save_model_dir
from tests.zoo import tiny_config

TOPK = 8


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def dsa(request, tmp_path_factory):
    config = tiny_config(request.param)
    assert config["index_topk"] == TOPK
    model = make_mlx_lm_model(config, seed=1)
    return save_model_dir(str(tmp_path_factory.mktemp(request.param)), config, model), model


def test_tokens_equal_mlx_lm_past_the_budget(dsa):
    path, model = dsa
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 20, 37, 60, 9, 44, 26, 31)]
    want = [mlx_lm_greedy(model, p, 12) for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for budget in (512, 16):  # the prompts in one chunk each, and cut into chunks of 16 tokens
        engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=budget))
        assert [o.token_ids for o in generate(engine, prompts, params)] == want, budget


def _selected(engine, prompt: list[int]) -> tuple[set[int], np.ndarray]:
    """The keys the prompt's last query selected (one chunk, one layer), and the first
    token's logprobs."""
    import macinfer.models.paged_indexer as indexer

    seen: set[int] = set()
    real = indexer.select_keys

    def recording(*args, **kwargs):
        sel = real(*args, **kwargs)
        for mask in sel.spans.values():
            seen.update(np.flatnonzero(np.array(mask)[-1]).tolist())
        return sel

    indexer.select_keys = recording
    try:
        out = generate(engine, [prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=20))[0]
    finally:
        indexer.select_keys = real
    return seen, np.array(sorted(out.logprobs[0].top))


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_a_far_token_matters_only_when_selected(tmp_path, model_type):
    """One layer: the first answer token reads the prompt only through the keys its query
    selects (a key is a token's own projection there), so changing a token it does not
    select (and still does not, after the change) leaves the answer's logprobs exactly as
    they were, and changing a selected one moves them. Dense attention would move both."""
    config = tiny_config(model_type, num_hidden_layers=1, first_k_dense_replace=1)
    path = save_model_dir(str(tmp_path / "one"), config, make_mlx_lm_model(config, seed=2))
    engine = LLMEngine(path, EngineConfig(num_kv_blocks=64, block_size=16, enable_prefix_caching=False))
    prompt = np.random.default_rng(3).integers(3, 250, 48).tolist()
    chosen, base = _selected(engine, prompt)
    assert len(chosen) == TOPK
    far = [p for p in range(1, 40) if p not in chosen]
    untouched = 0
    for p in far[:6]:
        other = prompt[:p] + [(prompt[p] + 7) % 240 + 3] + prompt[p + 1:]
        chosen2, lp = _selected(engine, other)
        if p not in chosen2:  # still unread after the change
            assert np.array_equal(lp, base)
            untouched += 1
    assert untouched
    moved = 0
    for p in sorted(chosen - {len(prompt) - 1})[:3]:
        other = prompt[:p] + [(prompt[p] + 7) % 240 + 3] + prompt[p + 1:]
        moved += not np.allclose(_selected(engine, other)[1], base)
    assert moved


def test_a_quantized_kv_cache_is_refused_at_load(dsa):
    path, _ = dsa
    with pytest.raises(ValueError, match="sparse attention indexer reads its index keys at full precision"):
        LLMEngine(path, EngineConfig(num_kv_blocks=64, kv_cache_dtype="int8"))
