"""GGUF files of llama.cpp's recurrent, hybrid, MLA and tensor-mapped MoE architectures written by
the tests as its converter writes them (its tensor map's names, A as -exp(A_log), squeezed
convolution kernels, split or fused projections; Gemma 4's in `tests/gguf_gemma4.py`), with the
metadata its model classes write."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten

from macinfer.gguf.hybrid import model_arch
from tests.gguf_writer import _write_tensors, permute_qk, write_vocab


def hybrid_tensors(arch: str, config: dict, model, kv_b_split: bool = True) -> dict[str, np.ndarray]:
    """GGUF tensors of an mlx-lm Mamba-2 / LFM2 / Qwen3-Next model as llama.cpp's converter
    writes them: its tensor map's names; A as -exp(A_log); convolution kernels squeezed to
    [channels, width]; Mamba-2's A and D as [heads, 1] and its norm per group; Qwen3-Next's
    in_proj_qkvz split into attn_qkv (all q, all k, all v) and attn_gate (z)."""
    config = config.get("text_config", config)
    layers = len(config["hybrid_override_pattern"]) if "hybrid_override_pattern" in config else config["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(model_arch(arch), layers)
    mamba2 = arch in ("mamba2", "nemotron_h", "nemotron_h_moe", "granitehybrid")  # Mamba2Model's conversion
    out = {}
    params = dict(tree_flatten(model.parameters()))
    if arch == "gemma4":
        from tests.gguf_gemma4 import gemma4_tensors

        return gemma4_tensors(model, params, tmap)
    if arch == "gemma3n":
        return _gemma3n_tensors(params, tmap)
    for name, w in params.items():
        w = np.array(w.astype(mx.float32), dtype=np.float32)
        name = name.removeprefix("language_model.")  # Qwen3.5's text model
        if arch.startswith("qwen35"):
            w = tile_v_heads(name, w, config)
        base, kind = name.rsplit(".", 1)
        if kind in ("A_log", "D"):
            gname = tmap.get_name(name)
            if kind == "A_log":
                w = -np.exp(w)
            out[gname] = w.reshape(-1, 1) if mamba2 else w
            continue
        if kind == "sinks":  # gpt-oss: the converter names them sinks.weight
            out[tmap.get_name(name) + ".weight"] = w
            continue
        if kind == "dt_bias":
            base, kind = f"{base}.dt_proj", "bias"
        if kind == "e_score_correction_bias":
            base, kind = f"{base}.e_score_correction", "bias"
        if kind == "expert_bias":  # (LFM2-MoE's, which the converter names expert_bias.bias)
            base, kind = f"{base}.expert_bias", "bias"
        if base.endswith("self_attn.kv_b_proj") and kv_b_split:  # mlx-lm's DeepSeek V2 file keeps it whole
            per_head = w.reshape(config["num_attention_heads"], -1, w.shape[-1])
            k_b, v_b = np.split(per_head, [config["qk_nope_head_dim"]], axis=1)
            out[tmap.get_name(base.replace("kv_b_proj", "k_b_proj")) + ".weight"] = k_b.swapaxes(-1, -2)
            out[tmap.get_name(base.replace("kv_b_proj", "v_b_proj")) + ".weight"] = v_b
            continue
        if base.endswith(("self_attn.embed_q", "self_attn.unembed_out")):
            # llama.cpp splits kv_b_proj into k_b (transposed) and v_b: mlx-lm's two, as they are
            if kv_b_split:
                base = base.replace("embed_q", "k_b_proj").replace("unembed_out", "v_b_proj")
            elif base.endswith("embed_q"):  # an older file: the one kv_b_proj, per head [k_b^T; v_b]
                v_b = np.array(params[base.replace("embed_q", "unembed_out") + ".weight"].astype(mx.float32))
                w = np.concatenate([w.swapaxes(-1, -2), v_b], axis=1).reshape(-1, w.shape[1])
                base = base.replace("embed_q", "kv_b_proj")
            else:
                continue
        if arch == "bailingmoe2" and (base.endswith("mlp.gate.gate_proj") or kind == "expert_bias"):  # (HF's mlp.gate)
            layer = base.split(".")[2]
            out[f"blk.{layer}.exp_probs_b.bias" if kind == "expert_bias" else f"blk.{layer}.ffn_gate_inp.weight"] = w
            continue
        if arch == "granitehybrid" and (part := _GRANITE_HYBRID.get(base.split(".", 3)[-1])):
            layer = base.split(".")[2]
            if part == "shared":  # GraniteMoeModel's split of the fused shared MLP (gate rows first)
                gate, up = np.split(w, 2, axis=0)
                out[f"blk.{layer}.ffn_gate_shexp.weight"], out[f"blk.{layer}.ffn_up_shexp.weight"] = gate, up
            else:
                out[f"blk.{layer}.{part}.weight"] = w
            continue
        for mine, theirs in (("mixer.switch_mlp.fc1", "mlp.experts.up_proj"), ("mixer.switch_mlp.fc2", "mlp.experts.down_proj"),
                             ("block_sparse_moe.switch_mlp.gate_proj", "block_sparse_moe.experts.w1"),
                             ("block_sparse_moe.switch_mlp.down_proj", "block_sparse_moe.experts.w2"),
                             ("block_sparse_moe.switch_mlp.up_proj", "block_sparse_moe.experts.w3")):
            if base.endswith(mine):  # the converter merges experts under these names
                base = f"model.layers.{base.split('.')[2]}.{theirs}"
        gname = tmap.get_name(base.replace(".switch_mlp.", ".experts."))
        assert gname is not None, f"no GGUF name for {name}"
        if base.endswith(("conv1d", "conv.conv")) and kind == "weight":
            w = w[..., 0]
        if mamba2 and base.endswith(("mixer.norm", "mamba.norm")):
            w = w.reshape(config.get("n_groups", config.get("mamba_n_groups")), -1)
        if (arch.startswith("nemotron_h") or arch == "granitehybrid") and base.endswith(("q_proj", "k_proj")):
            w = permute_qk(w, config["num_attention_heads" if base.endswith("q_proj") else "num_key_value_heads"])
        if base.endswith("in_proj_qkvz"):
            nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
            dv = config["linear_num_value_heads"] * config["linear_value_head_dim"] // nk
            per_head = w.reshape(nk, 2 * dk + 2 * dv, -1)
            q, k, v, z = np.split(per_head, [dk, 2 * dk, 2 * dk + dv], axis=1)
            out[gname.replace("ssm_in", "attn_qkv") + ".weight"] = np.concatenate(
                [q.reshape(-1, w.shape[1]), k.reshape(-1, w.shape[1]), v.reshape(-1, w.shape[1])])
            out[gname.replace("ssm_in", "attn_gate") + ".weight"] = z.reshape(-1, w.shape[1])
            continue
        out[f"{gname}.{kind}"] = w
    if arch == "llama4" and config.get("rope_scaling"):  # LlamaModel's generate_extra_tensors
        from macinfer.gguf.tensor_config import llama3_factors

        out["rope_freqs.weight"] = np.array(llama3_factors(config["head_dim"], config["rope_theta"],
                                                           config["rope_scaling"]), dtype=np.float32)
    return out


def _gemma3n_tensors(params: dict, tmap) -> dict[str, np.ndarray]:
    """Gemma 3n as Gemma3NModel's converter writes it: names under `model.` (no `language_model.`),
    norms as they are, the AltUp projections stacked into one tensor each, `*_scale` parameters
    given a `.weight`."""
    out, stacks = {}, {}
    for name, w in params.items():
        w = np.array(w.astype(mx.float32), dtype=np.float32)
        name = name.replace("model.language_model.", "model.", 1)
        if name.startswith(("model.altup_projections.", "model.altup_unembed_projections.")):
            group, i = name.split(".")[1], int(name.split(".")[2])
            stacks.setdefault(group, {})[i] = w
            continue
        base, kind = name.rsplit(".", 1)
        if kind == "correct_output_scale":
            out[f"{tmap.get_name(name)}.weight"] = w
            continue
        out[f"{tmap.get_name(base)}.{kind}"] = w
    for group, ws in stacks.items():
        out[f"{tmap.get_name('model.' + group)}.weight"] = np.stack([ws[i] for i in sorted(ws)])
    return out


# Granite 4.0 H's MoE parts, as GraniteMoeModel's converter names them
_GRANITE_HYBRID = {"shared_mlp.input_linear": "shared", "block_sparse_moe.switch_mlp.gate_proj": "ffn_gate_exps",
                   "block_sparse_moe.switch_mlp.up_proj": "ffn_up_exps",
                   "block_sparse_moe.switch_mlp.down_proj": "ffn_down_exps"}


def tile_v_heads(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """Qwen3.5's value heads from grouped by key head [k, r] to llama.cpp's tiled [r, k]."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if nk == nv or ".linear_attn." not in name:
        return w

    def tile(x: np.ndarray, axis: int) -> np.ndarray:
        axis %= x.ndim
        shape = x.shape
        x = x.reshape(*shape[:axis], nk, nv // nk, shape[axis] // nv, *shape[axis + 1 :])
        return np.swapaxes(x, axis, axis + 1).reshape(shape)

    qk = 2 * nk * config["linear_key_head_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight", "conv1d.bias")):
        return np.concatenate([w[:qk], tile(w[qk:], 0)])
    if name.endswith(("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return tile(w, 0)
    if name.endswith("out_proj.weight"):
        return tile(w, 1)
    return w


def _ssm_meta(w, conv: int, state: int, groups: int, inner: int, heads: int) -> None:
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)


def _moe_meta(w, count: int, used: int, ff: int, shared_ff: int) -> None:
    w.add_expert_count(count)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(ff)
    w.add_expert_shared_feed_forward_length(shared_ff)


def _attention_meta(w, config: dict) -> None:
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_feed_forward_length(config["intermediate_size"])


def _routed_meta(w, config: dict, gating) -> None:
    """DeepSeek-style routed experts (DeepseekV2Model's and Glm4MoeModel's keys)."""
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_count(config["n_routed_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_shared_count(config["n_shared_experts"])
    w.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gating)


def write_hybrid_gguf(path: str, arch: str, config: dict, tensors: dict[str, np.ndarray],
                      quant: dict[str, Q] | None = None, nextn: int = 0, tokenizer: dict | None = None,
                      extra_meta: dict | None = None) -> None:
    """The metadata llama.cpp's converter writes for `arch`, a byte vocabulary (or `tokenizer`,
    as `write_gguf` takes it), the tensors (those named in `quant` stored in that block type)."""
    w = gguf.GGUFWriter(path, arch)
    config = config.get("text_config", config)
    layers = len(config["hybrid_override_pattern"]) if "hybrid_override_pattern" in config else config["num_hidden_layers"]
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(layers + nextn)  # multi-token-prediction blocks counted as the converter does
    if nextn:
        w.add_nextn_predict_layers(nextn)
    if arch.startswith("nemotron_h"):
        pattern = config["hybrid_override_pattern"]
        w.add_head_count(config["num_attention_heads"])
        w.add_head_count_kv([config["num_key_value_heads"] if c == "*" else 0 for c in pattern])
        ff = config.get("moe_intermediate_size") if arch.endswith("moe") else config["intermediate_size"]
        w.add_feed_forward_length([ff if c in "-E" else 0 for c in pattern])
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
        _ssm_meta(w, config["conv_kernel"], config["ssm_state_size"], config["n_groups"],
                  config["mamba_num_heads"] * config["mamba_head_dim"], config["mamba_num_heads"])
        w.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
        if arch.endswith("moe"):
            _moe_meta(w, config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
                      config["moe_shared_expert_intermediate_size"])
            w.add_expert_shared_count(config["n_shared_experts"])
            w.add_expert_weights_norm(config["norm_topk_prob"])
            w.add_expert_weights_scale(config["routed_scaling_factor"])
            w.add_expert_group_count(config["n_group"])
    elif arch in ("olmoe", "qwen2moe"):  # OlmoeModel's / Qwen2MoeModel's (the base TextModel's)
        _attention_meta(w, config)
        if arch == "qwen2moe":
            _moe_meta(w, config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
                      config["shared_expert_intermediate_size"])
        else:
            w.add_expert_count(config["num_experts"])
            w.add_expert_used_count(config["num_experts_per_tok"])
    elif arch == "gemma3n":  # Gemma3NModel's (Gemma3Model's, then its own)
        import math

        from mlx_lm.models.gemma3n import TextConfig

        t = TextConfig.from_dict(config)
        _attention_meta(w, {**config, "rope_theta": t.rope_theta, "intermediate_size": list(t.intermediate_size)})
        w.add_rope_freq_base_swa(t.rope_local_base_freq)
        w.add_final_logit_softcapping(t.final_logit_softcapping)
        w.add_sliding_window(t.sliding_window)
        w.add_sliding_window_pattern([k == "sliding_attention" for k in t.layer_types])
        w.add_shared_kv_layers(t.num_kv_shared_layers)
        w.add_embedding_length_per_layer_input(t.hidden_size_per_layer_input)
        w.add_altup_active_idx(t.altup_active_idx)
        w.add_altup_num_inputs(t.altup_num_inputs)
        # the converter's torch Normal(0, 1).icdf(p): -inf for 0
        w.add_activation_sparsity_scale([math.sqrt(2) * _erfinv(2 * p - 1) if p > 0 else -math.inf
                                         for p in t.activation_sparsity_pattern])
    elif arch == "bailingmoe2":  # BailingMoeV2Model's (the base TextModel's, then its own)
        _attention_meta(w, config)
        w.add_rope_dimension_count(config["rotary_dim"])
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        _moe_meta(w, config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
                  config["moe_intermediate_size"] * config["num_shared_experts"])
        w.add_expert_shared_count(config["num_shared_experts"])
        w.add_expert_weights_scale(config["routed_scaling_factor"])
        w.add_expert_weights_norm(config["norm_topk_prob"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if config.get("score_function") == "sigmoid"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_expert_group_count(config["n_group"])
        w.add_expert_group_used_count(config["topk_group"])
    elif arch == "granitehybrid":  # GraniteHybridModel's: GraniteMoeModel's, then the Mamba and attention ones
        kinds = config["layer_types"]
        w.add_head_count(config["num_attention_heads"])
        w.add_head_count_kv([config["num_key_value_heads"] if k == "attention" else 0 for k in kinds])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_feed_forward_length(config["intermediate_size"])
        for key, value in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                           ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
            w.add_float32(f"granitehybrid.{key}", config[value])
        if config.get("num_local_experts"):
            _moe_meta(w, config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"],
                      config["shared_intermediate_size"])
        _ssm_meta(w, config["mamba_d_conv"], config["mamba_d_state"], config["mamba_n_groups"],
                  config["mamba_n_heads"] * config["mamba_d_head"], config["mamba_n_heads"])
        w.add_rope_scaling_finetuned(config.get("position_embedding_type", "rope") != "nope")
    elif arch == "mamba2":
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        _ssm_meta(w, config["conv_kernel"], config["state_size"], config["n_groups"],
                  config["num_heads"] * config["head_dim"], config["num_heads"])
        w.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
    elif arch in ("lfm2", "lfm2moe"):  # (LFM2MoeModel's: LFM2's, with its experts')
        full = set(config["full_attn_idxs"])
        w.add_head_count(config["num_attention_heads"])
        w.add_head_count_kv([config["num_key_value_heads"] if i in full else 0
                             for i in range(config["num_hidden_layers"])])
        w.add_rope_freq_base(config.get("rope_theta", 1e6))
        w.add_shortconv_l_cache(config["conv_L_cache"])
        w.add_layer_norm_rms_eps(config["norm_eps"])
        w.add_feed_forward_length(config.get("block_ff_dim") or config["intermediate_size"])
        if arch == "lfm2moe":
            w.add_expert_count(config["num_experts"])
            w.add_expert_used_count(config["num_experts_per_tok"])
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
            w.add_leading_dense_block_count(config["num_dense_layers"])
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    elif arch in ("deepseek2", "glm-dsa"):  # GlmMoeDsaModel: DeepseekV2Model's, and the indexer's
        rope, kv_lora = config["qk_rope_head_dim"], config["kv_lora_rank"]
        w.add_head_count(config["num_attention_heads"])
        w.add_head_count_kv(1)  # MLA stored as MQA
        w.add_rope_freq_base(config["rope_theta"])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        if config.get("q_lora_rank"):
            w.add_q_lora_rank(config["q_lora_rank"])
        w.add_kv_lora_rank(kv_lora)
        w.add_key_length(kv_lora + rope)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(config["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(config["v_head_dim"])
        _routed_meta(w, config, gguf.ExpertGatingFuncType.SOFTMAX if config["model_type"] == "deepseek_v2"
                     else gguf.ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(rope)
        if (scaling := config.get("rope_scaling")) is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(scaling["factor"])
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
        if arch == "glm-dsa":
            w.add_indexer_head_count(config["index_n_heads"])
            w.add_indexer_key_length(config["index_head_dim"])
            w.add_indexer_top_k(config["index_topk"])
            w.add_expert_group_count(config["n_group"])
    elif arch in ("qwen3next", "qwen35", "qwen35moe"):
        head_dim = config["head_dim"]
        _attention_meta(w, config)
        if config.get("num_experts"):
            _moe_meta(w, config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
                      config["shared_expert_intermediate_size"])
        _ssm_meta(w, config.get("linear_conv_kernel_dim", 4), config["linear_key_head_dim"],  # (mlx-lm's default)
                  config["linear_num_key_heads"], config["linear_value_head_dim"] * config["linear_num_value_heads"],
                  config["linear_num_value_heads"])
        w.add_full_attention_interval(config.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 0.25)))
    elif arch == "glm4moe":  # Glm4MoeModel's set_gguf_parameters (the base TextModel's, then its own)
        _attention_meta(w, config)
        w.add_rope_dimension_count(int(config["head_dim"] * config.get("partial_rotary_factor", 0.5)))
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        _routed_meta(w, config, gguf.ExpertGatingFuncType.SIGMOID)
    elif arch == "gpt-oss":  # GptOssModel's (the base TextModel's, then its own)
        _attention_meta(w, config)
        w.add_expert_count(config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_sliding_window(config["sliding_window"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
    elif arch == "llama4":  # Llama4Model's (LlamaModel's, then its own)
        _attention_meta(w, {**config, "intermediate_size": config["intermediate_size_mlp"]})
        w.add_rope_dimension_count(config["head_dim"])
        w.add_expert_count(config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
    elif arch == "gemma4":
        from tests.gguf_gemma4 import gemma4_meta

        gemma4_meta(w, config)
    elif arch == "minimax-m2":  # MiniMaxM2Model's (the base TextModel's, then its own)
        _attention_meta(w, config)
        w.add_expert_count(config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_feed_forward_length(config["intermediate_size"])
        w.add_rope_dimension_count(config["rotary_dim"])
    for key, value in (extra_meta or {}).items():
        w.add_array(key, value) if isinstance(value, list) else w.add_uint32(key, value)
    write_vocab(w, tokenizer, config["vocab_size"])
    _write_tensors(w, tensors, quant, encode=True)


def _erfinv(y: float) -> float:
    """erf's inverse by Newton's method (the standard library has none)."""
    import math

    x = 0.0
    for _ in range(60):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x
