"""Tiny checkpoints of Gemma 3, Gemma 3n, Gemma 4 (and unified), PaliGemma 1/2 and Llama 4."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers import byte_tokenizer
from tests.vision_families.common import TEMPLATE, _tokenizer


def _gemma3(path: str) -> tuple[dict, Any]:
    from transformers import Gemma3ImageProcessor

    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor

    text = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
            "sliding_window": 512, "sliding_window_pattern": 2, "vocab_size": 300, "mm_tokens_per_image": 4,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "patch_size": 14, "image_size": 56}
    cfg = {"model_type": "gemma3", "text_config": text, "vision_config": vision, "image_token_index": 260,
           "hidden_size": 64, "vocab_size": 300, "pad_token_id": 0, "eos_token_id": 2}
    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok = _tokenizer(["<start_of_image>", "<image_soft_token>", "<end_of_image>"], "<start_of_image>", named)
    image_processor = Gemma3ImageProcessor(size={"height": 56, "width": 56})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=4,
                                chat_template=tok.chat_template)
    return cfg, processor


def _gemma4(path: str) -> tuple[dict, Any]:
    """Gemma 4 (E-sized: per-layer inputs; its image tokens attend each other both ways)."""
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor, Gemma4Processor

    text = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
            "sliding_window": 512, "sliding_window_pattern": 2, "vocab_size": 300, "vocab_size_per_layer_input": 300,
            "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 0, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "use_bidirectional_attention": "vision", "use_double_wide_mlp": False,
            # as published (mlx-lm's and mlx-vlm's defaults differ on the global layers' rotary share)
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                   "rope_type": "proportional"},
                                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                                      "rope_type": "default"}}}
    vision = {"model_type": "gemma4_vision", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
              "patch_size": 4, "pooling_kernel_size": 2, "position_embedding_size": 64, "default_output_length": 9}
    cfg = {"model_type": "gemma4", "text_config": text, "vision_config": vision, "image_token_id": 260,
           "boi_token_id": 259, "eoi_token_id": 261, "audio_token_id": 262, "boa_token_id": 263, "eoa_token_id": 264,
           "hidden_size": 64, "vocab_size": 300, "pad_token_id": 0, "eos_token_id": 2,
           "vision_soft_tokens_per_image": 9}
    named = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
             "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    tok = _tokenizer(["<|image>", "<|image|>", "<image|>", "<|audio|>", "<|audio>", "<audio|>", "<|video|>"],
                     "<|image|>", named)
    image_processor = Gemma4ImageProcessor(patch_size=4, max_soft_tokens=9, pooling_kernel_size=2)
    processor = Gemma4Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=9,
                                chat_template=tok.chat_template)
    return cfg, processor


def _gemma4_unified(path: str) -> tuple[dict, Any]:
    """Gemma 4 unified: no vision encoder (each 48 px patch layer-normed, projected and placed
    by a learned 2D position embedding), Gemma 4's decoder with K = V on its global layers.
    The tower's patch sizes are its image processor's defaults: mlx-vlm's `load` swaps the
    checkpoint's image processor for its module's default one."""
    from mlx_vlm.models.gemma4_unified.processing_gemma4_unified import (Gemma4UnifiedImageProcessor,
                                                                         Gemma4UnifiedProcessor)

    cfg, gemma4 = _gemma4(path)
    cfg["model_type"] = "gemma4_unified"
    cfg["text_config"].update({"model_type": "gemma4_unified_text", "attention_k_eq_v": True,
                               "num_global_key_value_heads": 1})
    cfg["vision_config"] = {"model_type": "gemma4_unified_vision", "mm_embed_dim": 32, "output_proj_dims": 32}
    return cfg, Gemma4UnifiedProcessor(image_processor=Gemma4UnifiedImageProcessor(), tokenizer=gemma4.tokenizer,
                                       chat_template=gemma4.tokenizer.chat_template)


def _paligemma(path: str) -> tuple[dict, Any]:
    """PaliGemma: SigLIP, one linear projection, a Gemma prefix LM (the whole prompt attends both
    ways). No chat template, as published: the processor writes the prompt around the text."""
    from transformers import SiglipImageProcessor

    from mlx_vlm.models.paligemma.processing_paligemma import PaliGemmaProcessor

    tok = _tokenizer(["<image>"], "<image>", {"image_token": "<image>"})
    tok.chat_template = None
    image_processor = SiglipImageProcessor(size={"height": 28, "width": 28})
    image_processor.image_seq_length = 4  # (28 / 14)^2 patches, as published checkpoints set it
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok)  # adds <loc>/<seg> tokens
    vocab = len(processor.tokenizer)
    text = {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": vocab,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "patch_size": 14, "image_size": 28, "projection_dim": 64}
    cfg = {"model_type": "paligemma", "text_config": text, "vision_config": vision,
           "image_token_index": tok.convert_tokens_to_ids("<image>"), "hidden_size": 64, "projection_dim": 64,
           "vocab_size": vocab, "pad_token_id": 0, "eos_token_id": 2}
    return cfg, processor


# PaliGemma 2: the same wrapper over a Gemma 2 decoder (soft-capped logits, sandwich norms).
PALIGEMMA_2 = {"model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 16, "sliding_window": 512}


def _llama4(path: str) -> tuple[dict, Any]:
    """Llama 4: a ViT over 56 px tiles, pixel shuffle, an MLP adapter; an MoE language model
    with chunked attention and NoPE layers. Each tile's placeholders are `<|patch|>` tokens."""
    from mlx_vlm.models.llama4.processing_llama4 import Llama4ImageProcessor, Llama4Processor

    text = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 64, "intermediate_size_mlp": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-5, "vocab_size": 300, "num_local_experts": 4, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2, "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0],
            "use_qk_norm": True, "rope_theta": 500000.0, "max_position_embeddings": 4096,
            "bos_token_id": 1, "pad_token_id": 0, "eos_token_id": 2, "attention_bias": False, "rope_scaling": None}
    vision = {"model_type": "llama4_vision_model", "hidden_size": 32, "image_size": 56, "initializer_range": 0.02,
              "intermediate_size": 128, "norm_eps": 1e-5, "num_attention_heads": 2, "num_channels": 3,
              "num_hidden_layers": 2, "patch_size": 14, "pixel_shuffle_ratio": 0.5, "projector_dropout": 0.0,
              "projector_input_dim": 64, "projector_output_dim": 64, "rope_theta": 10000,
              "vision_feature_layer": -1, "vision_feature_select_strategy": "default", "vision_output_dim": 64}
    specials = ["<|image_start|>", "<|image|>", "<|patch|>", "<|image_end|>", "<|tile_x_separator|>",
                "<|tile_y_separator|>"]
    tok = _tokenizer(specials, "<|image|>")
    cfg = {"model_type": "llama4", "text_config": text, "vision_config": vision,
           "image_token_index": tok.convert_tokens_to_ids("<|patch|>"), "eos_token_id": 2}
    processor = Llama4Processor(image_processor=Llama4ImageProcessor(size=56, max_patches=4), tokenizer=tok,
                                patch_size=14, pixel_shuffle_ratio=0.5, chat_template=tok.chat_template)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:  # where its processor reads them
        json.dump({"size": {"height": 56, "width": 56}, "max_patches": 4}, f)
    return cfg, processor


