"""llama.cpp's recurrent, hybrid, MLA and tensor-mapped MoE architectures in GGUF: Mamba-2,
LFM2, Qwen3-Next, Qwen3.5/3.6 (dense and MoE), Nemotron-H (dense and MoE), DeepSeek V2/V3
(`deepseek2`: also Kimi K2 and GLM-4.7-Flash files), GLM-5 (`glm-dsa`: the same MLA with
DeepSeek Sparse Attention's indexer), GLM-4.5/4.6/4.7 and Solar Open (`glm4moe`), MiniMax M2
(`minimax-m2`), gpt-oss (`gpt-oss`; its MXFP4 experts packed in MLX's mxfp4 mode, `load.py`).

The config comes from the `{arch}.ssm.*` / `shortconv.*` metadata llama.cpp's
converter writes; tensors are renamed onto mlx-lm's parameters with llama.cpp's own
tensor map (the `gguf` package: the same table its converter used, read the other
way), and the converter's value changes are undone:
- `ssm_a` holds A = -exp(A_log): A_log = log(-A);
- convolution kernels were squeezed to [channels, width]: MLX's Conv1d takes
  [channels, width, 1];
- Mamba-2's `ssm_d` / `ssm_a` were given a trailing 1 and its gated norm split per group
  (Nemotron-H's Mamba layers too);
- Nemotron-H's attention Q/K rows were permuted as for Llama (undone; it has no RoPE, so
  the scores would not change, but the weights are the model's);
- Qwen3-Next's `in_proj_qkvz` was split into `attn_qkv` (all q, all k, all v) and
  `attn_gate` (z): the per-key-head [q, k, v, z] rows are put back together;
- Qwen3.5's value heads were reordered from grouped by key head to tiled (for ggml's
  broadcast) wherever they appear: V rows of `attn_qkv`, `attn_gate`, alpha/beta, A,
  dt, the convolution's V channels and `ssm_out`'s columns; put back in mlx-lm's order;
- DeepSeek's `kv_b_proj` is stored split as `attn_k_b` (transposed) and `attn_v_b`, which
  are exactly mlx-lm's absorbed-MLA `embed_q` and `unembed_out`; older files keep one
  `attn_kv_b`, split here as mlx-lm splits it.
Norm weights need nothing: llama.cpp stores Qwen3-Next's as 1 + w, which is what
mlx-lm's class holds once its own `sanitize` has run on a Hugging Face checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx

from macinfer.gguf.arch import unpermute_rows
from macinfer.gguf.file import ModelLoadError
from macinfer.kernels.dequantize import dequantize_f32

# GGUF architecture -> mlx-lm model_type
ARCHS = {"mamba2": "mamba2", "lfm2": "lfm2", "qwen3next": "qwen3_next", "nemotron_h": "nemotron_h",
         "nemotron_h_moe": "nemotron_h", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe",
         "deepseek2": "deepseek_v3", "glm4moe": "glm4_moe", "glm-dsa": "glm_moe_dsa", "minimax-m2": "minimax",
         "gpt-oss": "gpt_oss"}
# mlx-lm parameter (under a layer) -> the name llama.cpp's converter gave it before its tensor map
_ALIASES = {"mixer.switch_mlp.fc1": "mlp.experts.up_proj", "mixer.switch_mlp.fc2": "mlp.experts.down_proj",
            "block_sparse_moe.switch_mlp.gate_proj": "block_sparse_moe.experts.w1",  # MiniMax's w1/w2/w3
            "block_sparse_moe.switch_mlp.down_proj": "block_sparse_moe.experts.w2",
            "block_sparse_moe.switch_mlp.up_proj": "block_sparse_moe.experts.w3",
            "self_attn.embed_q": "self_attn.k_b_proj", "self_attn.unembed_out": "self_attn.v_b_proj"}


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
    # Text-only positions: mlx-lm rotates the partial rotary dims as plain RoPE (its mrope
    # sections matter only for image positions, which this server does not take).
    config["rope_parameters"] = {"type": "default", "rope_theta": config.pop("rope_theta"),
                                 "partial_rotary_factor": config.pop("partial_rotary_factor")}
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
    rotary (the converter writes the rotated width), q/k norms and biases when stored."""
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", int(get("embedding_length")) // heads))
    return {"num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
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


_CONFIGS = {"mamba2": _mamba2, "lfm2": _lfm2, "qwen3next": _qwen3next, "nemotron_h": _nemotron_h,
            "nemotron_h_moe": _nemotron_h, "qwen35": _qwen35, "qwen35moe": _qwen35, "deepseek2": _deepseek2,
            "glm4moe": _glm4moe, "glm-dsa": _glm_dsa, "minimax-m2": _minimax_m2, "gpt-oss": _gpt_oss}


def config_for(arch: str, get: Callable, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    config = {"model_type": ARCHS[arch], "hidden_size": int(get("embedding_length")),
              "num_hidden_layers": _layers(get), "vocab_size": len(meta["tokenizer.ggml.tokens"]),
              "max_position_embeddings": int(get("context_length", 4096)),
              "tie_word_embeddings": "output.weight" not in names}
    config.update(_CONFIGS[arch](get, meta, names))
    if nextn := int(get("nextn_predict_layers", 0)):  # the MTP blocks kept after the layers (`models/mtp.py`)
        config["num_nextn_predict_layers"] = nextn
    return config


def _rows(parts: list[mx.array], per_head: list[int], heads: int) -> mx.array:
    """Interleave row blocks per head: part i holds `heads` blocks of per_head[i] rows each."""
    blocks = [p.reshape(heads, n, *p.shape[1:]) for p, n in zip(parts, per_head)]
    out = mx.concatenate(blocks, axis=1)
    return out.reshape(-1, *out.shape[2:])


def _untile_v_heads(w: mx.array, axis: int, nk: int, per_k: int) -> mx.array:
    """llama.cpp's tiled value-head order [r, k] back to mlx-lm's grouped [k, r] along `axis`,
    whole heads at a time (so a quantized array's packed columns move with their head)."""
    axis %= w.ndim
    shape = w.shape
    if shape[axis] % (per_k * nk):
        raise ModelLoadError(f"a value head of a {shape} tensor does not span whole quantization groups")
    w = w.reshape(*shape[:axis], per_k, nk, shape[axis] // (per_k * nk), *shape[axis + 1 :])
    return mx.swapaxes(w, axis, axis + 1).reshape(shape)


def _untile_qwen35(config: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if nk == nv:
        return tensors
    per_k, qk = nv // nk, 2 * nk * config["linear_key_head_dim"]
    out = dict(tensors)
    for name, w in tensors.items():
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part == "attn_qkv":  # only the V rows
            out[name] = mx.concatenate([w[:qk], _untile_v_heads(w[qk:], 0, nk, per_k)])
        elif part in ("attn_gate", "ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
            out[name] = _untile_v_heads(w, 0, nk, per_k)
        elif part == "ssm_conv1d":  # only the V channels (weight and bias)
            out[name] = mx.concatenate([w[:qk], _untile_v_heads(w[qk:], 0, nk, per_k)])
        elif part == "ssm_out":  # columns; quantized arrays move whole heads of packed columns
            out[name] = _untile_v_heads(w, -1, nk, per_k)
    return out


def _float(out: dict[str, mx.array], prefix: str, width: int) -> mx.array:
    """`prefix`.weight taken out of `out`, dequantized if the file holds it in blocks."""
    w = out.pop(f"{prefix}.weight")
    if f"{prefix}.scales" not in out:
        return w
    return dequantize_f32(w, out.pop(f"{prefix}.scales"), out.pop(f"{prefix}.biases"), 32, w.shape[-1] * 32 // width)


def _kv_b_as_the_model_takes_it(config: dict[str, Any], out: dict[str, mx.array]) -> dict[str, mx.array]:
    """DeepSeek's kv_b_proj: mlx-lm's V3 file takes it absorbed (k_b transposed, v_b: what new
    files hold), its V2 file whole (what older files hold); either file, either model."""
    heads, nope, rank = config["num_attention_heads"], config["qk_nope_head_dim"], config["kv_lora_rank"]
    whole = config["model_type"] == "deepseek_v2"
    for name in [n for n in out if n.endswith((".attn_v_b.weight" if whole else ".attn_kv_b.weight"))]:
        prefix = name.rsplit(".", 2)[0]
        if whole:  # [k_b^T; v_b] a head
            k_b, v_b = _float(out, f"{prefix}.attn_k_b", nope), _float(out, f"{prefix}.attn_v_b", rank)
            out[f"{prefix}.attn_kv_b.weight"] = mx.concatenate([k_b.swapaxes(-1, -2), v_b], axis=1).reshape(-1, rank)
        else:
            kv_b = _float(out, f"{prefix}.attn_kv_b", rank).reshape(heads, -1, rank)
            out[f"{prefix}.attn_k_b.weight"] = mx.contiguous(kv_b[:, :nope].swapaxes(-1, -2))
            out[f"{prefix}.attn_v_b.weight"] = mx.contiguous(kv_b[:, nope:])
    return out


def _undo_conversion(arch: str, config: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    if arch.startswith("qwen35"):
        tensors = _untile_qwen35(config, tensors)
    out = dict(tensors)
    if arch in ("deepseek2", "glm-dsa"):
        out = _kv_b_as_the_model_takes_it(config, out)
    for name, w in tensors.items():
        if name.endswith(".ssm_a"):
            out[name] = mx.log(-w.astype(mx.float32)).reshape(-1).astype(w.dtype)
        elif name.endswith(".ssm_d"):
            out[name] = w.reshape(-1)
        elif name.endswith((".ssm_conv1d.weight", ".shortconv.conv.weight")):
            if f"{name[:-len('weight')]}scales" in tensors:
                raise ModelLoadError(f"{name}: a quantized convolution kernel is not supported")
            out[name] = w.reshape(*w.shape, 1)
        elif name.endswith(".ssm_norm.weight") and arch != "qwen3next":
            out[name] = w.reshape(-1)
    if arch.startswith("nemotron_h"):  # Q/K rows permuted as llama.cpp's converter does for Llama
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        for name in tensors:
            part = name.split(".")[2] if name.startswith("blk.") else None
            if part in heads:
                out[name] = unpermute_rows(out[name], heads[part])
    if arch == "qwen3next":
        nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
        vdim = config["linear_num_value_heads"] * config["linear_value_head_dim"] // nk  # v (and z) rows a key head
        for name in [n for n in tensors if ".attn_qkv." in n]:
            kind = name.rsplit(".", 1)[1]  # weight / scales / biases
            qkv, z = out.pop(name), out.pop(name.replace(".attn_qkv.", ".attn_gate."))
            q, k, v = qkv[: nk * dk], qkv[nk * dk : 2 * nk * dk], qkv[2 * nk * dk :]
            out[f"{name.split('.attn_qkv.')[0]}.ssm_in.{kind}"] = _rows([q, k, v, z], [dk, dk, vdim, vdim], nk)
    return out


def model_arch(arch: str) -> Any:
    """The `gguf` package's MODEL_ARCH for a GGUF architecture name ("glm4moe" is GLM4_MOE)."""
    import gguf

    return next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def to_model_names(arch: str, model, tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """GGUF tensors -> mlx-lm parameter names of `model` (values converted back)."""
    import gguf
    from mlx.utils import tree_flatten

    tensors = _undo_conversion(arch, config, tensors)
    tmap = gguf.get_tensor_name_map(model_arch(arch), config["num_hidden_layers"])
    modules = dict(model.named_modules())
    out: dict[str, mx.array] = {}
    for param, _ in tree_flatten(model.parameters()):
        base, kind = param.rsplit(".", 1)
        if kind == "dt_bias":  # the converter renamed it dt_proj.bias
            base, kind = f"{base}.dt_proj", "bias"
        elif kind == "sinks":  # gpt-oss's attention sinks: the converter named them sinks.weight
            base, kind = param, "weight"
        elif kind == "e_score_correction_bias":
            base, kind = f"{base}.e_score_correction", "bias"
        rest = base.partition(".layers.")[2]
        if rest and (alias := _ALIASES.get(rest.split(".", 1)[-1])):
            base = f"model.layers.{rest.split('.', 1)[0]}.{alias}"
        base = base.replace(".switch_mlp.", ".experts.")
        if base.startswith("language_model."):  # Qwen3.5's text model (the converter drops the prefix)
            base, full = base[len("language_model."):], param[len("language_model."):]
        else:
            full = param
        gname = tmap.get_name(full) if kind in ("A_log", "D") else tmap.get_name(base)
        key = gname if kind in ("A_log", "D") else f"{gname}.{kind}"
        if gname is None or key not in tensors:
            raise ModelLoadError(f"GGUF ({arch}) has no tensor for {param}" + (f" ({key})" if gname else ""))
        out[param] = tensors[key]
        if kind == "weight" and f"{gname}.scales" in tensors:  # a quantized weight's companions
            biases = tensors.get(f"{gname}.biases")  # (none: MXFP4, MLX's `mxfp4` mode)
            if hasattr(modules.get(param[: -len(".weight")]), "to_quantized"):
                out[f"{param[: -len('weight')]}scales"] = tensors[f"{gname}.scales"]
                if biases is not None:
                    out[f"{param[: -len('weight')]}biases"] = biases
            else:  # a module MLX cannot quantize (a router held as a bare weight): float values
                w, scales = tensors[key], tensors[f"{gname}.scales"]
                bits = w.shape[-1] // scales.shape[-1]  # a group of 32 values packs into `bits` uint32s
                out[param] = dequantize_f32(w, scales, biases, 32, bits, "affine" if biases is not None else "mxfp4")
    return out
