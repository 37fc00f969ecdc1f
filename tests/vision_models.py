"""Tiny random vision-language checkpoints built with mlx-vlm's own classes (a tiny vision
tower, a tiny language model, an offline byte tokenizer and the family's processor), and
mlx-vlm's own greedy generation on them: the reference for the engine's image path."""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from macinfer.vision.processor_fixes import mend
from tests.helpers import byte_tokenizer, randomize_packs

# A chat template that renders image parts as the family's marker (real checkpoints ship their own).
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}MARKER{% else %}"
            "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}<assistant>")

TEXT = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 300,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False}


def _tokenizer(specials: list[str], marker: str, named: dict | None = None):
    from transformers import PreTrainedTokenizerFast

    tok = byte_tokenizer()
    tok.add_special_tokens(specials)
    # Every id the 300-row model can emit is a token (mlx-vlm's detokenizer fails on others).
    tok.add_tokens([f"<unused_{i}>" for i in range(300 - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>",
                                   **({"extra_special_tokens": named} if named else {}))
    fast.chat_template = TEMPLATE.replace("MARKER", marker)
    return fast


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


def _qwen2_vl(path: str, model_type: str = "qwen2_vl") -> tuple[dict, Any]:
    from transformers import Qwen2VLImageProcessor

    from mlx_vlm.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    if model_type == "qwen2_vl":
        vision = {"model_type": model_type, "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "mlp_ratio": 2}
    else:  # Qwen2.5-VL: windowed attention in the tower but for the listed blocks
        vision = {"model_type": model_type, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                  "out_hidden_size": 64, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]}
    text = {**TEXT, "model_type": model_type, "rope_theta": 1000000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}  # head_dim 16: 8 frequencies
    cfg = {**text, "vision_config": vision, "image_token_id": 260, "video_token_id": 262,
           "vision_start_token_id": 259, "eos_token_id": 2}
    tok = _tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
                     "<|vision_start|><|image_pad|><|vision_end|>")
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                            temporal_patch_size=2, merge_size=2)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
    processor.video_processor = image_processor  # (saved once; no video processor without torchvision)
    return cfg, processor


def _tiny_dots_ids() -> None:
    """mlx-vlm's dots.ocr processor fixes its placeholder ids to the published vocabulary's
    (151665, 151656), which the 300-row tiny tokenizer cannot hold: for the test process they
    are read from the tokenizer, as the published ids are its ids (as `_tiny_fastvit`)."""
    from mlx_vlm.models.dots_ocr.processing_dots_ocr import DotsVLProcessor

    init = DotsVLProcessor.__init__

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
        init(self, image_processor, tokenizer, **kwargs)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    DotsVLProcessor.__init__ = __init__


_tiny_dots_ids()


def _dots_ocr(path: str) -> tuple[dict, Any]:
    """dots.ocr: a NaViT-style tower (2D RoPE, RMSNorm, SwiGLU, one frame a patch), patches
    merged 2x2, a Qwen2 decoder with its config at the root and plain positions; Qwen-VL's
    image processor and placeholder expansion under its own tokens."""
    from transformers import Qwen2VLImageProcessor

    from mlx_vlm.models.dots_ocr.processing_dots_ocr import DotsVLProcessor

    text = {k: v for k, v in TEXT.items() if k != "model_type"}
    vision = {"model_type": "dots_vit", "embed_dim": 32, "hidden_size": 64, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 1}
    cfg = {"model_type": "dots_ocr", **text, "attention_bias": True, "vision_config": vision,
           "image_token_id": 260, "video_token_id": 262, "eos_token_id": 2}
    tok = _tokenizer(["<|img|>", "<|imgpad|>", "<|endofimg|>", "<|video_pad|>"], "<|img|><|imgpad|><|endofimg|>")
    tok.image_token, tok.video_token = "<|imgpad|>", "<|video_pad|>"
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                            temporal_patch_size=1, merge_size=2)
    return cfg, DotsVLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)


