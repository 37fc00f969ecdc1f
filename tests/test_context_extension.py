"""`--rope-scaling yarn|linear`: a context beyond the trained one, with RoPE stretched as
the model cards tell users to edit config.json (Qwen3's YaRN). The result equals
mlx-lm's own model built from that edited config, past the trained positions;
without the flag, or on a model that already scales RoPE, it is refused."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.loading.loader import load
from macinfer.models.rope import extend_context
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, tiny_config, tiny_model_dir

TRAINED = 64


def _prompt_logprobs_mlx_lm(config: dict, weights_from, prompt: list[int]) -> np.ndarray:
    """log p(prompt[i] | prompt[:i]) for i >= 1 from mlx-lm's own model built from `config`."""
    model = make_mlx_lm_model(config)
    model.load_weights(tree_flatten(weights_from.parameters()))
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(lp[mx.arange(len(prompt) - 1), mx.array(prompt[1:])])


@pytest.mark.parametrize("family,kind,impl", [("llama", "yarn", "auto"), ("qwen3", "yarn", "mlx-lm"),
                                              ("llama", "linear", "auto")])
def test_stretched_context_equals_mlx_lm_on_the_edited_config(tmp_path, family, kind, impl):
    path, model = tiny_model_dir(tmp_path, family, max_position_embeddings=TRAINED)
    engine = LLMEngine(path, EngineConfig(max_model_len=4 * TRAINED, rope_scaling=kind, kv_cache_gb=0.01,
                                          model_impl=impl))
    assert engine.max_model_len == 4 * TRAINED
    prompt = [int(x) for x in mx.random.randint(3, 300, (200,), key=mx.random.key(1)).tolist()]  # past 64
    out = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    ours = np.array([t.logprob for t in out.prompt_logprobs[1:]])
    edited = extend_context(tiny_config(family, max_position_embeddings=TRAINED), 4 * TRAINED, kind)
    assert edited["rope_scaling"] == {"rope_type": kind, "type": kind, "factor": 4.0,
                                      "original_max_position_embeddings": TRAINED}
    np.testing.assert_allclose(ours, _prompt_logprobs_mlx_lm(edited, model, prompt), atol=2e-4)
    # and the stretch is real: the unscaled model gives other values
    plain = _prompt_logprobs_mlx_lm(tiny_config(family, max_position_embeddings=4 * TRAINED), model, prompt)
    assert np.abs(ours - plain).max() > 1e-2


def test_refusals(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama", max_position_embeddings=TRAINED)
    with pytest.raises(ValueError, match="add --rope-scaling yarn"):
        LLMEngine(path, EngineConfig(max_model_len=2 * TRAINED, kv_cache_gb=0.01))
    with pytest.raises(ValueError, match="needs --max-model-len"):
        LLMEngine(path, EngineConfig(rope_scaling="yarn", kv_cache_gb=0.01))
    # a model that already scales RoPE (its max_position_embeddings is the scaled length)
    cfg = json.load(open(f"{path}/config.json"))
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    json.dump(cfg, open(f"{path}/config.json", "w"))
    with pytest.raises(Exception, match="already scales RoPE"):
        load(path, context=(4 * TRAINED, "yarn"))
    # within the trained context the flag changes nothing
    assert extend_context({"max_position_embeddings": 64}, 64, "yarn") == {"max_position_embeddings": 64}


def test_an_architecture_that_ignores_the_scaling_is_refused(tmp_path, monkeypatch):
    """Where the built model's RoPE did not take the scaling (an architecture that reads its
    RoPE settings from another field), the load is refused rather than run unscaled."""
    import macinfer.loading.loader as loader

    path, _ = tiny_model_dir(tmp_path, "llama", max_position_embeddings=TRAINED)
    monkeypatch.setattr(loader, "uses_scaled_rope", lambda model, kind: False)
    with pytest.raises(Exception, match="does not take RoPE scaling from its config"):
        load(path, context=(4 * TRAINED, "yarn"))
    load(path, context=(TRAINED, "yarn"))  # within the trained context nothing is stretched, nothing checked
