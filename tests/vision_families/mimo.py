"""Xiaomi's MiMo-V2 (the omni model's image path): a Qwen2.5-VL-style tower of its own with
windowed attention and attention sinks, Qwen2.5-VL's processor, MiMo-V2-Flash's decoder
(hybrid sliding-window and full layers, MoE) with its text config at the root."""

from __future__ import annotations

from typing import Any

from tests.vision_families.qwen import qwen_vl_processor


def _mimo_v2(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.mimo_v2.processing import MiMoV2Processor

    # layer 0 full attention with a dense MLP, layer 1 sliding with experts (its own head widths)
    text = {"model_type": "mimo_v2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "v_head_dim": 8, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 1, "swa_head_dim": 16,
            "swa_v_head_dim": 8, "partial_rotary_factor": 0.5, "rope_theta": 1000000.0, "swa_rope_theta": 10000.0,
            "sliding_window_size": 128, "hybrid_layer_pattern": [0, 1], "moe_layer_freq": [0, 1],
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "vocab_size": 300,
            "max_position_embeddings": 2048, "layernorm_epsilon": 1e-5, "attention_value_scale": 0.707}
    # block 0 windowed (by columns, with sinks), block 1 full
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "num_heads": 2,
              "num_key_value_heads": 1, "qk_channels": 16, "patch_size": 14, "spatial_patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "visual_token_window_size": 4,
              "fullatt_block_indexes": [1], "vit_window_attn_types": [1, -1]}
    # (its audio encoder is built with the model; audio parts are refused by the engine)
    audio = {"out_hidden_size": 64, "audio_channels": 2, "group_size": 2, "input_local_attn_heads": 2,
             "input_local_dim": 32, "input_local_head_dim": 16, "input_local_intermediate_size": 64,
             "input_local_layers": 1, "speech_vocab_size": 16, "speech_zeroemb_idx": 8}
    cfg = {**text, "vision_config": vision, "audio_config": audio, "image_token_id": 260, "video_token_id": 262,
           "vision_start_token_id": 259, "vision_end_token_id": 261, "audio_token_id": 263, "eos_token_id": 2}
    return cfg, qwen_vl_processor(MiMoV2Processor, ("<|audio_pad|>",))
