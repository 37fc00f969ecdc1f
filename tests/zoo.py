"""Tiny random-weight configs for every model_type mlx-lm implements.

Built from each ModelArgs dataclass: required fields get small values by name
(hidden ~64, 2-4 layers, windows and chunks of 8 so 40-token prompts cross them),
then per-family overrides where a family needs consistent shapes. Used by the
architecture matrix (tests/test_architectures.py) and by scripts/architectures.py,
which records what runs in macinfer/models/architectures.json.
"""

from __future__ import annotations

import dataclasses
from typing import Any

WINDOW = 8
# Values for required fields, by name (any family).
BY_NAME: dict[str, Any] = dict(
    hidden_size=64, d_model=64, n_embd=64, hidden_dim=64, dim=64,
    num_hidden_layers=2, n_layer=2, n_layers=2, num_layers=2,
    intermediate_size=128, ffn_hidden_size=128, n_inner=128, ffn_dim=128, intermediate_size_mlp=128,
    moe_intermediate_size=32, expert_ffn_hidden_size=32, shared_intermediate_size=32,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4,
    num_key_value_heads=2, n_kv_heads=2, num_kv_heads=2, multi_query_group_num=2,
    head_dim=16, kv_channels=16,
    rms_norm_eps=1e-5, norm_eps=1e-5, layer_norm_eps=1e-5, layer_norm_epsilon=1e-5, layernorm_epsilon=1e-5,
    norm_epsilon=1e-5,
    vocab_size=300, embedding_size=300, num_vocab=300, model_dim=64,
    max_position_embeddings=2048, n_positions=2048, n_ctx=2048, max_seq_len=2048, seq_length=2048,
    model_max_length=2048, block_size=2048,
    rope_theta=10000.0, rotary_emb_base=10000.0, rope_parameters=None, rope_scaling=None,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_bias=False, bias=False,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, n_shared_experts=1, num_shared_experts=1, num_shared_expert=1, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, first_k_dense_replace=1, routed_scaling_factor=1.0,
    n_group=1, topk_group=1, moe_layer_freq=1,
    sliding_window=WINDOW, sliding_window_size=WINDOW, sliding_window_pattern=2,
    partial_rotary_factor=0.5, rotary_pct=0.5, rotary_dim=8,
    logits_scaling=2.0, attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5,
    qk_norm=False, use_qk_norm=False, post_norm=False, hidden_act="silu",
    kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    dim_model_base=64, scale_depth=1.4, scale_emb=2.0,
)


def _layer_types(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


GEMMA4_TEXT = dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, num_kv_shared_layers=2,
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=300, sliding_window_pattern=2,
                   num_key_value_heads=2, final_logit_softcapping=30.0, use_double_wide_mlp=False,
                   layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=None)