def _tiny_mobilenet() -> None:
    """mlx-vlm builds Gemma 3n's MobileNetV5 tower from a fixed block list whatever the config
    says (300M parameters): the tiny model keeps the last two stages' widths (the fusion adapter
    takes 640 + 1280 channels) with one block of each kind, unexpanded, on 256 px pictures. Set for the test process (mlx-vlm's
    classes read it when the engine loads a checkpoint as when the reference does)."""
    import mlx_vlm.models.gemma3n.vision as v

    v.gemma3n_mobilenet_def = lambda: [
        [v._er(3, 16, 2, 1.0)], [v._uir(3, 5, 32, 2, 1.0)],
        [v._uir(5, 5, 640, 2, 1.0), v._mmqa(2, 16, 2), v._uir(0, 0, 640, 1, 1.0, is_multiscale=True)],
        [v._uir(5, 5, 1280, 2, 1.0), v._mmqa(2, 16, 1), v._uir(0, 0, 1280, 1, 1.0, is_multiscale=True)]]


_tiny_mobilenet()


def _gemma3n(path: str) -> tuple[dict, Any]:
    """Gemma 3n: a MobileNetV5 tower and its fusion adapter (256 rows an image), a vision
    embedding of its own for the vision vocabulary (the image's end token and placeholders),
    AltUp/LAuReL layers with per-layer inputs; an audio tower (audio is refused)."""
    from transformers import PreTrainedTokenizerFast, SiglipImageProcessor
    from transformers.models.gemma3n.feature_extraction_gemma3n import Gemma3nAudioFeatureExtractor

    from mlx_vlm.models.gemma3n.processing_gemma3n import Gemma3nProcessor

    tok = byte_tokenizer()
    def pad(n: int) -> None:
        tok.add_tokens([f"<unused_{i}>" for i in range(tok.get_vocab_size(), n)])
    # Text ids below 300 (the per-layer inputs' vocabulary), the vision vocabulary at 300-307
    # (the image's end token, its placeholders), the audio one at 308-315, as published in kind.
    pad(297)
    tok.add_special_tokens(["<start_of_audio>", "<start_of_image>"])
    pad(300)
    tok.add_special_tokens(["<end_of_image>", "<image_soft_token>"])
    pad(308)
    tok.add_special_tokens(["<end_of_audio>", "<audio_soft_token>"])
    pad(316)
    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>",
             "boa_token": "<start_of_audio>", "audio_token": "<audio_soft_token>", "eoa_token": "<end_of_audio>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>", extra_special_tokens=named)
    fast.chat_template = TEMPLATE.replace("MARKER", "<image_soft_token>")  # (its template writes the placeholder)
    text = {"model_type": "gemma3n_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": [128] * 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 316,
            "vocab_size_per_layer_input": 300, "num_kv_shared_layers": 2, "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": 30.0, "layer_types": ["sliding_attention", "full_attention"] * 2,
            "activation_sparsity_pattern": [0.0] * 4, "hidden_size_per_layer_input": 8, "altup_num_inputs": 2,
            "altup_coef_clip": 120.0, "altup_correct_scale": True, "altup_active_idx": 0, "laurel_rank": 8,
            "sliding_window": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}
    vision = {"model_type": "gemma3n_vision", "hidden_size": 2048, "vocab_size": 8, "vocab_offset": 300,
              "image_size": 256, "rms_norm_eps": 1e-6}
    audio = {"hidden_size": 32, "conf_num_attention_heads": 2, "conf_num_hidden_layers": 1,
             "sscp_conv_channel_size": [8, 4], "vocab_size": 8, "vocab_offset": 308, "input_feat_size": 128}
    cfg = {"model_type": "gemma3n", "text_config": text, "vision_config": vision, "audio_config": audio,
           "image_token_id": 301, "boi_token_id": 298, "eoi_token_id": 300, "audio_token_id": 309,
           "boa_token_id": 297, "eoa_token_id": 308, "hidden_size": 64, "vocab_size": 316,
           "vision_soft_tokens_per_image": 256, "eos_token_id": 2, "pad_token_id": 0}
    image_processor = SiglipImageProcessor(size={"height": 256, "width": 256})
    processor = Gemma3nProcessor(feature_extractor=Gemma3nAudioFeatureExtractor(), image_processor=image_processor,
                                 tokenizer=fast, chat_template=fast.chat_template, image_seq_length=256)
    return cfg, processor
