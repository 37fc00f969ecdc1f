"""The config of llama.cpp's recurrent, hybrid, MLA and tensor-mapped MoE architectures in
GGUF (`hybrid.py` lists them), for mlx-lm's class: read from the metadata llama.cpp's
converter writes (`{arch}.ssm.*`, `shortconv.*`, `attention.*`, `expert_*`, per-layer
arrays), with the multi-token-prediction blocks it counts in `block_count` left out."""

from __future__ import annotations

import math
from typing import Any, Callable

from macinfer.gguf.file import ModelLoadError

# GGUF architecture -> mlx-lm model_type
ARCHS = {"mamba2": "mamba2", "lfm2": "lfm2", "lfm2moe": "lfm2_moe", "qwen3next": "qwen3_next", "nemotron_h": "nemotron_h",
         "nemotron_h_moe": "nemotron_h", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe",
         "deepseek2": "deepseek_v3", "glm4moe": "glm4_moe", "glm-dsa": "glm_moe_dsa", "minimax-m2": "minimax",
         "gpt-oss": "gpt_oss", "gemma4": "gemma4_text", "llama4": "llama4",
         "granitehybrid": "granitemoehybrid", "bailingmoe2": "bailing_moe", "olmoe": "olmoe",
         "qwen2moe": "qwen2_moe"}
NESTED = {"llama4"}  # mlx-lm's class takes these under `text_config`


def _layers(get: Callable) -> int:
    """Decoder layers: the converter counts multi-token-prediction blocks (Qwen3.5's,
    Nemotron-H's) in `block_count` and says how many in `nextn_predict_layers`; they are
    not part of the forward, and their tensors are left unread."""
    return int(get("block_count")) - int(get("nextn_predict_layers", 0))