def _qwen3_family(model_type: str, text: dict, deepstack: list[int]) -> tuple[dict, Any]:
    """Qwen3-VL and Qwen3.5: the same tower (DeepStack layers or none), tokens and processor."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, Qwen3VLProcessor

    vision = {"model_type": model_type, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
              "out_hidden_size": 64, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 16, "deepstack_visual_indexes": deepstack}
    cfg = {"model_type": model_type, "text_config": text, "vision_config": vision, "image_token_id": 260,
           "video_token_id": 262, "vision_start_token_id": 259, "vision_end_token_id": 261, "eos_token_id": 2}
    tok = _tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
                     "<|vision_start|><|image_pad|><|vision_end|>")
    image_processor = Qwen3VLImageProcessor(patch_size=14, min_pixels=56 * 56, max_pixels=112 * 112)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=image_processor,
                                 chat_template=tok.chat_template)
    return cfg, processor


def _mage_vl(path: str) -> tuple[dict, Any]:
    """Mage-VL: a ViT with 3D RoPE over a stock Qwen3 decoder (plain positions), Qwen-VL's
    placeholders and image processor."""
    from mlx_vlm.models.mage_vl.processing_mage_vl import MageVLProcessor
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    text = {**TEXT, "model_type": "qwen3", "head_dim": 16, "rope_theta": 1000000.0}
    vision = {"model_type": "mage_vl_vision", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "patch_size": 16, "image_size": 64, "spatial_merge_size": 2,
              "temporal_patch_size": 1, "out_hidden_size": 64, "text_hidden_size": 64}
    cfg = {"model_type": "mage_vl", "text_config": text, "vision_config": vision, "image_token_id": 260,
           "video_token_id": 262, "vision_start_token_id": 259, "vision_end_token_id": 261, "eos_token_id": 2}
    tok = _tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
                     "<|vision_start|><|image_pad|><|vision_end|>")
    sizes = {"patch_size": 16, "temporal_patch_size": 1, "merge_size": 2, "min_pixels": 64 * 64,
             "max_pixels": 128 * 128}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:  # what its processor reads back
        json.dump(sizes, f)
    image_processor = Qwen3VLImageProcessor(**sizes)
    return cfg, MageVLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)


def _qwen3_vl(path: str) -> tuple[dict, Any]:
    text = {**TEXT, "model_type": "qwen3", "head_dim": 16, "rope_theta": 1000000.0,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
    return _qwen3_family("qwen3_vl", text, [0, 1])


def _qwen3_vl_moe(path: str) -> tuple[dict, Any]:
    text = {**TEXT, "model_type": "qwen3_vl_moe_text", "head_dim": 16, "rope_theta": 1000000.0,
            "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "moe_intermediate_size": 32, "norm_topk_prob": True,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
    return _qwen3_family("qwen3_vl_moe", text, [0, 1])


def _qwen3_5(path: str, moe: bool = False) -> tuple[dict, Any]:
    text = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
            "vocab_size": 300, "max_position_embeddings": 2048, "full_attention_interval": 2,
            "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
            "rope_parameters": {"type": "default", "mrope_section": [3, 3, 2], "rope_theta": 100000,
                                "partial_rotary_factor": 0.5, "mrope_interleaved": True}}
    if moe:
        text.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)
    return _qwen3_family("qwen3_5_moe" if moe else "qwen3_5", text, [])


def _prism(path: str) -> tuple[dict, Any]:
    """A Prism Hadamard pack of Qwen3.5: its MLP and embedding 2-bit packs with a Hadamard
    rotation folded in (blocks of 512 and 1024: a 512-wide decoder), the rest Qwen3.5's."""
    cfg, processor = _qwen3_5(path)
    cfg["text_config"].update(hidden_size=512, intermediate_size=1024)
    cfg["vision_config"]["out_hidden_size"] = 512
    modules = [{"path": f"model.layers.{i}.mlp.{p}", "embedding": False, "dtype": "float16",
                "block": 1024 if p == "down_proj" else 512} for i in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    modules.append({"path": "model.embed_tokens", "embedding": True, "dtype": "float16", "block": 512})
    cfg.update(model_type="prism_hadamard_qwen35", schema_version=2, tensor_namespace="mlx-vlm-qwen3_5",
               gdn_activation_layout="grouped", quantization={"bits": 2, "group_size": 128, "mode": "affine"},
               modules=modules)
    return cfg, processor


def _indic_ocr(path: str) -> tuple[dict, Any]:
    """IndicOCR's OCR stage: Qwen3.5 under its own model type (mlx-vlm's class is Qwen3.5's)."""
    cfg, processor = _qwen3_5(path)
    return {**cfg, "model_type": "indic_ocr"}, processor


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


def _glm4v(path: str) -> tuple[dict, Any]:
    """GLM-4.1V: Qwen-style patches, multimodal RoPE in sections over even/odd pairs, half the
    head's dims rotated, GLM-4's decoder."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from mlx_vlm.models.glm4v.processing import Glm46VProcessor

    text = {"model_type": "glm4v_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]},
            "max_position_embeddings": 2048, "attention_bias": True, "eos_token_id": [2], "pad_token_id": 0}
    vision = {"model_type": "glm4v", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "patch_size": 14, "image_size": 56, "out_hidden_size": 64, "spatial_merge_size": 2,
              "temporal_patch_size": 2}
    cfg = {"model_type": "glm4v", "text_config": text, "vision_config": vision, "image_token_id": 260,
           "image_token_index": 260, "video_token_id": 262, "video_token_index": 262, "vision_start_token_id": 259,
           "vision_end_token_id": 261, "hidden_size": 64, "vocab_size": 300, "eos_token_id": 2}
    named = {"image_token": "<|image|>", "video_token": "<|video|>"}
    tok = _tokenizer(["<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|video|>"],
                     "<|begin_of_image|><|image|><|end_of_image|>", named)
    image_processor = Glm4vImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2,
                                             size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    processor = Glm46VProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
    return cfg, processor


def _glm4v_moe(path: str) -> tuple[dict, Any]:
    """GLM-4.5V: GLM-4.1V's tower, prompt and multimodal RoPE over GLM-4.5's MoE decoder."""
    cfg, processor = _glm4v(path)
    cfg["text_config"].update({"model_type": "glm4v_moe_text", "moe_intermediate_size": 32, "norm_topk_prob": True,
                               "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 4,
                               "routed_scaling_factor": 1.0, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                               "use_qk_norm": False, "rms_norm_eps": 1e-5})
    cfg["model_type"] = cfg["vision_config"]["model_type"] = "glm4v_moe"
    return cfg, processor


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


def _lfm2_vl(path: str) -> tuple[dict, Any]:
    """LFM2-VL: a SigLIP2 NaFlex tower (patches packed to a budget, spatial shapes), 2x2 pixel
    unshuffle, a layer-normed MLP projector; LFM2 language model (short convolutions and
    attention layers). Small pictures go whole, without tiles."""
    from transformers import Lfm2VlProcessor

    from mlx_vlm.models.lfm2_vl.processing_lfm2_vl import Lfm2VlNumpyImageProcessor
    from tests.zoo import tiny_config

    text = {**tiny_config("lfm2"), "vocab_size": 300, "max_position_embeddings": 2048}
    vision = {"model_type": "lfm2_vl", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "patch_size": 16, "num_patches": 64, "image_size": 128}
    cfg = {"model_type": "lfm2_vl", "text_config": text, "vision_config": vision, "image_token_id": 259,
           "downsample_factor": 2, "encoder_patch_size": 16, "max_image_tokens": 16, "min_image_tokens": 4,
           "max_num_patches": 64, "projector_hidden_size": 64, "do_image_splitting": False, "vocab_size": 300,
           "eos_token_id": 2}
    tok = _tokenizer(["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"], "<image>")
    image_processor = Lfm2VlNumpyImageProcessor(downsample_factor=2, encoder_patch_size=16, min_image_tokens=4,
                                                max_image_tokens=16, tile_size=128, do_image_splitting=False)
    processor = Lfm2VlProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
    processor.image_processor.do_image_splitting = False  # (its init puts the official tiling defaults back)
    return cfg, processor


def _paddleocr_vl(path: str) -> tuple[dict, Any]:
    """PaddleOCR-VL: a NaViT-style SigLIP tower (native resolution, 2x2 merge), multimodal RoPE in
    chunked sections, an ERNIE-4.5 decoder; its text parameters at the config's root."""
    from mlx_vlm.models.paddleocr_vl.processing_paddleocr_vl import ImageProcessor, PaddleOCRVLProcessor

    # hidden 1024: mlx-vlm's projector is built to 1024 outputs whatever the config says
    text = {"model_type": "paddleocr_vl", "hidden_size": 1024, "num_hidden_layers": 2, "intermediate_size": 256,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "use_bias": False,
            "rms_norm_eps": 1e-5, "vocab_size": 300, "max_position_embeddings": 2048, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "default", "type": "default", "mrope_section": [16, 24, 24]},
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
    vision = {"model_type": "paddleocr_vl", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "patch_size": 14, "image_size": 56, "spatial_merge_size": 2}
    cfg = {**text, "vision_config": vision, "image_token_id": 260, "video_token_id": 262,
           "vision_start_token_id": 259, "vision_end_token_id": 261}
    tok = _tokenizer(["<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>", "<|video_pad|>"],
                     "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>")
    image_processor = ImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=1,
                                     merge_size=2)
    processor = PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
    return cfg, processor