# Per-family overrides (after the generic fill).
OVERRIDES: dict[str, dict[str, Any]] = {
    "afm7": dict(num_kv_reuse_layers=1),
    "baichuan_m1": dict(sliding_window_layers=[0], conv_window=2),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1),
    "dbrx": dict(ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)),
    "exaone4": dict(sliding_window_pattern="LG", head_dim=16),
    "iquestloopcoder": dict(loop_window_size=WINDOW),
    "olmo": dict(mlp_hidden_size=256),  # (its gate and up halves: 2 x 128)
    "plamo": dict(n_shared_head=2),  # (4 query heads over 2 K/V heads, tiled)
    "exaone_moe": dict(is_moe_layer=[False, True], layer_types=["sliding_attention", "full_attention"]),
    "gemma2": dict(query_pre_attn_scalar=16.0, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   sliding_window=WINDOW),
    "gemma3_text": dict(query_pre_attn_scalar=16.0, rope_local_base_freq=10000.0),
    "gemma4_text": GEMMA4_TEXT,
    "gpt_oss": dict(layer_types=_layer_types(2), intermediate_size=64),
    "hunyuan": dict(use_mixed_mlp_moe=False, use_cla=False, cla_share_factor=1, moe_topk=1, num_experts=1,
                    rope_scaling=dict(alpha=1000.0, factor=1.0, type="dynamic")),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                  mamba_d_conv=4, mamba_d_state=8, mamba_expand=2),
    "lfm2": dict(conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, full_attn_idxs=[1]),
    "lfm2_moe": dict(use_expert_bias=False, num_dense_layers=1, conv_bias=False, conv_L_cache=3, full_attn_idxs=[1]),
    "llama4_text": dict(no_rope_layers=[1, 0], attention_chunk_size=WINDOW, use_qk_norm=True),
    "mamba": dict(state_size=8, conv_kernel=4, use_conv_bias=True, time_step_rank=4),
    "falcon_mamba": dict(state_size=8, conv_kernel=4, use_conv_bias=True, time_step_rank=4),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, conv_kernel=4, n_groups=1, use_conv_bias=True,
                   time_step_limit=(0.0, float("inf")), time_step_rank=4),
    "mellum": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[1, 0], moe_layer_freq=[0, 1], add_swa_attention_sink_bias=True,
                          add_full_attention_sink_bias=False, swa_rope_theta=10000.0, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16,
                          topk_method="noaux_tc", scoring_func="sigmoid"),
    "ministral3": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, llama_4_scaling_beta=0.1,
                                            original_max_position_embeddings=1024)),
    "mistral": dict(layer_types=_layer_types(2)),
    "nemotron-nas": dict(block_configs=[dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=1.0)),
                                        dict(attention=dict(n_heads_in_group=4), ffn=dict(ffn_mult=1.0))]),
    # Every block kind: Mamba, attention, MLP and MoE (the last two have no cache at all).
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=8, conv_kernel=4,
                       n_groups=1, use_conv_bias=True, hybrid_override_pattern="M*-E", moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                       num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
                       routed_scaling_factor=1.0),
    "openelm": dict(num_transformer_layers=2, model_dim=64, ffn_dim_divisor=8, num_query_heads=[4, 4],
                    num_kv_heads=[2, 2], ffn_multipliers=[1.0, 1.0], head_dim=16, normalize_qk_projections=True),
    "phi3small": dict(dense_attention_every_n_layers=2, ff_intermediate_size=128, gegelu_limit=20.0,
                      blocksparse_block_size=8, blocksparse_num_local_blocks=2, blocksparse_vert_stride=2),
    "phi3": dict(sliding_window=WINDOW),
    "qwen2_moe": dict(shared_expert_intermediate_size=32),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_d_conv=4,
                      mamba_chunk_size=8, num_hidden_layers=2),
    "plamo2": dict(hidden_size_per_head=16, mamba_d_state=8, mamba_num_heads=4, mamba_chunk_size=8),
    "qwen3_next": dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                       shared_expert_intermediate_size=32),
    # DeepSeek Sparse Attention: an 8-key budget, so the 40-token prompts' queries select
    # (16 index heads: a key whose every head's ReLU score is 0, a tie, is rare).
    "deepseek_v32": dict(index_topk=8, index_n_heads=16, index_head_dim=16),
    "glm_moe_dsa": dict(index_topk=8, index_n_heads=16, index_head_dim=16, topk_method="noaux_tc",
                        scoring_func="sigmoid", rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
                        attention_bias=False),
    "deepseek_v2": dict(rope_scaling=dict(type="yarn", factor=1.0, original_max_position_embeddings=2048,
                                          mscale=1.0, mscale_all_dim=0, beta_fast=32, beta_slow=1)),
    "minicpm3": dict(rope_scaling=dict(type="longrope", short_factor=1.0, long_factor=1.0,
                                       original_max_position_embeddings=2048)),
    "mistral4": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, llama_4_scaling_beta=0.1,
                                          original_max_position_embeddings=8)),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity", zero_expert_num=1,
                          mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "longcat_flash_ngram": dict(attention_method="MLA", zero_expert_type="identity", zero_expert_num=1,
                                mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "kimi_linear": dict(linear_attn_config=dict(kda_layers=[1], num_heads=2, head_dim=16, short_conv_kernel_size=4),
                        model_max_length=2048, num_experts_per_token=2),
    "bailing_hybrid": dict(layer_group_size=2, group_norm_size=1),
    "kimi_k3.text": dict(hidden_act="situ", activation_situ_beta=1.0, activation_situ_linear_beta=1.0,
                         linear_attn_config=dict(kda_layers=[1], num_heads=2, head_dim=16, short_conv_kernel_size=4),
                         model_max_length=2048, num_experts_per_token=2),
    "gear": dict(num_hidden_layers=3, layer_types=["conv_mixer", "sliding_attention", "full_attention"]),
    "recurrent_gemma": dict(conv1d_width=4, logits_soft_cap=30.0, attention_window_size=WINDOW,
                            block_types=["recurrent", "attention"], lru_width=64, embeddings_scale_by_sqrt_dim=True),
    "rwkv7": dict(a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, decay_low_rank_dim=8),
    "spark2_5": dict(rope_parameters={t: dict(rope_type="default", rope_theta=10000.0)
                                      for t in ("sliding_attention", "full_attention")}),
    "stablelm": dict(use_qkv_bias=False),
    "starcoder2": dict(sliding_window=WINDOW),
    "step3p5": dict(num_attention_groups=2, moe_num_experts=4, moe_top_k=2),
    "spark2_5": dict(hidden_act="gelu", rope_parameters={t: dict(rope_type="default", rope_theta=10000.0)
                                                         for t in ("sliding_attention", "full_attention")}),
    "mellum": dict(rope_parameters={t: dict(rope_type="default", rope_theta=10000.0)
                                    for t in ("sliding_attention", "full_attention")}),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                             mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_conv_kernel_dim=4, linear_allow_neg_eigval=False),
    "phi3small": dict(dense_attention_every_n_layers=2, ff_intermediate_size=128, gegelu_limit=20.0,
                      blocksparse_block_size=32, blocksparse_num_local_blocks=2, blocksparse_vert_stride=2),
    "llama4.text": dict(num_hidden_layers=4, attention_chunk_size=WINDOW, interleave_moe_layer_step=2, use_qk_norm=True,
                        num_experts_per_tok=1),
    "qwen3_5.text": dict(num_experts=0, num_experts_per_tok=0, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                         linear_value_head_dim=16, full_attention_interval=2, head_dim=16),
    "gemma3n.text": dict(num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=300,
                         rope_local_base_freq=10000.0, final_logit_softcapping=30.0,
                         layer_types=["sliding_attention", "full_attention"] * 2,
                         activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=8, altup_num_inputs=2,
                         altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0, laurel_rank=8,
                         intermediate_size=[128] * 4),
    # Language models only mlx-vlm implements (`macinfer/models/mlx_vlm_text.py`).
    "cohere2_moe": dict(layer_types=["full_attention", "sliding_attention"]),  # its dense first layer is full
    "deepseek_v4": dict(head_dim=16, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=8,
                        index_block=4, index_keep=2, num_hash_layers=1, num_hidden_layers=4),
    "kolibri1": dict(shared_expert_intermediate_size=32),
    "limite": dict(rope_n_pairs=4, attn_gate_channels=8, ve_dim=8, ve_gate_channels=4, ve_stored_heads=2, ve_layers=[1],
                   xsa_layers=[0], global_layers=[1], mudd_inter=8,
                   softcap_logits=dict(kind="sigmoid", a=30.0, b=0.0, c=4.0)),  # (its head's sigmoid cap: a 0 would zero every logit)
    "longcat_flash_sparse": dict(zero_expert_type="identity", zero_expert_num=1, attention_method="LSA",
                                 index_n_heads=2, index_head_dim=16, index_topk=WINDOW),
    "qwen3_5_text": dict(num_experts=0, num_experts_per_tok=0, linear_num_value_heads=2, linear_num_key_heads=2,
                         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         full_attention_interval=2, rope_parameters=dict(
                             rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1])),
    # A Qwen3.5 whose MLP and embedding are Hadamard-rotated 2-bit packs (blocks of 512 and up).
    "prism_hadamard_qwen35.text": dict(hidden_size=512, intermediate_size=1024, head_dim=32),
    "prism_hadamard_qwen35": dict(
        schema_version=2, tensor_namespace="mlx-vlm-qwen3_5", gdn_activation_layout="grouped",
        quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": f"model.layers.{i}.mlp.{p}", "embedding": False, "dtype": "float16",
                  "block": 1024 if p == "down_proj" else 512} for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
        + [{"path": "model.embed_tokens", "embedding": True, "dtype": "float16", "block": 512}]),
    "minimax_m3_vl.text": dict(moe_layer_freq=None, num_local_experts=4, dense_intermediate_size=128,
                               shared_intermediate_size=32, head_dim=16, rotary_dim=8),
    "muse_spark.text": dict(post_norm_eps=1e-5, layer_rope_theta=[10000.0, 0.0], final_logit_softcapping=30.0,
                            output_multiplier=1.0, moe_hidden_size=32, mlp_layer_types=["sparse", "sparse"],
                            num_shared_experts=0, rope_parameters=dict(rope_theta=10000.0)),
}

