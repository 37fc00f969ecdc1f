"""Gemma 4 written as llama.cpp's Gemma4Model converter writes it (its tensors and metadata;
`tests/gguf_hybrid_writer.py` calls these for the `gemma4` architecture)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# Gemma 4 parameters Gemma4Model's converter names by hand (under blk.N)
_GEMMA4_NAMES = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
                 "layer_scalar": "layer_output_scale.weight",
                 "experts.switch_glu.down_proj.weight": "ffn_down_exps.weight"}


def gemma4_tensors(model, params: dict, tmap) -> dict[str, np.ndarray]:
    """Gemma 4 as Gemma4Model's converter writes it: norms as they are, the experts' gate and up
    fused (gate rows first), the router's scales beside its tensors, the layer scalar as
    `layer_output_scale`, the K/V projections the checkpoint keeps in its KV-shared layers
    (unused: mlx-lm's class has none), and `rope_freqs` marking the global layers' turned pairs."""
    args = model.args
    out = {}
    for name, w in params.items():
        w = np.array(w.astype(mx.float32), dtype=np.float32)
        layer, _, rest = name.partition(".layers.")[2].partition(".")
        if rest in _GEMMA4_NAMES:
            out[f"blk.{layer}.{_GEMMA4_NAMES[rest]}"] = w
        elif rest == "experts.switch_glu.gate_proj.weight":
            up = np.array(params[name.replace("gate_proj", "up_proj")].astype(mx.float32))
            out[f"blk.{layer}.ffn_gate_up_exps.weight"] = np.concatenate([w, up], axis=-2)
        elif rest != "experts.switch_glu.up_proj.weight":
            base, kind = name.rsplit(".", 1)
            out[f"{tmap.get_name(base)}.{kind}"] = w
    rng = np.random.default_rng(5)
    for i in range(args.num_hidden_layers - args.num_kv_shared_layers, args.num_hidden_layers):
        head = args.global_head_dim if args.layer_types[i] == "full_attention" else args.head_dim
        for part in ("attn_k", "attn_v"):
            out[f"blk.{i}.{part}.weight"] = rng.standard_normal((args.num_key_value_heads * head, args.hidden_size),
                                                                dtype=np.float32)
    half = args.global_head_dim // 2
    turned = int(half * args.rope_parameters["full_attention"]["partial_rotary_factor"])
    out["rope_freqs.weight"] = np.array([1.0] * turned + [1e30] * (half - turned), dtype=np.float32)
    return out


def gemma4_meta(w, config: dict) -> None:
    """Gemma4Model's set_gguf_parameters (after Gemma3Model's and the base TextModel's)."""
    from mlx_lm.models.gemma4_text import ModelArgs

    args = ModelArgs.from_dict(config)
    n, shared = args.num_hidden_layers, args.num_kv_shared_layers
    swa = [t == "sliding_attention" for t in args.layer_types]
    rope = args.rope_parameters
    w.add_head_count(args.num_attention_heads)
    kv_full = args.num_global_key_value_heads if args.attention_k_eq_v and args.num_global_key_value_heads else \
        args.num_key_value_heads
    w.add_head_count_kv([args.num_key_value_heads if s else kv_full for s in swa] if kv_full != args.num_key_value_heads
                        else args.num_key_value_heads)
    w.add_key_length(args.global_head_dim)
    w.add_value_length(args.global_head_dim)
    w.add_key_length_swa(args.head_dim)
    w.add_value_length_swa(args.head_dim)
    ff = args.intermediate_size
    wide = args.use_double_wide_mlp and shared
    w.add_feed_forward_length([ff if i < n - shared else 2 * ff for i in range(n)] if wide else ff)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(args.global_head_dim)
    w.add_rope_dimension_count_swa(int(args.head_dim * rope["sliding_attention"].get("partial_rotary_factor", 1.0)))
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    if args.final_logit_softcapping:
        w.add_final_logit_softcapping(args.final_logit_softcapping)
    w.add_sliding_window(args.sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(args.hidden_size_per_layer_input or 0)
    if args.enable_moe_block:
        w.add_expert_count(args.num_experts)
        w.add_expert_used_count(args.top_k_experts)
        w.add_expert_feed_forward_length(args.moe_intermediate_size)