def _glm_ocr(path: str) -> tuple[dict, Any]:
    """GLM-OCR: GLM-4V's tower and even/odd sectioned multimodal RoPE, all of each head rotated."""
    from mlx_vlm.models.glm_ocr.processing import Glm46VImageProcessor, GlmOcrProcessor

    text = {"model_type": "glm_ocr_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
            "max_position_embeddings": 2048, "eos_token_id": [2], "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "partial_rotary_factor": 1.0,
                                "rope_theta": 10000}}
    vision = {"model_type": "glm_ocr_vision", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "patch_size": 14, "image_size": 56, "out_hidden_size": 64, "spatial_merge_size": 2,
              "temporal_patch_size": 2}
    cfg = {"model_type": "glm_ocr", "text_config": text, "vision_config": vision, "image_token_id": 260,
           "video_token_id": 262, "image_start_token_id": 259, "image_end_token_id": 261,
           "video_start_token_id": 263, "video_end_token_id": 264, "vocab_size": 300, "eos_token_id": [2]}
    named = {"image_token": "<|image|>", "video_token": "<|video|>"}
    tok = _tokenizer(["<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|video|>", "<|begin_of_video|>",
                      "<|end_of_video|>"], "<|begin_of_image|><|image|><|end_of_image|>", named)
    image_processor = Glm46VImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56,
                                           max_pixels=112 * 112)
    processor = GlmOcrProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
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