# Vision-language (and other) wrappers: the text model's model_type when the module has no text args class.
TEXT_OF = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "gemma4_unified": "gemma4_text", "mistral3": "ministral3",
           "llava": "ministral3", "pixtral": "llama", "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2",
           "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe", "lfm2-vl": "lfm2", "kimi_k25": "deepseek_v3",
           "kimi_vl": "deepseek_v3", "kimi_k3": "kimi_linear",
           "qwen3_5_moe": "qwen3_5", "prism_hadamard_qwen35": "qwen3_5"}


def _fill(fields, model_type: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {"model_type": model_type}
    for f in fields:
        if f.name in BY_NAME:
            cfg[f.name] = BY_NAME[f.name]
        elif f.name == "layer_types":
            cfg[f.name] = _layer_types(BY_NAME["num_hidden_layers"])
    return cfg


def _mlx_vlm_module(model_type: str) -> Any:
    import importlib

    try:
        return importlib.import_module(f"mlx_vlm.models.{model_type}")
    except ImportError:
        return None


def tiny_config(model_type: str, **extra: Any) -> dict[str, Any]:
    """A config mlx-lm's class for `model_type` accepts, tiny."""
    from macinfer.models.mlx_lm_classes import import_model_module

    try:
        module = import_model_module(model_type)
        fields = dataclasses.fields(module.ModelArgs)
    except (ImportError, SystemExit):  # olmo's module exits when ai2-olmo is missing
        module, fields = None, ()
        vlm = _mlx_vlm_module(model_type)
        if vlm is not None and dataclasses.is_dataclass(getattr(vlm, "ModelConfig", None)):
            module, fields = None, dataclasses.fields(vlm.ModelConfig)  # a language model only mlx-vlm has
    cfg = _fill(fields, model_type)
    if any(f.name == "text_config" for f in fields):
        text_args = next((getattr(module, n) for n in ("TextConfig", "TextArgs", "TextModelArgs") if hasattr(module, n)), None)
        if text_args is not None:
            text = _fill(dataclasses.fields(text_args), TEXT_OF.get(model_type, model_type))
            text.update(OVERRIDES.get(f"{model_type}.text", {}))
        elif model_type in TEXT_OF:
            text = tiny_config(TEXT_OF[model_type])
            text = dict(text.get("text_config", text))  # (a wrapper's: its text part)
            text.update(OVERRIDES.get(f"{model_type}.text", {}))
        else:
            text = dict(cfg)
        cfg["text_config"] = text
        cfg["vocab_size"] = text.get("vocab_size", BY_NAME["vocab_size"])
    cfg.update(OVERRIDES.get(model_type, {}))
    if model_type == "qwen3_5_moe_text":
        cfg.update(OVERRIDES["qwen3_5_text"], model_type=model_type, num_experts=4, num_experts_per_tok=2,
                   shared_expert_intermediate_size=32)
    if model_type == "qwen3_5_moe":  # the MoE text model: qwen3_5's tiny text config, with experts
        cfg["text_config"] = {**tiny_config("qwen3_5")["text_config"], "model_type": "qwen3_5_moe", "num_experts": 4,
                              "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32}
    cfg.update(extra)
    cfg.setdefault("eos_token_id", 2)
    return cfg
