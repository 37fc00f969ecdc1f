"""BitNet's ternary layers on the CPU (`models/bitlinear.py`): mlx-lm runs them with a Metal
kernel only. The portable product equals that kernel's own source run in the project's
emulator; a tiny BitNet (random packed weights and scales) and a Llama with a `bitnet`
quantization_config (BitLinear swapped in by mlx-lm's `bitnet_quantize`) give, on the
paged engine (layers expanded once to float), what mlx-lm's classes compute with the
portable product: logits through chunked prefill and decodes, batched greedy tokens."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import bitlinear_layers as bl

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.kernels.call import KernelCall
from macinfer.models.bitlinear import patch_bitlinear
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate_joining, greedy_by_recompute, make_mlx_lm_model, save_model_dir
from tests.zoo import tiny_config

patch_bitlinear(bl)  # (no Metal here: what the engine does on load)


@pytest.mark.parametrize("invert", [True, False])
def test_the_portable_product_is_mlx_lms_metal_kernel(invert):
    from macinfer.kernels.emulator import emulate

    rng = np.random.default_rng(0)
    B, K, N = 3, 64, 32
    layer = bl.BitLinear(K, N, bias=True, invert_weight_scales=invert)
    layer.weight = mx.array(rng.integers(0, 256, (N // 4, K), dtype=np.uint8))
    layer.weight_scale = mx.array([0.37], dtype=mx.float32)
    layer.bias = mx.array(rng.standard_normal(N).astype(np.float32))
    x = mx.array(rng.standard_normal((B, K)).astype(np.float32))
    call = KernelCall(bl._bitlinear_kernel, [x, layer.weight, layer.weight_scale],
                      [("T", mx.float32), ("invert_weight_scales", invert), ("in_features", K), ("out_features", N)],
                      (32, B * N // 4, 1), (32, 1, 1), [(B, N)], [mx.float32], ["x", "packed_weights", "weight_scale"],
                      ["out"])
    want = emulate(call).outputs[0] + np.array(layer.bias)
    np.testing.assert_allclose(np.array(layer(x)), want, atol=5e-5, rtol=1e-5)


def _randomize(model, seed: int = 3) -> None:
    """Random packed ternary weights and scales (mlx-lm builds them all zero: every weight -1)."""
    rng = np.random.default_rng(seed)
    for _, m in model.named_modules():
        if isinstance(m, bl.BitLinear):
            m.weight = mx.array(rng.integers(0, 256, m.weight.shape, dtype=np.uint8))
            m.weight_scale = mx.array([rng.uniform(0.5, 2.0)], dtype=mx.float32)


def _check(path: str, reference) -> None:
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, max_num_batched_tokens=24))
    assert not any(isinstance(m, bl.BitLinear) for _, m in engine.model.named_modules())  # expanded once
    toks = [int(t) for t in np.random.default_rng(1).integers(3, 300, 30)]
    want = np.array(reference(mx.array([toks]))[0].astype(mx.float32))
    for chunks in ([30], [9, 13, 1, 1, 6]):
        np.testing.assert_allclose(engine.score([toks], chunks)[0], want, atol=2e-4, rtol=2e-4)
    prompts = [toks[:12], toks[5:30], toks[::2]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expect = [greedy_by_recompute(lambda t: reference(mx.array([t]))[0], p, 6) for p in prompts]
    assert generate_joining(engine, prompts, greedy) == expect


def test_a_bitnet_model_runs_like_mlx_lms_classes(tmp_path):
    config = tiny_config("bitnet")
    model = make_mlx_lm_model(config, seed=7)
    _randomize(model)
    _check(save_model_dir(str(tmp_path / "bitnet"), config, model), model)


def test_a_bitnet_quantization_config_swaps_in_ternary_layers(tmp_path):
    """Falcon3-1.58bit style: a Llama whose quantization_config says `bitnet` (mlx-lm's
    `bitnet_quantize`: every Linear but the listed ones, scales inverted unless
    "autobitlinear")."""
    qc = {"quant_method": "bitnet", "linear_class": "bitlinear", "modules_to_not_convert": ["lm_head"]}
    config = {**tiny_config("llama"), "quantization_config": qc}
    model = make_mlx_lm_model(tiny_config("llama"), seed=7)
    bl.bitnet_quantize(model, qc)
    _randomize(model, seed=4)
    path = save_model_dir(str(tmp_path / "falcon3"), tiny_config("llama"), model)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    assert any(k.endswith("weight_scale") for k, _ in tree_flatten(model.parameters()))
    _check(path, model)


def test_an_unknown_quantization_method_is_a_load_error(tmp_path):
    config = {**tiny_config("llama"), "quantization_config": {"quant_method": "awq"}}
    model = make_mlx_lm_model(tiny_config("llama"), seed=7)
    params = dict(tree_flatten(model.parameters()))
    path = save_model_dir(str(tmp_path / "awq"), config, model)
    w, s, b = mx.quantize(params["model.layers.0.mlp.up_proj.weight"], group_size=32, bits=4)
    params.update({"model.layers.0.mlp.up_proj.weight": w, "model.layers.0.mlp.up_proj.scales": s,
                   "model.layers.0.mlp.up_proj.biases": b})
    mx.save_safetensors(os.path.join(path, "model.safetensors"), params)
    with pytest.raises(Exception, match="quant_method 'awq'"):
        LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
