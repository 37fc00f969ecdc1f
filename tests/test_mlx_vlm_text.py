"""Language models only mlx-vlm implements (issue #45): every mlx-vlm model type mlx-lm
lacks has a verdict (`macinfer/models/architectures_mlx_vlm.json`), and each text family
that runs matches mlx-vlm's own class on the same random weights, as the mlx-lm matrix
checks mlx-lm's (`test_architecture_matrix.py`): logits through chunked prefill and
decodes, greedy tokens with requests joining at different steps, a prefix hit and a
forced preemption.

The reference is the family's whole-sequence forward (no cache), recomputed each step:
what the model is, independent of mlx-vlm's cache classes (on unjittered tiny weights
mlx-vlm's cached decode of xing4_0 once gave other tokens than its whole forward).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.models import (ARCHITECTURES, VLM_VERDICTS, VLM_VERDICTS_FILE, UnsupportedArchitectureError,
                             build_model)
from macinfer.models.mlx_lm_classes import mlx_lm_model_types
from macinfer.models.mlx_vlm_text import mlx_vlm_only_model_types
from tests.helpers import generate, generate_joining, greedy_by_recompute, make_mlx_lm_model, save_model_dir
from tests.test_architecture_matrix import CHUNKS, GREEDY, TOKENS, _generate_preempting, _refused_at_load
from tests.zoo import tiny_config

VLM_RUNS = sorted(t for t, v in VLM_VERDICTS.items() if v == "runs")


def _logits(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens])).logits[0].astype(mx.float32))


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    return greedy_by_recompute(lambda t: _logits(model, t), prompt, n)


def test_the_table_covers_every_mlx_vlm_only_model_type_and_is_current():
    from scripts.architectures import vlm_verdicts

    assert sorted(VLM_VERDICTS) == mlx_vlm_only_model_types(mlx_lm_model_types())
    built = {t: "runs" if _refused_at_load(v) else v for t, v in VLM_VERDICTS.items()}
    assert vlm_verdicts(load=False) == built, f"{VLM_VERDICTS_FILE} is stale: run python scripts/architectures.py"
    # The text families mlx-vlm adds that run here (the hy_v4 and deepseek_v4 are refused
    # with their caches' reasons; its vision families are `--vision`'s).
    assert {"k2_horizon", "cohere2_moe", "qwen3_5_text", "qwen3_5_moe_text", "xing4_0"} <= set(ARCHITECTURES)
    assert VLM_VERDICTS["deepseek_v4"].startswith("cache 2 is a PoolingCache")
    assert "diffusion" in VLM_VERDICTS["llada2_moe"] and "vision family" in VLM_VERDICTS["qwen4_exp"]


@pytest.mark.parametrize("model_type", VLM_RUNS)
def test_runs_like_mlx_vlm(model_type, tmp_path):
    config = tiny_config(model_type)
    model = make_mlx_lm_model(config, seed=7)
    assert type(model).__module__.startswith("mlx_vlm.models."), model_type
    path = save_model_dir(str(tmp_path / "m"), config, model)

    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, model_impl="mlx-lm", max_num_batched_tokens=24))
    seqs = [TOKENS[0][:31], TOKENS[1][:31]]
    for got, toks in zip(engine.score(seqs, CHUNKS), seqs):
        np.testing.assert_allclose(got, _logits(model, toks[: sum(CHUNKS)]), atol=2e-4, rtol=2e-4)

    want = [_greedy(model, p, GREEDY.max_tokens) for p in TOKENS]
    assert generate_joining(engine, TOKENS, GREEDY) == want

    tight = LLMEngine(path, EngineConfig(num_kv_blocks=6, model_impl="mlx-lm", max_num_seqs=3))
    assert [o.token_ids for o in _generate_preempting(tight, [TOKENS[0]] * 3)] == [want[0]] * 3
    assert tight.scheduler.num_preemptions > 0
    again = generate(tight, [TOKENS[0]], GREEDY)[0]
    assert again.token_ids == want[0] and again.num_cached_tokens > 0


def test_a_vision_diffusion_or_encoder_family_is_refused_with_its_reason():
    for model_type, reason in (("qwen4_exp", "is a vision family"), ("nemotron_labs_diffusion", "generate\\(\\) of its own"),
                               ("bert", "has no language model"), ("flux2", "no Model and ModelConfig")):
        with pytest.raises(UnsupportedArchitectureError, match=f"unsupported architecture '{model_type}': .*{reason}"):
            build_model({"model_type": model_type})


def test_a_quantized_checkpoint_of_an_mlx_vlm_text_family_loads(tmp_path):
    """An MLX conversion (4-bit, group 32) of a language model only mlx-vlm implements: the
    loader quantizes mlx-vlm's class like the weights, and (on the CPU) expands it to float32
    as for mlx-lm's: the logits of mlx-vlm's own quantized model."""
    quantize = {"group_size": 32, "bits": 4}
    config = tiny_config("qwen3_5_text")
    model = make_mlx_lm_model(config, seed=3, quantize=quantize)
    engine = LLMEngine(save_model_dir(str(tmp_path / "q"), config, model, quantize=quantize),
                       EngineConfig(kv_cache_gb=0.01))
    toks = [int(t) for t in np.random.default_rng(1).integers(3, 300, 20)]
    np.testing.assert_allclose(engine.score([toks], [9, 1, 10])[0], _logits(model, toks), atol=2e-4, rtol=2e-4)
