"""Language models mlx-vlm names its own that mlx-lm implements under another name: the
engine runs them by mlx-lm's class (`vision/text_model.py: TEXT_ALIASES`) and gives mlx-vlm's
own greedy tokens on the same weights, text only (their image side is `test_vision.py`'s)."""

import mlx.core as mx
import pytest

from macinfer import LLM
from macinfer.sampling_params import SamplingParams
from tests import vision_models as vm
from tests.zoo import tiny_config

DEEPSEEK_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                 "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "topk_method", "scoring_func",
                 "norm_topk_prob", "n_group", "topk_group", "rms_norm_eps", "rope_theta")


def _mistral_large3(path: str):
    """Mistral Large 3: Mistral 3's Pixtral tower and merge over a DeepSeek-V3 decoder."""
    cfg, processor = vm._mistral3(path, "mistral3")
    ds = tiny_config("deepseek_v3")
    text = {k: ds[k] for k in DEEPSEEK_KEYS if k in ds}
    text.update({"model_type": "mistral_large3", "vocab_size": 300, "max_position_embeddings": 2048})
    cfg.update({"model_type": "mistral_large3", "text_config": text, "image_token_id": 259})
    return cfg, processor


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