# MiniCPM-V 4.7's MoE form: a Qwen3.5-MoE decoder.
MINICPMV_MOE = {"model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
# PaliGemma 2: the same wrapper over a Gemma 2 decoder (soft-capped logits, sandwich norms).
PALIGEMMA_2 = {"model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 16, "sliding_window": 512}


def _minicpmv(path: str, model_type: str = "minicpmv4_6", moe: bool = False) -> tuple[dict, Any]:
    """MiniCPM-V 4.6: a SigLIP tower merged 2x2 inside (after `insert_layer_id`) and 2x2 after,
    an image as a whole view and slices, each `<image>`/`<slice>` around its placeholders, the
    image's number before it; a Qwen3.5 language model with plain positions. 4.7 (`moe`: its
    Qwen3.5-MoE form) lays the views on a canvas of multimodal RoPE positions."""
    from mlx_vlm.models.minicpmv4_6.processing_minicpmv4_6 import (MiniCPMVImageProcessor, MiniCPMVProcessor,
                                                                  MiniCPMVVideoProcessor)
    from mlx_vlm.models.minicpmv4_7.processing_minicpmv4_7 import MiniCPMV4_7Processor

    cfg, _ = _qwen3_5(path, moe=moe)
    text = {**cfg["text_config"], "vocab_size": 300}
    vision = {"model_type": "minicpmv4_6_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 112, "patch_size": 14}
    cfg = {"model_type": model_type, "text_config": text, "vision_config": vision, "insert_layer_id": 0,
           "image_size": 112, "patch_size": 14, "query_num": 4, "eos_token_id": 2,
           "slice_config": {"model_type": model_type, "patch_size": 14, "max_slice_nums": 4, "scale_resolution": 112}}
    specials = ["<image>", "</image>", "<slice>", "</slice>", "<image_id>", "</image_id>", "<|image_pad|>",
                "<|video_pad|>"]
    tok = _tokenizer(specials, "<image>./</image>")
    kw = dict(max_slice_nums=4, patch_size=14, scale_resolution=112, image_feature_size=4)
    if model_type == "minicpmv4_7":
        ids = {f"{k}_id": tok.convert_tokens_to_ids(t) for k, t in (
            ("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>"), ("image_start", "<image>"),
            ("image_end", "</image>"), ("slice_start", "<slice>"), ("slice_end", "</slice>"))}
        cfg.update(ids, newline_id=tok.encode("\n", add_special_tokens=False)[0], mrope_mode="canvas",
                   downsample_mode="16x")
        return cfg, MiniCPMV4_7Processor(image_processor=MiniCPMVImageProcessor(**kw),
                                         video_processor=MiniCPMVVideoProcessor(**kw), tokenizer=tok,
                                         chat_template=tok.chat_template)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:  # where its processor reads them
        json.dump(kw, f)
    processor = MiniCPMVProcessor(image_processor=MiniCPMVImageProcessor(**kw),
                                  video_processor=MiniCPMVVideoProcessor(**kw), tokenizer=tok,
                                  chat_template=tok.chat_template)
    return cfg, processor


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


# Families whose image tokens attend each other both ways (transformers' rule), which mlx-vlm's
# generation runs causally: their reference is mlx-vlm's classes with that mask (`both_ways_greedy`).
BOTH_WAYS = {"gemma3"}
# Families whose published merge mlx-vlm's departs from: their reference packs the image as
# transformers does (`anyres_greedy`).
ANYRES = {"llava_next", "granite_vision"}
# Families whose mlx-vlm forward departs from transformers' beyond the image (Gemma 3n's text
# rows and KV-sharing layers): their reference is `gemma3n_greedy`.
TEXT_FIXED = {"gemma3n"}
# Families with no chat template (prefix LMs): the reference prompt is mlx-vlm's own format.
PROMPT_ONLY = {"paligemma"}
TIED = {"gemma3", "gemma3n", "gemma4", "gemma4_unified", "paligemma"}  # checkpoints with the embedding as the output head

BUILDERS = {"llava": _llava, "dots_ocr": _dots_ocr, "llava_bunny": _llava_bunny, "fastvlm": _fastvlm, "gemma4_unified": _gemma4_unified, "glm4v_moe": _glm4v_moe, "mage_vl": _mage_vl, "gemma3n": _gemma3n, "llama4": _llama4, "minicpmv4_6": _minicpmv,
            "minicpmv4_7": lambda path: _minicpmv(path, "minicpmv4_7"), "paligemma": _paligemma, "aya_vision": _aya_vision, "internvl": _internvl_hf, "llava_next": _llava_next, "granite_vision": _granite_vision, "glm_ocr": _glm_ocr, "paddleocr_vl": _paddleocr_vl, "kimi_vl": _kimi_vl, "kimi_k25": _kimi_k25, "lfm2_vl": _lfm2_vl, "glm4v": _glm4v, "idefics2": _idefics2, "gemma3": _gemma3, "gemma4": _gemma4, "llava_onevision": _llava_onevision, "internvl_chat": _internvl, "qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl_moe,
            "qwen3_5_moe": lambda path: _qwen3_5(path, moe=True), "idefics3": _idefics3, "pixtral": lambda path: _mistral3(path, "pixtral"), "smolvlm": lambda path: _idefics3(path, "smolvlm"), "qwen3_5": _qwen3_5, "prism_hadamard_qwen35": _prism, "indic_ocr": _indic_ocr, "mistral3": _mistral3, "qwen2_vl": _qwen2_vl,
            "qwen2_5_vl": lambda path: _qwen2_vl(path, "qwen2_5_vl")}


def tiny_vlm_dir(base: str, family: str, seed: int = 0, text: dict | None = None, vision: dict | None = None,
                 max_pixels: int | None = None) -> str:
    """A checkpoint folder as mlx-community publishes one: config, weights, tokenizer, processor.
    `text`, `vision`: sizes over the tiny ones (benchmarks); `max_pixels`: the processor's cap."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    path = os.path.join(str(base), f"{family}-{seed}" + ("-sized" if text or vision or max_pixels else ""))
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    cfg, processor = BUILDERS[family](path)
    (cfg["text_config"] if "text_config" in cfg else cfg).update(text or {})
    cfg["vision_config"].update(vision or {})
    if max_pixels:
        processor.image_processor.max_pixels = max_pixels
    module, _ = get_model_and_args(cfg)
    loaded = {**cfg, "text_config": cfg.get("text_config", {})}  # as mlx-vlm's load_model sees it
    conf = update_module_configs(module.ModelConfig.from_dict(loaded), module, loaded,
                                 ["text", "vision", "perceiver", "projector", "audio"])  # as its load_model
    mx.random.seed(seed)
    model = module.Model(conf)
    # Norms jittered off 1 so a mix-up shows in the logits.
    params = {k: (v + 0.1 * mx.random.normal(v.shape) if "norm" in k else v)
              for k, v in tree_flatten(model.parameters())}
    # A router initialised to zeros (mlx-vlm's DeepSeek gate) ties every expert, and libraries
    # break ties differently: random rows instead.
    params = {k: (0.5 * mx.random.normal(v.shape) if k.endswith("gate.weight") and not mx.any(v).item() else v)
              for k, v in params.items()}
    randomize_packs(params)
    if family in TIED:  # as published: no lm_head (mlx-vlm copies the embedding, mlx-lm ties it)
        params.pop("language_model.lm_head.weight", None)
    mx.eval(params)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), params)
    processor.save_pretrained(path)
    return path


def picture(seed: int, size: tuple[int, int] = (40, 50)):
    """A random RGB picture (height, width)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8"))


def _mx(v: Any) -> Any:
    return v if isinstance(v, (list, tuple, dict, str)) else mx.array(v)


def mlx_vlm_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """mlx-vlm's own load, processor and generation loop, greedy: the reference tokens, and
    the log-probabilities of the first."""
    from mlx_vlm import load
    from mlx_vlm.generate.ar import generate_step

    model, processor = load(path)
    # (mlx-vlm's Llama 4 image processor leaves out the global tile its prompt counts: mended as the engine does)
    mend(processor, model.config.model_type)
    from mlx_vlm.models.base import BaseImageProcessor

    if isinstance(getattr(processor, "image_processor", None), BaseImageProcessor):  # a tokenizer and its own
        from mlx_vlm.utils import prepare_inputs

        inputs = {k: np.array(v) for k, v in prepare_inputs(processor, images=images, prompts=prompt,
                                                            image_token_index=model.config.image_token_index).items()}
    else:
        inputs = processor(text=[prompt], images=images, return_tensors="np")
    # (arrays as MLX arrays; lists, MiniCPM-V's per-image pixels and bounds, as they are)
    extras = {k: _mx(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
    ids, mask = mx.array(inputs["input_ids"]), mx.array(inputs["attention_mask"])
    steps = generate_step(ids, model, _mx(inputs["pixel_values"]), mask, max_tokens=max_tokens,
                          temperature=0.0, **extras)
    tokens, first = [], None
    for (t, logprobs), _ in zip(steps, range(max_tokens)):
        tokens.append(int(t))
        first = np.array(logprobs.astype(mx.float32)).reshape(-1) if first is None else first
    return tokens, first


def mlx_vlm_prompt(path: str, text: str, num_images: int) -> str:
    """The prompt mlx-vlm's own `apply_chat_template` writes for one user message."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_config

    _, processor = load(path)
    return apply_chat_template(processor, load_config(path), text, num_images=num_images)


def _allowed(ids: list[int], image_id: int, both_ways: bool) -> np.ndarray:
    """Causal, and (`both_ways`) each image's run of placeholders attending to itself whole."""
    n = len(ids)
    allowed = np.tril(np.ones((n, n), dtype=bool))
    image = np.flatnonzero(np.asarray(ids) == image_id)
    if both_ways and len(image):
        for block in np.split(image, np.flatnonzero(np.diff(image) > 1) + 1):
            allowed[np.ix_(block, block)] = True
    return allowed


def prompt_logprobs(path: str, prompt: str, images: list, both_ways: bool, prefix: bool = False) -> np.ndarray:
    """mlx-vlm's classes (float32): each prompt token's logprob given the ones before it, under
    the causal mask, transformers' Gemma 3 mask (`both_ways`) or a prefix LM's (`prefix`: the
    whole prompt both ways)."""
    from mlx_vlm import load

    model, processor = load(path)
    inputs = processor(text=[prompt], images=images, return_tensors="np")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    x = mx.array(ids)[None]
    emb = model.get_input_embeddings(x, mx.array(inputs["pixel_values"]), mask=mx.ones(x.shape, dtype=mx.int32))
    allowed = np.ones((len(ids), len(ids)), dtype=bool) if prefix else _allowed(ids, model.config.image_token_index,
                                                                                  both_ways)
    mask = mx.array(allowed)[None, None]
    out = model.language_model(x, inputs_embeds=emb.inputs_embeds, mask=mask)
    logits = (out.logits if hasattr(out, "logits") else out)[0].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return logprobs[np.arange(len(ids) - 1), ids[1:]]


def both_ways_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and first logprobs from mlx-vlm's own classes (its vision tower, merge and
    language model, float32) with transformers' mask: causal, but an image's placeholder tokens
    attend to each other both ways. The whole sequence is recomputed for each token (no cache)."""
    from mlx_vlm import load

    model, processor = load(path)
    inputs = processor(text=[prompt], images=images, return_tensors="np")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    image_id = model.config.image_token_index
    pixels = mx.array(inputs["pixel_values"])

    def forward(x: mx.array, ids: list[int]):
        emb = model.get_input_embeddings(x, pixels, mask=mx.ones(x.shape, dtype=mx.int32)).inputs_embeds
        return model.language_model(x, inputs_embeds=emb, mask=mx.array(_allowed(ids, image_id, True))[None, None])

    return _greedy_whole(forward, ids, max_tokens)


def gemma3n_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Gemma 3n as transformers runs it: mlx-vlm's tower, vision embedding and merge (float32),
    each text row scaled by sqrt(hidden) as transformers' scaled word embedding does (mlx-vlm's
    merge leaves text rows unscaled), into mlx-lm's Gemma 3n language model on the same weights
    (mlx-vlm's turns the queries of its KV-sharing layers by a position read from a cache their
    source layer has already advanced: shifted by the prompt's length). Recomputed whole for
    each token, with a fresh cache (the KV-sharing layers read their source's keys from it)."""
    from mlx_lm.models import gemma3n as lm_gemma3n
    from mlx_vlm import load

    model, processor = load(path)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)["text_config"]
    lm = lm_gemma3n.Model(lm_gemma3n.ModelArgs.from_dict({"model_type": "gemma3n", "text_config": text}))
    lm.load_weights([(f"model.language_model.{k[len('model.'):]}", v)
                     for k, v in tree_flatten(model.language_model.parameters())])
    inputs = processor(text=[prompt], images=images, return_tensors="np")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    pixels = mx.array(inputs["pixel_values"])
    first_own_id, scale = model.config.vision_config.vocab_offset, text["hidden_size"] ** 0.5

    def forward(x: mx.array, ids: list[int]):
        emb = model.get_input_embeddings(x, pixels).inputs_embeds
        emb = mx.where((x < first_own_id)[..., None], emb * scale, emb)
        return lm(x, cache=lm.make_cache(), input_embeddings=emb)

    return _greedy_whole(forward, ids, max_tokens)


def _greedy_whole(forward, ids: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens, recomputing the whole sequence each time (`forward(x, ids)` -> logits),
    and the first token's logprobs."""
    tokens, first = [], None
    for _ in range(max_tokens):
        out = forward(mx.array(ids)[None], ids)
        logits = (out.logits if hasattr(out, "logits") else out)[0, -1].astype(mx.float32)
        logprobs = np.array(logits - mx.logsumexp(logits))
        first = logprobs if first is None else first
        tokens.append(int(np.argmax(logprobs)))
        ids.append(tokens[-1])
    return tokens, first



def _pack_anyres(feats: np.ndarray, newline: np.ndarray, size: tuple[int, int], pinpoints: list,
                 tile: int, side: int) -> np.ndarray:
    """transformers' LLaVA-NeXT `pack_image_features` for one image, in NumPy: feats [tiles, side*side, D]."""
    from transformers.image_processing_utils import select_best_resolution

    base, rest = feats[0], feats[1:]
    best_h, best_w = select_best_resolution(list(size), pinpoints)
    gh, gw = best_h // tile, best_w // tile
    x = rest[: gh * gw].reshape(gh, gw, side, side, -1)
    x = np.transpose(x, (4, 0, 2, 1, 3)).reshape(x.shape[-1], gh * side, gw * side)  # permute(4,0,2,1,3), flatten
    (oh, ow), (ch, cw) = size, x.shape[1:]
    if ow / oh > cw / ch:
        pad = (ch - int(round(oh * (cw / ow), 7))) // 2
        x = x[:, pad: ch - pad, :]
    else:
        pad = (cw - int(round(ow * (ch / oh), 7))) // 2
        x = x[:, :, pad: cw - pad]
    x = np.concatenate([x, np.broadcast_to(newline[:, None, None], (x.shape[0], x.shape[1], 1))], axis=-1)
    return np.concatenate([base, x.reshape(x.shape[0], -1).T], axis=0)


def anyres_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and first logprobs from mlx-vlm's own LLaVA-NeXT classes (tower, projector,
    newline, language model; float32) with the image packed as transformers packs it. The whole
    sequence is recomputed for each token (no cache)."""
    from mlx_vlm import load

    model, processor = load(path)
    cfg = model.config
    inputs = processor(text=[prompt], images=images, return_tensors="np")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    pixel_values = mx.array(np.asarray(inputs["pixel_values"]))[0]
    size = tuple(int(v) for v in np.asarray(inputs["image_sizes"]).reshape(-1)[:2])
    *_, hidden = model.vision_tower(pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    layers = raw["vision_feature_layer"] if isinstance(raw["vision_feature_layer"], list) else [raw["vision_feature_layer"]]
    skip = 1 if raw["vision_feature_select_strategy"] == "default" else 0
    feats = model.multi_modal_projector(mx.concatenate([hidden[i][:, skip:] for i in layers], axis=-1))
    pinpoints = raw["image_grid_pinpoints"]
    rows = _pack_anyres(np.array(feats, dtype=np.float64), np.array(model.image_newline, dtype=np.float64), size,
                        pinpoints, cfg.vision_config.image_size,
                        cfg.vision_config.image_size // cfg.vision_config.patch_size)
    at = np.flatnonzero(np.asarray(ids) == cfg.image_token_index)
    assert len(at) == len(rows), (len(at), len(rows))  # transformers' processor counted the same rows

    def forward(x: mx.array, ids: list[int]):
        emb = np.array(model.language_model.model.embed_tokens(x)[0], dtype=np.float32)
        emb[at] = rows
        return model.language_model(x, inputs_embeds=mx.array(emb)[None])

    return _greedy_whole(forward, ids, max_tokens)