def _mamba2(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    # mlx-lm's gated norm runs over the whole inner size (llama.cpp's per group): equal for one group
    return {"num_heads": heads, "head_dim": inner // heads, "intermediate_size": inner,
            "state_size": int(get("ssm.state_size")), "conv_kernel": int(get("ssm.conv_kernel")),
            "n_groups": int(get("ssm.group_count", 1)), "layer_norm_epsilon": float(get("attention.layer_norm_rms_epsilon")),
            "use_bias": "blk.0.ssm_in.bias" in names, "use_conv_bias": "blk.0.ssm_conv1d.bias" in names,
            "time_step_limit": (0.0, math.inf), "time_step_rank": heads}


def _lfm2(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    kv = get("attention.head_count_kv")
    kv = [int(x) for x in (kv.tolist() if hasattr(kv, "tolist") else kv)]
    if not isinstance(kv, list) or len(kv) < _layers(get):
        raise ModelLoadError("LFM2 GGUF: attention.head_count_kv must list every layer (0: a convolution layer)")
    kv = kv[: _layers(get)]
    full = [i for i, n in enumerate(kv) if n > 0]
    return {"num_attention_heads": int(get("attention.head_count")), "num_key_value_heads": max(kv),
            "norm_eps": float(get("attention.layer_norm_rms_epsilon")), "conv_L_cache": int(get("shortconv.l_cache")),
            "conv_bias": "blk.0.shortconv.in_proj.bias" in names, "block_dim": int(get("embedding_length")),
            "block_ff_dim": int(get("feed_forward_length")), "block_auto_adjust_ff_dim": False,
            "block_multiple_of": 1, "block_ffn_dim_multiplier": 1.0, "rope_theta": float(get("rope.freq_base")),
            "full_attn_idxs": full,
            "layer_types": ["full_attention" if i in full else "conv" for i in range(len(kv))]}


def _lfm2moe(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """LFM2-MoE (`lfm2moe`, LFM2-8B-A1B): LFM2's convolution and attention layers, dense MLPs in
    the first `leading_dense_block_count` layers and sigmoid-routed experts after them, their
    selection bias where the file holds it."""
    config = _lfm2(get, meta, names)
    dense = int(get("leading_dense_block_count", 0))
    return {**config, "intermediate_size": int(get("feed_forward_length")), "conv_bias": config["conv_bias"],
            "moe_intermediate_size": int(get("expert_feed_forward_length")), "num_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")), "num_dense_layers": dense,
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "use_expert_bias": any(n.endswith(".exp_probs_b.bias") for n in names)}


def _gated_deltanet(get: Callable) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5: attention every `full_attention_interval` layers, Gated DeltaNet between."""
    value_heads = int(get("ssm.time_step_rank"))
    head_dim = int(get("attention.key_length"))
    interval = get("full_attention_interval", None)
    return {"num_attention_heads": int(get("attention.head_count")),
            "num_key_value_heads": int(get("attention.head_count_kv")), "head_dim": head_dim,
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), "rope_theta": float(get("rope.freq_base")),
            "partial_rotary_factor": int(get("rope.dimension_count", head_dim)) / head_dim,
            "intermediate_size": int(get("feed_forward_length", 0)) or int(get("expert_feed_forward_length", 0)),
            "linear_num_value_heads": value_heads, "linear_num_key_heads": int(get("ssm.group_count")),
            "linear_key_head_dim": int(get("ssm.state_size")),
            "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
            "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
            "full_attention_interval": int(interval) if interval is not None else 4}


def _moe(get: Callable, names: set[str]) -> dict[str, Any]:
    if not any(n.endswith(".ffn_gate_inp.weight") for n in names):
        return {"num_experts": 0, "num_experts_per_tok": 0, "mlp_only_layers": []}
    return {"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length")),
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


def _qwen3next(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    return {**_gated_deltanet(get), **_moe(get, names)}


def _qwen35(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    config = {**_gated_deltanet(get), **_moe(get, names)}
    # Text positions: mlx-lm rotates the partial rotary dims as plain RoPE (the mrope sections
    # matter only for image positions, kept below for a vision projector file, `gguf/mmproj.py`).
    config["rope_parameters"] = {"type": "default", "rope_theta": config.pop("rope_theta"),
                                 "partial_rotary_factor": config.pop("partial_rotary_factor")}
    sections = [int(x) for x in get("rope.dimension_sections", [])]
    if any(sections):  # kept for its image path, which turns image positions by them (`gguf/mmproj.py`)
        config["mrope_section"] = [x for x in sections if x]
    return config


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
    n = _layers(get)
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


def _per_layer(get: Callable, key: str, n: int) -> list[int]:
    value = get(key, 0)
    value = value.tolist() if hasattr(value, "tolist") else value
    return [int(v) for v in value][:n] if isinstance(value, list) else [int(value)] * n


def _nemotron_h(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    # The layer kinds are in per-layer arrays: K/V heads (attention), FFN length (MLP or MoE), else Mamba.
    n = _layers(get)
    kv, ff = _per_layer(get, "attention.head_count_kv", n), _per_layer(get, "feed_forward_length", n)
    moe = "blk.0.ffn_gate_inp.weight" in names or any(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(n))
    pattern = "".join("*" if kv[i] else ("E" if moe else "-") if ff[i] else "M" for i in range(n))
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    first_m, first_a = pattern.find("M"), pattern.find("*")
    config = {"hybrid_override_pattern": pattern, "num_attention_heads": int(get("attention.head_count")),
              "num_key_value_heads": max(kv) or 1, "head_dim": int(get("attention.key_length")),
              "intermediate_size": max(ff) or 1, "mamba_num_heads": heads, "mamba_head_dim": inner // heads,
              "ssm_state_size": int(get("ssm.state_size")), "conv_kernel": int(get("ssm.conv_kernel")),
              "n_groups": int(get("ssm.group_count", 1)), "layer_norm_epsilon": float(get("attention.layer_norm_rms_epsilon")),
              "use_conv_bias": f"blk.{first_m}.ssm_conv1d.bias" in names,
              "mamba_proj_bias": f"blk.{first_m}.ssm_in.bias" in names, "use_bias": f"blk.{first_m}.ssm_in.bias" in names,
              "attention_bias": f"blk.{first_a}.attn_q.bias" in names, "mlp_bias": False,
              "time_step_limit": (0.0, math.inf)}
    if moe:
        latent = get("moe_latent_size", None)
        config.update({"n_routed_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
                       "moe_intermediate_size": int(get("expert_feed_forward_length")),
                       "moe_shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length")),
                       "n_shared_experts": int(get("expert_shared_count", 1)) or None,
                       "norm_topk_prob": bool(get("expert_weights_norm", True)),
                       "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
                       "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1)),
                       **({"moe_latent_size": int(latent)} if latent else {})})
    return config


def _gemma4(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Gemma 4 (`gemma4`): sliding and global layers as `attention.sliding_window_pattern` marks
    them, each kind with its own head width, K/V heads and RoPE base; the last
    `attention.shared_kv_layers` layers reading the K/V of the last earlier layer of their kind;
    per-layer token embeddings where `embedding_length_per_layer_input` is set (E2B, E4B); a
    double-wide MLP in the shared layers where `feed_forward_length` lists it; experts beside the
    MLP where the file holds a router (26B-A4B); keys as values in the global layers where they
    hold no `attn_v` (31B). Norms are stored as they are (no 1 + w). The global layers' partial
    rotation is in the `rope_freqs` tensor (`tensor_config.from_tensors`)."""
    n = _layers(get)
    pattern = get("attention.sliding_window_pattern", None)
    pattern = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern or [])]
    if len(pattern) < n:
        raise ModelLoadError("gemma4 GGUF: attention.sliding_window_pattern must mark every layer")
    types = ["sliding_attention" if s else "full_attention" for s in pattern[:n]]
    if "full_attention" not in types or "sliding_attention" not in types:
        raise ModelLoadError("gemma4 GGUF: a model of one layer kind only is not Gemma 4's layout")
    sw, full = types.index("sliding_attention"), types.index("full_attention")
    kv, ff = _per_layer(get, "attention.head_count_kv", n), _per_layer(get, "feed_forward_length", n)
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


