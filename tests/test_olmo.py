"""OLMo 1 (`olmo`): mlx-lm's file checks for the ai2-olmo package it never uses (a stand-in
meets the check), adds the mask string "causal" to its hand-computed scores (its own
forward fails on any prompt of two tokens or more: its attention goes through SDPA here),
and returns (logits, cache) when its weights are tied (the logits alone here). Tied and
untied, the paged engine gives what mlx-lm's classes give with those mended."""

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate_joining, greedy_by_recompute, make_mlx_lm_model, save_model_dir
from tests.zoo import tiny_config


@pytest.mark.parametrize("tied", [True, False])
def test_olmo_runs_like_mlx_lms_classes(tmp_path, tied):
    config = tiny_config("olmo", weight_tying=tied)
    model = make_mlx_lm_model(config, seed=3)
    engine = LLMEngine(save_model_dir(str(tmp_path / "olmo"), config, model), EngineConfig(kv_cache_gb=0.01))

    def logits(tokens):
        return model(mx.array([tokens]))[0].astype(mx.float32)

    toks = [int(t) for t in np.random.default_rng(2).integers(3, 300, 24)]
    for chunks in ([24], [7, 9, 1, 1, 6]):
        np.testing.assert_allclose(engine.score([toks], chunks)[0], np.array(logits(toks)), atol=2e-4, rtol=2e-4)
    prompts = [toks[:10], toks[3:], toks[::3]]
    want = [greedy_by_recompute(logits, p, 6) for p in prompts]
    assert generate_joining(engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) == want
