"""Tiny checkpoints of Moonshot's Kimi line: Kimi-VL and Kimi K2.5 (MoonViT, a DeepSeek-V3
decoder), Kimi K3 (MoonViT 3D, K3's decoder: Kimi Linear's delta attention beside latent
attention, MoE), each with its own processor."""

from __future__ import annotations

from typing import Any

from tests.vision_families.common import _tokenizer


def _kimi(model_type: str, begin: str, image_processor_cls: type, processor_cls: type) -> tuple[dict, Any]:
    """A MoonViT tower (native resolution, patches merged 2x2) and a DeepSeek-V3 language model
    (multi-head latent attention, MoE), with the family's image marker and processor."""
    text = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 2048, "rope_theta": 10000.0}
    vision = {"model_type": "moonvit", "depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2,
              "intermediate_size": 64, "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
              "merge_kernel_size": [2, 2]}
    cfg = {"model_type": model_type, "text_config": text, "vision_config": vision, "media_placeholder_token_id": 261,
           "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer([begin, "<|media_content|>", "<|media_pad|>", "<|media_end|>"],
                     f"{begin}image<|media_content|><|media_pad|><|media_end|>")
    image_processor = image_processor_cls(patch_size=14, in_token_limit=64, merge_kernel_size=[2, 2])
    processor = processor_cls(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
    return cfg, processor


def _kimi_vl(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.kimi_vl.processing_kimi_vl import KimiVLImageProcessor, KimiVLProcessor

    return _kimi("kimi_vl", "<|media_start|>", KimiVLImageProcessor, KimiVLProcessor)


def _kimi_k25(path: str) -> tuple[dict, Any]:
    """Kimi K2.5: each 2x2-merged patch layer-normed and projected by an MLP (mlx-vlm's own
    processor, which hands back MLX arrays)."""
    from mlx_vlm.models.kimi_k25.processing_kimi_k25 import KimiK25ImageProcessor, KimiK25Processor

    return _kimi("kimi_k25", "<|media_begin|>", KimiK25ImageProcessor, KimiK25Processor)


def _kimi_k3(path: str) -> tuple[dict, Any]:
    """Kimi K3: a MoonViT 3D tower (2 x 2 merged, temporal pooling), an MLP projector with a
    norm after it; its processor writes each image as `<|media_begin|>image WxH` and its
    placeholders where the prompt says `<|kimi_image_placeholder|>` (MLX arrays: an image a call)."""
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import IMAGE_PLACEHOLDER, KimiK3ImageProcessor, KimiK3Processor

    from tests.zoo import tiny_config

    vision = {"model_type": "moonvit3d", "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
              "init_pos_emb_time": 2, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 32,
              "vt_intermediate_size": 64, "qkv_hidden_size": 32, "merge_kernel_size": [2, 2], "mm_hidden_size": 32,
              "text_hidden_size": 64}
    tok = _tokenizer([IMAGE_PLACEHOLDER, "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"],
                     IMAGE_PLACEHOLDER)
    cfg = {"model_type": "kimi_k3", "text_config": tiny_config("kimi_k3")["text_config"], "vision_config": vision,
           "media_placeholder_token_id": tok.convert_tokens_to_ids("<|media_pad|>"), "vocab_size": 300,
           "eos_token_id": 2}
    image_processor = KimiK3ImageProcessor(patch_size=14, in_patch_limit=64, merge_kernel_size=[2, 2])
    return cfg, KimiK3Processor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