def _granitehybrid(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Granite 4.0 H (`granitehybrid`): Mamba-2 layers and attention layers (those with K/V heads),
    each followed by a shared MLP and, where the file holds routers, routed experts; Granite's four
    scales; RoPE only where the file marks it (`rope.scaling.finetuned`, as llama.cpp reads it),
    else none. The time step unclamped, as llama.cpp runs it."""
    n = _layers(get)
    kv = _per_layer(get, "attention.head_count_kv", n)
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    moe = any(x.endswith(".ffn_gate_inp.weight") for x in names)
    first_m = next((i for i in range(n) if not kv[i]), 0)
    first_a = next((i for i in range(n) if kv[i]), 0)
    ff = int(get("feed_forward_length"))
    return {"layer_types": ["attention" if kv[i] else "mamba" for i in range(n)],
            "num_attention_heads": int(get("attention.head_count")), "num_key_value_heads": max(kv) or 1,
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
            "embedding_multiplier": float(get("embedding_scale")),
            "attention_multiplier": float(get("attention.scale")),
            "residual_multiplier": float(get("residual_scale")), "logits_scaling": float(get("logit_scale")),
            "intermediate_size": ff, "shared_intermediate_size": int(get("expert_shared_feed_forward_length", ff)),
            "num_local_experts": int(get("expert_count")) if moe else 0,
            "num_experts_per_tok": int(get("expert_used_count")) if moe else 0,
            "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_d_state": int(get("ssm.state_size")),
            "mamba_n_groups": int(get("ssm.group_count", 1)), "mamba_d_conv": int(get("ssm.conv_kernel")),
            "mamba_proj_bias": f"blk.{first_m}.ssm_in.bias" in names,
            "mamba_conv_bias": f"blk.{first_m}.ssm_conv1d.bias" in names,
            "attention_bias": f"blk.{first_a}.attn_q.bias" in names, "mlp_bias": False,
            "position_embedding_type": "rope" if bool(get("rope.scaling.finetuned", False)) else "nope",
            "rope_theta": float(get("rope.freq_base", 10000.0)), "time_step_limit": (0.0, math.inf)}


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


def _attention(get: Callable, names: set[str]) -> dict[str, Any]:
    """The plain attention fields most files carry alike."""
    heads = int(get("attention.head_count"))
    return {"num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": int(get("attention.key_length", int(get("embedding_length")) // heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), "rope_theta": float(get("rope.freq_base")),
            "attention_bias": "blk.0.attn_q.bias" in names}


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


_CONFIGS = {"mamba2": _mamba2, "lfm2": _lfm2, "lfm2moe": _lfm2moe, "qwen3next": _qwen3next, "nemotron_h": _nemotron_h,
            "nemotron_h_moe": _nemotron_h, "qwen35": _qwen35, "qwen35moe": _qwen35, "deepseek2": _deepseek2,
            "glm4moe": _glm4moe, "glm-dsa": _glm_dsa, "minimax-m2": _minimax_m2, "gpt-oss": _gpt_oss,
            "gemma4": _gemma4, "llama4": _llama4, "granitehybrid": _granitehybrid,
            "bailingmoe2": _bailingmoe2, "olmoe": _olmoe, "qwen2moe": _qwen2moe}


def config_for(arch: str, get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    config = {"model_type": ARCHS[arch], "hidden_size": int(get("embedding_length")),
              "num_hidden_layers": _layers(get), "vocab_size": len(meta["tokenizer.ggml.tokens"]),
              "max_position_embeddings": int(get("context_length", 4096)),
              "tie_word_embeddings": "output.weight" not in names}
    config.update(_CONFIGS[arch](get, meta, names))
    if nextn := int(get("nextn_predict_layers", 0)):  # the MTP blocks kept after the layers (`models/mtp.py`)
        config["num_nextn_predict_layers"] = nextn
    if arch in NESTED:
        config = {"model_type": ARCHS[arch], "text_config": config,
                  **{k: config[k] for k in ("vocab_size", "hidden_size", "tie_word_embeddings")}}
    return config
