"""The config of llama.cpp's attention architectures in GGUF that the loader reads by llama.cpp's
own tensor map (`hybrid.py`): MLA (`deepseek2`, `glm-dsa`), routed-expert MoEs (`glm4moe`,
`minimax-m2`, `gpt-oss`, `bailingmoe2`, `olmoe`, `qwen2moe`), and those whose layers differ by a
per-layer pattern (`gemma4`, `llama4`), from the metadata llama.cpp's converter writes; the
recurrent and hybrid ones are `hybrid_config.py`'s, which holds the table of all of them."""

from __future__ import annotations

import math
from typing import Any, Callable

from macinfer.gguf.file import ModelLoadError


def decoder_layers(get: Callable) -> int:
    """Decoder layers: the converter counts multi-token-prediction blocks (Qwen3.5's,
    Nemotron-H's) in `block_count` and says how many in `nextn_predict_layers`; they are
    not part of the forward, and their tensors are left unread."""
    return int(get("block_count")) - int(get("nextn_predict_layers", 0))


def _attention(get: Callable, names: set[str]) -> dict[str, Any]:
    """The plain attention fields most files carry alike."""
    heads = int(get("attention.head_count"))
    return {"num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": int(get("attention.key_length", int(get("embedding_length")) // heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), "rope_theta": float(get("rope.freq_base")),
            "attention_bias": "blk.0.attn_q.bias" in names}


def _deepseek2(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    heads, rope = int(get("attention.head_count")), int(get("rope.dimension_count"))
    if get("attention.key_length_mla", None) is not None:  # the MQA form: key_length is the latent's
        nope, v = int(get("attention.key_length_mla")) - rope, int(get("attention.value_length_mla"))
    else:  # older files: per-head lengths
        nope, v = int(get("attention.key_length")) - rope, int(get("attention.value_length"))
    eps = float(get("attention.layer_norm_rms_epsilon"))
    experts = get("expert_count", None)
    sigmoid = int(get("expert_gating_func", 0)) == 2 or any(n.endswith(".exp_probs_b.bias") for n in names)
    # mlx-lm's DeepSeek V3 file fixes the latent norms' eps at DeepSeek's 1e-6; GLM-4.7-Flash (the
    # same graph, stored as deepseek2) has its own, which mlx-lm's glm4_moe_lite file reads.
    model_type = ("deepseek_v3" if math.isclose(eps, 1e-6, rel_tol=1e-5) else "glm4_moe_lite") if sigmoid else "deepseek_v2"
    q_lora = get("attention.q_lora_rank", None)
    return {"model_type": model_type, "num_attention_heads": heads, "num_key_value_heads": heads,
            "q_lora_rank": int(q_lora) if q_lora else None, "kv_lora_rank": int(get("attention.kv_lora_rank")),
            "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": v, "rms_norm_eps": eps,
            "rope_theta": float(get("rope.freq_base")), "intermediate_size": int(get("feed_forward_length")),
            "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
            "n_routed_experts": int(experts) if experts else None,
            "n_shared_experts": int(get("expert_shared_count", 0)) or None,
            "num_experts_per_tok": int(get("expert_used_count", 1)),
            "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1)),
            "moe_layer_freq": 1, "attention_bias": False,
            "topk_method": "noaux_tc" if sigmoid else "greedy", "scoring_func": "sigmoid" if sigmoid else "softmax"}


def _glm_dsa(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """GLM-5 (`glm-dsa`): DeepSeek's MLA layers, converted as `deepseek2`'s, with DeepSeek Sparse
    Attention's indexer (its heads, key width and top-k in `attention.indexer.*`)."""
    if get("rope.scaling.type", None) not in (None, "none"):
        raise ModelLoadError("glm-dsa: RoPE scaling in a GLM-5 file is not read here (mlx-lm's class takes "
                             "its RoPE from rope_parameters)")
    config = _deepseek2(get, meta, names)
    config.update(model_type="glm_moe_dsa", index_n_heads=int(get("attention.indexer.head_count")),
                  index_head_dim=int(get("attention.indexer.key_length")),
                  index_topk=int(get("attention.indexer.top_k")),
                  rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]})
    return config


def _minimax_m2(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """MiniMax M2/M2.5 (`minimax-m2`): routed experts only (their width is the HF
    `intermediate_size`), partial rotary (`rotary_dim`), q/k norms over all heads."""
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", int(get("embedding_length")) // heads))
    return {"num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": head_dim, "rotary_dim": int(get("rope.dimension_count", head_dim)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), "rope_theta": float(get("rope.freq_base")),
            "intermediate_size": int(get("expert_feed_forward_length")), "shared_intermediate_size": 0,
            "num_local_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "scoring_func": "softmax" if int(get("expert_gating_func", 2)) == 1 else "sigmoid",
            "use_qk_norm": "blk.0.attn_q_norm.weight" in names}


def _gpt_oss(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """gpt-oss: biased attention with sinks, sliding layers every other one (llama.cpp's fixed
    pattern, the first sliding, as transformers' `layer_types`), routed experts with biases."""
    n = decoder_layers(get)
    return {"num_attention_heads": int(get("attention.head_count")),
            "num_key_value_heads": int(get("attention.head_count_kv")), "head_dim": int(get("attention.key_length")),
            "intermediate_size": int(get("expert_feed_forward_length")),
            "num_local_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "sliding_window": int(get("attention.sliding_window")),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), "rope_theta": float(get("rope.freq_base")),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]}


def _glm4moe(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """GLM-4.5/4.6/4.7 (`glm4moe`): sigmoid-routed experts after dense leading layers, partial
    rotary (the converter writes the rotated width), q/k norms and biases when stored; GLM-4.5V's
    M-RoPE sections, where the file has them, kept for its image path (its rows NeoX-wise as
    the checkpoint's: nothing to turn back)."""
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", int(get("embedding_length")) // heads))
    sections = [int(x) for x in get("rope.dimension_sections", [])]
    mrope = {"mrope_section": [x for x in sections if x]} if any(sections) else {}
    return {**mrope, "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": head_dim, "partial_rotary_factor": int(get("rope.dimension_count", head_dim // 2)) / head_dim,
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), "rope_theta": float(get("rope.freq_base")),
            "rope_scaling": None, "intermediate_size": int(get("feed_forward_length")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "n_routed_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "n_shared_experts": int(get("expert_shared_count", 1)),
            "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1)),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in names, "attention_bias": "blk.0.attn_q.bias" in names}


def per_layer(get: Callable, key: str, n: int) -> list[int]:
    value = get(key, 0)
    value = value.tolist() if hasattr(value, "tolist") else value
    return [int(v) for v in value][:n] if isinstance(value, list) else [int(value)] * n


def _gemma4(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Gemma 4 (`gemma4`): sliding and global layers as `attention.sliding_window_pattern` marks
    them, each kind with its own head width, K/V heads and RoPE base; the last
    `attention.shared_kv_layers` layers reading the K/V of the last earlier layer of their kind;
    per-layer token embeddings where `embedding_length_per_layer_input` is set (E2B, E4B); a
    double-wide MLP in the shared layers where `feed_forward_length` lists it; experts beside the
    MLP where the file holds a router (26B-A4B); keys as values in the global layers where they
    hold no `attn_v` (31B). Norms are stored as they are (no 1 + w). The global layers' partial
    rotation is in the `rope_freqs` tensor (`tensor_config.from_tensors`)."""
    n = decoder_layers(get)
    pattern = get("attention.sliding_window_pattern", None)
    pattern = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern or [])]
    if len(pattern) < n:
        raise ModelLoadError("gemma4 GGUF: attention.sliding_window_pattern must mark every layer")
    types = ["sliding_attention" if s else "full_attention" for s in pattern[:n]]
    if "full_attention" not in types or "sliding_attention" not in types:
        raise ModelLoadError("gemma4 GGUF: a model of one layer kind only is not Gemma 4's layout")
    sw, full = types.index("sliding_attention"), types.index("full_attention")
    kv, ff = per_layer(get, "attention.head_count_kv", n), per_layer(get, "feed_forward_length", n)
    head_full = int(get("attention.key_length"))
    head_swa = int(get("attention.key_length_swa", head_full))
    if int(get("rope.dimension_count_swa", head_swa)) != head_swa:
        raise ModelLoadError("gemma4 GGUF: a partial rotation in the sliding layers is not Gemma 4's (mlx-lm's class "
                             "turns the whole head)")
    shared = int(get("attention.shared_kv_layers", 0))
    k_eq_v = f"blk.{full}.attn_v.weight" not in names
    if kv[full] != kv[sw] and not k_eq_v:
        raise ModelLoadError("gemma4 GGUF: other K/V heads in the global layers are Gemma 4's only where keys are "
                             "values (no attn_v)")
    moe = any(n.endswith(".ffn_gate_inp.weight") for n in names)
    softcap = float(get("final_logit_softcapping", 0.0))
    return {"num_attention_heads": int(get("attention.head_count")), "num_key_value_heads": kv[sw],
            "num_global_key_value_heads": kv[full], "head_dim": head_swa, "global_head_dim": head_full,
            "intermediate_size": ff[0], "use_double_wide_mlp": shared > 0 and ff[n - shared] == 2 * ff[0],
            "num_kv_shared_layers": shared, "layer_types": types,
            "sliding_window": int(get("attention.sliding_window")),
            "hidden_size_per_layer_input": int(get("embedding_length_per_layer_input", 0)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), "attention_k_eq_v": k_eq_v,
            "final_logit_softcapping": softcap or None,
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "rope_theta": float(get("rope.freq_base")),
                                   "partial_rotary_factor": 1.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0)),
                                      "partial_rotary_factor": 1.0}},
            "enable_moe_block": moe,
            **({"num_experts": int(get("expert_count")), "top_k_experts": int(get("expert_used_count")),
                "moe_intermediate_size": int(get("expert_feed_forward_length"))} if moe else {})}


def _llama4(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Llama 4 (`llama4`): every fourth layer global without RoPE (temperature-tuned queries),
    the others RoPE in pairs over chunks of 8192 tokens (llama.cpp's fixed size); MoE layers
    every `interleave_moe_layer_step` (one routed expert and a shared one, experts
    `expert_feed_forward_length` wide), dense ones `feed_forward_length` wide; query/key RMS
    norms in the RoPE layers except for 128 experts (Maverick), as llama.cpp decides. Q/K rows
    as the checkpoint's (its converter does not permute them). Llama 3 RoPE scaling from
    `rope_freqs` (`tensor_config.from_tensors`)."""
    experts = int(get("expert_count"))
    if get("attention.sliding_window", None) == 0:
        raise ModelLoadError("llama4 GGUF with every layer full attention (MobileLLM-R1): mlx-lm's Llama 4 class "
                             "chunks three layers in four")
    return {**_attention(get, names), "rope_scaling": None, "attention_chunk_size": 8192,
            "interleave_moe_layer_step": int(get("interleave_moe_layer_step", 1)),
            "intermediate_size": int(get("expert_feed_forward_length")),
            "intermediate_size_mlp": int(get("feed_forward_length")), "num_local_experts": experts,
            "num_experts_per_tok": int(get("expert_used_count")), "use_qk_norm": experts != 128}


def _bailingmoe2(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Ling / Ring 2.0 (`bailingmoe2`): fused QKV, query/key norms where held, partial rotary (the
    converter writes the rotated width), dense leading layers, routed experts (softmax or sigmoid,
    grouped, with their selection bias where held) beside shared ones. An output head the
    converter L2-normalized (`norm_head`) is stored normalized, so none is applied again."""
    attention = _attention(get, names)
    rotary = int(get("rope.dimension_count", attention["head_dim"]))
    return {**attention, "partial_rotary_factor": rotary / attention["head_dim"], "rotary_dim": rotary,
            "intermediate_size": int(get("feed_forward_length")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "num_shared_experts": int(get("expert_shared_count", 1)),
            "moe_shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)) or None,
            "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "score_function": "sigmoid" if int(get("expert_gating_func", 1)) == 2 else "softmax",
            "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1)),
            "moe_router_enable_expert_bias": any(n.endswith(".exp_probs_b.bias") for n in names),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in names, "use_qkv_bias": "blk.0.attn_qkv.bias" in names,
            "use_bias": "blk.0.attn_output.bias" in names, "norm_head": False}


def _olmoe(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """OLMoE (`olmoe`): query/key norms over all heads, experts `feed_forward_length` wide, their
    weights not renormalized (as llama.cpp runs it)."""
    return {**_attention(get, names), "intermediate_size": int(get("feed_forward_length")),
            "num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "norm_topk_prob": bool(get("expert_weights_norm", False))}


def _qwen2moe(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Qwen1.5-MoE / Qwen2-MoE (`qwen2moe`): Q/K/V biases, routed experts beside a gated shared one."""
    return {**_attention(get, names), "intermediate_size": int(get("feed_forward_length", 0)),
            "num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length"))}


def _gemma3n(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Gemma 3n (`gemma3n`): AltUp's parallel streams and LAuReL beside each layer, per-layer token
    embeddings, KV shared across the last layers, sliding layers as the file's pattern marks them,
    the first layers' activation sparsity, which the converter writes as the Gaussian quantile
    (turned back into the fraction here). The LAuReL rank and the per-layer embedding rows come
    from the tensors (`tensor_config.from_tensors`). AltUp's coefficients are not clipped, as
    llama.cpp runs them (mlx-lm clips at the training bound, 120, which trained weights stay
    inside)."""
    n = decoder_layers(get)
    pattern = get("attention.sliding_window_pattern", None)
    pattern = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern or [])]
    if len(pattern) < n:
        raise ModelLoadError("gemma3n GGUF: attention.sliding_window_pattern must mark every layer")
    scales = get("activation_sparsity_scale", None)
    scales = [float(x) for x in (scales.tolist() if hasattr(scales, "tolist") else scales or [-math.inf] * n)]
    return {**_attention(get, names), "intermediate_size": per_layer(get, "feed_forward_length", n),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in pattern[:n]],
            "sliding_window": int(get("attention.sliding_window")),
            "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
            "final_logit_softcapping": float(get("final_logit_softcapping", 30.0)),
            "num_kv_shared_layers": int(get("attention.shared_kv_layers", 0)),
            "hidden_size_per_layer_input": int(get("embedding_length_per_layer_input")),
            "activation_sparsity_pattern": [0.5 * (1 + math.erf(x / math.sqrt(2))) for x in scales[:n]],
            "altup_num_inputs": int(get("altup.num_inputs")), "altup_active_idx": int(get("altup.active_idx")),
            "altup_correct_scale": True, "altup_coef_clip": None, "rope_scaling": None}


MAPPED_CONFIGS = {"deepseek2": _deepseek2, "glm4moe": _glm4moe, "glm-dsa": _glm_dsa, "minimax-m2": _minimax_m2,
                  "gpt-oss": _gpt_oss, "gemma4": _gemma4, "llama4": _llama4, "bailingmoe2": _bailingmoe2,
                  "olmoe": _olmoe, "qwen2moe": _qwen2moe, "gemma3n": _gemma3n}
