"""Language models mlx-vlm names its own that mlx-lm implements under another name: the
engine runs them by mlx-lm's class (`vision/text_model.py: TEXT_ALIASES`) and gives mlx-vlm's
own greedy tokens on the same weights, text only (their image side is `test_vision.py`'s)."""

import mlx.core as mx
import pytest

from macinfer import LLM
from macinfer.sampling_params import SamplingParams
from tests import vision_models as vm
from tests.vision_families.llava import _mistral_large3

BUILDERS = {"mistral_large3": _mistral_large3}


def mlx_vlm_text_greedy(path: str, ids: list[int], max_tokens: int) -> list[int]:
    from mlx_vlm import load
    from mlx_vlm.generate.ar import generate_step

    model, _ = load(path)
    prompt = mx.array([ids])
    steps = generate_step(prompt, model, None, mx.ones(prompt.shape, dtype=mx.int32), max_tokens=max_tokens,
                          temperature=0.0)
    return [int(t) for (t, _), _ in zip(steps, range(max_tokens))]


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_language_model_gives_mlx_vlm_tokens(tmp_path, monkeypatch, family):
    monkeypatch.setitem(vm.BUILDERS, family, BUILDERS[family])
    path = vm.tiny_vlm_dir(tmp_path, family)
    ids = [1, 40, 41, 42, 43, 44, 45, 46]
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512)
    try:
        ours = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    finally:
        llm.close()
    assert ours == mlx_vlm_text_greedy(path, ids, 12)


def test_a_deepseek_v2_decoder_runs_by_the_mlx_lm_class_whose_routing_it_has():
    """DeepSeek-V2's config without latent attention is DeepSeek-MoE's (mlx-lm's `deepseek`) only
    with greedy softmax routing; with latent attention, mlx-lm's `deepseek_v2` routes greedily
    or by group-limited greedy; other routings are refused at load with the reason."""
    from macinfer.vision.text_model import _deepseek_v2

    plain = {"model_type": "deepseek_v2", "qk_nope_head_dim": 0, "kv_lora_rank": None, "topk_method": "greedy"}
    assert _deepseek_v2(plain)["model_type"] == "deepseek"
    latent = {**plain, "qk_nope_head_dim": 128, "kv_lora_rank": 512, "topk_method": "group_limited_greedy"}
    assert _deepseek_v2(latent) == latent
    for bad in ({**plain, "topk_method": "noaux_tc"}, {**plain, "scoring_func": "sigmoid"},
                {**plain, "routed_scaling_factor": 2.5}, {**latent, "topk_method": "noaux_tc"}):
        with pytest.raises(ValueError, match="routes by"):
            _deepseek_v2(bad)


def test_a_molmo_decoder_mlx_vlm_does_not_run_is_refused_at_load_with_the_reason(tmp_path):
    """Molmo-7B-O's OLMo decoder (query/key norms, no query/key/value bias) is set by config
    fields mlx-vlm's Molmo module ignores: refused, not run as Molmo-7B-D's."""
    import json

    from macinfer.models import UnsupportedArchitectureError

    path = vm.tiny_vlm_dir(tmp_path, "molmo")
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config.update(attention_layer_norm=True, qkv_bias=False)
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedArchitectureError, match="attention_layer_norm, qkv_bias"):
        LLM(path, kv_cache_gb=0.01, max_model_len=512)
