"""Tiny checkpoints of the LLaVA line and its kin (a tower, a projector, placeholders spliced):
LLaVA, LLaVA-NeXT, Granite Vision, LLaVA-OneVision, LLaVA-Bunny, FastVLM, Mistral 3 / Pixtral,
Mistral Large 3, Idefics 2/3, SmolVLM, InternVL, Aya Vision."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.vision_families.common import TEXT, _tokenizer


def _llava_bunny(path: str) -> tuple[dict, Any]:
    """nanoLLaVA's layout: a Qwen2 decoder's config at the root, a SigLIP tower (27 x 27
    patches: mlx-vlm's merge takes 729 rows), one sentinel id (-200) an image in the prompt,
    and a tokenizer for a processor (mlx-vlm's own image processor beside it)."""
    text = {k: v for k, v in TEXT.items() if k != "model_type"}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "image_size": 384, "patch_size": 14}
    cfg = {"model_type": "llava-qwen2", **text, "vision_config": vision, "mm_hidden_size": 32,
           "mm_projector_type": "mlp2x_gelu", "image_token_index": -200, "auto_map": {}, "eos_token_id": 2}
    return cfg, _tokenizer([], "<image>")


def _tiny_fastvit() -> None:
    """mlx-vlm builds FastVLM's FastViTHD tower from block lists kept as class attributes,
    not config fields (125M parameters): the tiny model keeps the five stages with one block
    each and narrow widths (the last stage's attention heads are 32 wide). Set for the test
    process, as Gemma 3n's list is (`_tiny_mobilenet`)."""
    from mlx_vlm.models.fastvlm import config as fastvlm_config

    v = fastvlm_config.VisionConfig
    v.layers, v.embed_dims, v.mlp_ratios = [1, 1, 1, 1, 1], [8, 16, 16, 32, 64], [2, 2, 2, 2, 2]


_tiny_fastvit()


def _fastvlm(path: str) -> tuple[dict, Any]:
    """Apple's FastVLM: a FastViTHD tower (a 64x downsampling conv/attention hybrid, 2 x 64
    channels out), a two-layer projector, a Qwen2 decoder with its config at the root; one
    sentinel id (-200) an image in the prompt, grown into the image's rows at the merge."""
    from mlx_vlm.models.fastvlm.processing import FastVLMImageProcessor, FastVLMProcessor

    text = {k: v for k, v in TEXT.items() if k != "model_type"}
    vision = {"model_type": "llava_qwen2", "hidden_size": 32, "intermediate_size": 64, "image_size": 128,
              "patch_size": 64, "projection_dim": 48}
    cfg = {"model_type": "llava_qwen2", **text, "vision_config": vision, "mm_hidden_size": 128,
           "mm_projector_type": "mlp2x_gelu", "image_token_index": -200, "eos_token_id": 2}
    sizes = {"size": {"shortest_edge": 128}, "crop_size": {"height": 128, "width": 128}}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:  # what its processor reads back
        json.dump(sizes, f)
    tok = _tokenizer([], "<image>")
    return cfg, FastVLMProcessor(image_processor=FastVLMImageProcessor(**sizes), tokenizer=tok,
                                 chat_template=tok.chat_template)


def _llava(path: str) -> tuple[dict, Any]:
    from transformers import CLIPImageProcessor

    from mlx_vlm.models.llava.processing_llava import LlavaProcessor

    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "projection_dim": 32}
    cfg = {"model_type": "llava", "text_config": TEXT, "vision_config": vision, "image_token_index": 259,
           "vision_feature_select_strategy": "default", "vision_feature_layer": -2, "vocab_size": 300,
           "eos_token_id": 2}
    tok = _tokenizer(["<image>"], "<image>")
    image_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tok.chat_template)
    return cfg, processor


