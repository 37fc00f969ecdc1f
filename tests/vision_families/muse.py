"""Tiny checkpoints of Meta's Muse line: Muse Glimmer (a ViT with 2D RoPE, windowed and full
blocks, 2 x 2 merged; an adapter and projection into a decoder whose every input row is
RMS-normed without a scale, sliding and full layers, soft-capped logits)."""

from __future__ import annotations

from typing import Any

from tests.vision_families.common import _tokenizer


def _muse_glimmer(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.muse_glimmer.processing_muse_glimmer import MuseGlimmerImageProcessor, MuseGlimmerProcessor

    text = {"model_type": "muse_glimmer_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
            "rms_norm_eps": 1e-5, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
            "layer_rope_theta": [10000.0, 0], "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "max_position_embeddings": 2048, "final_logit_softcapping": 20.0, "tie_word_embeddings": False}
    vision = {"model_type": "muse_glimmer_vision", "patch_size": 14, "patch_temporal": 2, "merge_size": 2,
              "pos_emb_height": 4, "pos_emb_width": 4, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 2, "num_hidden_layers": 2, "layer_types": ["window_attention", "full_attention"]}
    tok = _tokenizer(["<|patch|>", "<|image_start|>", "<|image_end|>", "<|video|>", "<|image_placeholder|>"],
                     "<|patch|>")
    cfg = {"model_type": "muse_glimmer", "text_config": text, "vision_config": vision,
           "image_token_id": tok.convert_tokens_to_ids("<|patch|>"),
           "video_token_id": tok.convert_tokens_to_ids("<|video|>"), "out_hidden_size": 128,
           "projector_hidden_size": 64, "eos_token_id": 2}
    image_processor = MuseGlimmerImageProcessor(patch_size=14, merge_size=2, max_image_tokens=16)
    return cfg, MuseGlimmerProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
