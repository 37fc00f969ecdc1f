"""The config of llama.cpp's recurrent and hybrid architectures in GGUF (`hybrid.py` lists them;
the attention ones it reads by the same tensor map are `mapped_config.py`'s), for mlx-lm's
class: read from the metadata llama.cpp's converter writes (`{arch}.ssm.*`, `shortconv.*`,
`attention.*`, `expert_*`, per-layer arrays), with the multi-token-prediction blocks it counts
in `block_count` left out. `ARCHS` and `config_for` cover both."""

from __future__ import annotations

import math
from typing import Any, Callable

from macinfer.gguf.file import ModelLoadError
from macinfer.gguf.mapped_config import MAPPED_CONFIGS, decoder_layers, per_layer

# GGUF architecture -> mlx-lm model_type
ARCHS = {"mamba2": "mamba2", "lfm2": "lfm2", "lfm2moe": "lfm2_moe", "qwen3next": "qwen3_next",
         "nemotron_h": "nemotron_h",
         "nemotron_h_moe": "nemotron_h", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe",
         "deepseek2": "deepseek_v3", "glm4moe": "glm4_moe", "glm-dsa": "glm_moe_dsa", "minimax-m2": "minimax",
         "gpt-oss": "gpt_oss", "gemma4": "gemma4_text", "llama4": "llama4",
         "granitehybrid": "granitemoehybrid", "bailingmoe2": "bailing_moe", "olmoe": "olmoe",
         "qwen2moe": "qwen2_moe", "gemma3n": "gemma3n"}
NESTED = {"llama4", "gemma3n"}  # mlx-lm's class takes these under `text_config`


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
    if not isinstance(kv, list) or len(kv) < decoder_layers(get):
        raise ModelLoadError("LFM2 GGUF: attention.head_count_kv must list every layer (0: a convolution layer)")
    kv = kv[: decoder_layers(get)]
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
    return {**config, "intermediate_size": int(get("feed_forward_length")),
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


def _nemotron_h(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    # The layer kinds are in per-layer arrays: K/V heads (attention), FFN length (MLP or MoE), else Mamba.
    n = decoder_layers(get)
    kv, ff = per_layer(get, "attention.head_count_kv", n), per_layer(get, "feed_forward_length", n)
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


def _granitehybrid(get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Granite 4.0 H (`granitehybrid`): Mamba-2 layers and attention layers (those with K/V heads),
    each followed by a shared MLP and, where the file holds routers, routed experts; Granite's four
    scales; RoPE only where the file marks it (`rope.scaling.finetuned`, as llama.cpp reads it),
    else none. The time step unclamped, as llama.cpp runs it."""
    n = decoder_layers(get)
    kv = per_layer(get, "attention.head_count_kv", n)
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


_CONFIGS = {"mamba2": _mamba2, "lfm2": _lfm2, "lfm2moe": _lfm2moe, "qwen3next": _qwen3next,
            "nemotron_h": _nemotron_h, "nemotron_h_moe": _nemotron_h, "qwen35": _qwen35, "qwen35moe": _qwen35,
            "granitehybrid": _granitehybrid, **MAPPED_CONFIGS}


def config_for(arch: str, get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    config = {"model_type": ARCHS[arch], "hidden_size": int(get("embedding_length")),
              "num_hidden_layers": decoder_layers(get), "vocab_size": len(meta["tokenizer.ggml.tokens"]),
              "max_position_embeddings": int(get("context_length", 4096)),
              "tie_word_embeddings": "output.weight" not in names}
    config.update(_CONFIGS[arch](get, meta, names))
    if nextn := int(get("nextn_predict_layers", 0)):  # the MTP blocks kept after the layers (`models/mtp.py`)
        config["num_nextn_predict_layers"] = nextn
    if arch in NESTED:
        config = {"model_type": ARCHS[arch], "text_config": config,
                  **{k: config[k] for k in ("vocab_size", "hidden_size", "tie_word_embeddings")}}
    return config