def _mistral3(path: str, model_type: str = "mistral3") -> tuple[dict, Any]:
    from mlx_vlm.models.mistral3.processing_mistral3 import Mistral3Processor
    from mlx_vlm.models.pixtral.image_processing_pixtral import PixtralImageProcessor
    from mlx_vlm.models.pixtral.processing_pixtral import PixtralProcessor

    vision = {"model_type": "pixtral", "hidden_size": 32, "head_dim": 16, "num_hidden_layers": 2,
              "intermediate_size": 64, "num_attention_heads": 2, "image_size": 56, "patch_size": 14}
    text = {**TEXT, "model_type": "mistral", "head_dim": 16, "rope_theta": 1000000.0}
    merge = 2 if model_type == "mistral3" else 1  # Pixtral 12B merges no patches
    cfg = {"model_type": model_type, "text_config": text, "vision_config": vision, "image_token_index": 259,
           "spatial_merge_size": merge, "vision_feature_layer": -1, "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "[IMG]")
    image_processor = PixtralImageProcessor(size={"longest_edge": 56}, patch_size={"height": 14, "width": 14})
    processor_class = Mistral3Processor if model_type == "mistral3" else PixtralProcessor
    processor = processor_class(image_processor=image_processor, tokenizer=tok, patch_size=14,
                                spatial_merge_size=merge, chat_template=tok.chat_template)
    return cfg, processor


DEEPSEEK_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                 "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "topk_method", "scoring_func",
                 "norm_topk_prob", "n_group", "topk_group", "rms_norm_eps", "rope_theta")


def _mistral_large3(path: str) -> tuple[dict, Any]:
    """Mistral Large 3: Mistral 3's Pixtral tower and merge over a DeepSeek-V3 decoder (its
    language model alone is checked, `tests/test_vlm_text_models.py`: its checkpoints ship
    Mistral's own processor files, which neither transformers nor mlx-vlm loads)."""
    from tests.zoo import tiny_config

    cfg, processor = _mistral3(path, "mistral3")
    ds = tiny_config("deepseek_v3")
    text = {k: ds[k] for k in DEEPSEEK_KEYS if k in ds}
    text.update({"model_type": "mistral_large3", "vocab_size": 300, "max_position_embeddings": 2048})
    cfg.update({"model_type": "mistral_large3", "text_config": text, "image_token_id": 259})
    return cfg, processor


def _idefics3(path: str, model_type: str = "idefics3") -> tuple[dict, Any]:
    from transformers import Idefics3ImageProcessor, SmolVLMImageProcessor

    from mlx_vlm.models.idefics3.processing_idefics3 import Idefics3Processor
    from mlx_vlm.models.smolvlm.processing_smolvlm import SmolVLMProcessor

    vision = {"model_type": "idefics3_vision", "hidden_size": 32, "num_attention_heads": 2, "patch_size": 14,
              "num_hidden_layers": 2, "intermediate_size": 64, "image_size": 56}
    cfg = {"model_type": model_type, "text_config": TEXT, "vision_config": vision, "scale_factor": 2,
           "image_token_id": 260, "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"], "<image>")
    image_class, processor_class = ((Idefics3ImageProcessor, Idefics3Processor) if model_type == "idefics3"
                                    else (SmolVLMImageProcessor, SmolVLMProcessor))
    image_processor = image_class(do_image_splitting=False, size={"longest_edge": 56},
                                  max_image_size={"longest_edge": 56})
    processor = processor_class(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                                chat_template=tok.chat_template)
    return cfg, processor


def _idefics2(path: str) -> tuple[dict, Any]:
    """Idefics2: SigLIP-like tower, a perceiver resampler (a fixed number of latents per image)."""
    from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

    from mlx_vlm.models.idefics2.processing_idefics2 import Idefics2Processor

    vision = {"model_type": "idefics2_vision", "hidden_size": 32, "num_attention_heads": 2, "patch_size": 14,
              "num_hidden_layers": 2, "intermediate_size": 64, "image_size": 56}
    perceiver = {"model_type": "idefics2_perceiver", "num_key_value_heads": 2, "resampler_depth": 1,
                 "resampler_head_dim": 16, "resampler_n_heads": 2, "resampler_n_latents": 4}
    cfg = {"model_type": "idefics2", "text_config": {**TEXT, "model_type": "mistral"}, "vision_config": vision,
           "perceiver_config": perceiver, "image_token_id": 260, "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>"], "<image>")
    image_processor = Idefics2ImageProcessorPil(do_image_splitting=False, size={"shortest_edge": 56,
                                                                               "longest_edge": 56})
    processor = Idefics2Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                                  chat_template=tok.chat_template)
    return cfg, processor


def _granite_vision(path: str) -> tuple[dict, Any]:
    """Granite Vision: LLaVA-NeXT's anyres packing over a SigLIP tower's features from several
    layers side by side, a Granite language model (its muP multipliers)."""
    cfg, processor = _llava_next(path)
    cfg.update(model_type="granite_vision", vision_feature_layer=[-2, -1], vision_feature_select_strategy="full")
    cfg["text_config"] = {**TEXT, "model_type": "granite", "embedding_multiplier": 4.0, "attention_multiplier": 0.25,
                          "residual_multiplier": 0.5, "logits_scaling": 2.0, "attention_bias": False, "mlp_bias": False}
    cfg["vision_config"] = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2,
                            "intermediate_size": 64, "num_attention_heads": 2, "image_size": 56, "patch_size": 14}
    processor.vision_feature_select_strategy, processor.num_additional_image_tokens = "full", 0
    return cfg, processor


def _granite4_vision(path: str) -> tuple[dict, Any]:
    """Granite 4 Vision: a SigLIP tower whose layers feed windowed Q-Former projectors, each
    packed as LLaVA-NeXT's anyres and added to the image rows before the decoder layer its
    config maps (DeepStack and spatial-offset projectors); a dense Granite 4 decoder
    (`granitemoehybrid`, a fused shared MLP, muP multipliers). mlx-vlm's Q-Former is 64-wide
    a head: the tiny tower is 64 wide."""
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from mlx_vlm.models.granite4_vision.processing_granite4_vision import Granite4VisionProcessor

    pinpoints = [[64, 64], [64, 128], [128, 64], [128, 128]]
    text = {"model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 96,
            "shared_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 300, "max_position_embeddings": 2048, "rope_theta": 10000.0,
            "embedding_multiplier": 4.0, "attention_multiplier": 0.25, "residual_multiplier": 0.5,
            "logits_scaling": 2.0, "tie_word_embeddings": True}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 64, "num_hidden_layers": 2,
              "intermediate_size": 64, "num_attention_heads": 2, "image_size": 64, "patch_size": 8}
    # layer 0 takes a projector's features as the image's input rows; layers 1 and 2 get more added
    cfg = {"model_type": "granite4_vision", "text_config": text, "vision_config": vision, "image_token_index": 259,
           "image_grid_pinpoints": pinpoints, "vision_feature_select_strategy": "full", "downsample_rate": "2/4",
           "deepstack_layer_map": [[-1, 0], [1, 2]], "use_spatial_sampling": True, "spatial_vision_layer": -1,
           "spatial_target_layers": [1, 2], "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer(["<image>"], "<image>")
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64},
                                                 image_grid_pinpoints=pinpoints)
    processor = Granite4VisionProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                                        vision_feature_select_strategy="full", downsample_rate="2/4",
                                        chat_template=tok.chat_template)
    return cfg, processor


def _llava_next(path: str) -> tuple[dict, Any]:
    """LLaVA-NeXT: a whole-image tile and high-resolution tiles ("anyres"), packed as transformers
    does (unpadded, a newline embedding after each row): the engine's own merge."""
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    pinpoints = [[56, 56], [56, 112], [112, 56], [112, 112]]  # tiles of 4 x 4 patches: enough to cut padding away
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "image_size": 56, "patch_size": 14, "projection_dim": 32}
    cfg = {"model_type": "llava_next", "text_config": TEXT, "vision_config": vision, "image_token_index": 259,
           "image_grid_pinpoints": pinpoints, "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
           "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer(["<image>"], "<image>")
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
                                                 image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=tok.chat_template)
    return cfg, processor


def _aya_vision(path: str) -> tuple[dict, Any]:
    """Aya Vision: SigLIP tiles (a global one after the crops), pixel shuffle, Cohere2 language model."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from mlx_vlm.models.aya_vision.processing_aya_vision import AyaVisionProcessor

    text = {"model_type": "cohere2", "hidden_size": 64, "head_dim": 16, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "sliding_window": 512, "sliding_window_pattern": 2, "max_position_embeddings": 2048,
            "layer_norm_eps": 1e-5, "logit_scale": 0.0625, "rope_theta": 50000.0}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "patch_size": 14, "image_size": 56}
    cfg = {"model_type": "aya_vision", "text_config": text, "vision_config": vision, "image_token_index": 262,
           "downsample_factor": 2, "alignment_intermediate_size": 64, "vision_feature_layer": -1,
           "vision_feature_select_strategy": "full", "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer(["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>",
                      "TILE", "TILE_GLOBAL"], "<image>")
    image_processor = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True,
                                               min_patches=1, max_patches=2)
    processor = AyaVisionProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14, img_size=56,
                                   downsample_factor=2, chat_template=tok.chat_template)
    return cfg, processor


def _internvl(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.internvl_chat.processor import InternVLChatProcessor, InternVLImageProcessor

    vision = {"model_type": "intern_vit_6b", "hidden_size": 32, "num_attention_heads": 2, "patch_size": 14,
              "num_hidden_layers": 2, "intermediate_size": 64, "image_size": 56}
    text = {**TEXT, "model_type": "qwen2", "rope_theta": 1000000.0, "attention_bias": True}
    cfg = {"model_type": "internvl_chat", "text_config": text, "vision_config": vision, "image_token_index": 261,
           "downsample_ratio": 0.5, "force_image_size": 56, "max_dynamic_patch": 2, "use_thumbnail": True,
           "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer(["<img>", "</img>", "<IMG_CONTEXT>"], "<image>\n")
    processor = InternVLChatProcessor(image_processor=InternVLImageProcessor(size=56, dynamic_max_num=2),
                                      tokenizer=tok, chat_template=tok.chat_template, image_size=56, patch_size=14)
    tok.save_pretrained(path)  # (its processor saves nothing itself)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "InternVLChatProcessor", "image_size": 56, "patch_size": 14,
                   "downsample_ratio": 0.5}, f)
    return cfg, processor


def _internvl_hf(path: str) -> tuple[dict, Any]:
    """InternVL 3.5 in transformers' layout (`internvl`): InternViT, pixel shuffle, a Qwen3 decoder."""
    from mlx_vlm.models.internvl.processing_internvl import InternVLImageProcessor, InternVLProcessor

    vision = {"model_type": "internvl_vision", "hidden_size": 32, "num_attention_heads": 2, "patch_size": 14,
              "num_hidden_layers": 2, "intermediate_size": 64, "image_size": 56}
    text = {**TEXT, "model_type": "qwen3", "head_dim": 16, "rope_theta": 1000000.0}
    cfg = {"model_type": "internvl", "text_config": text, "vision_config": vision, "image_token_id": 261,
           "downsample_ratio": 0.5, "max_dynamic_patch": 2, "use_thumbnail": True, "vocab_size": 300,
           "eos_token_id": 2}
    tok = _tokenizer(["<img>", "</img>", "<IMG_CONTEXT>"], "<IMG_CONTEXT>\n")
    processor = InternVLProcessor(image_processor=InternVLImageProcessor(size=56, dynamic_max_num=2),
                                  tokenizer=tok, num_image_token=4, chat_template=tok.chat_template)
    tok.save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "InternVLProcessor", "image_seq_length": 4}, f)
    processor.save_pretrained = lambda _path: None  # (written above)
    return cfg, processor


def _llava_onevision(path: str) -> tuple[dict, Any]:
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from mlx_vlm.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    cfg = {"model_type": "llava_onevision", "text_config": {**TEXT, "model_type": "qwen2", "rope_theta": 1000000.0},
           "vision_config": vision, "image_token_index": 259, "video_token_index": 260,
           "image_grid_pinpoints": pinpoints, "vision_aspect_ratio": "anyres_max_9",
           "vision_feature_select_strategy": "full", "vision_feature_layer": -1, "vocab_size": 300, "eos_token_id": 2}
    tok = _tokenizer(["<image>", "<video>"], "<image>")
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints)
    processor = LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tok, num_image_tokens=4,
                                        vision_feature_select_strategy="full")
    tok.save_pretrained(path)
    image_processor.save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 4,
                   "vision_feature_select_strategy": "full"}, f)
    processor.save_pretrained = lambda _path: None  # (written above)
    return cfg, processor
