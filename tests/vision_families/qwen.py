"""Tiny checkpoints of the Qwen-VL line and the families that share its processor or its
multimodal RoPE: Qwen2/2.5-VL, Qwen3-VL (and MoE), Qwen3.5 (and MoE, Prism packs, IndicOCR),
Mage-VL, dots.ocr, GLM-4.1V/4.5V, GLM-OCR, PaddleOCR-VL, LFM2-VL, MiniCPM-V."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.vision_families.common import TEXT, _tokenizer


def _qwen2_vl(path: str, model_type: str = "qwen2_vl") -> tuple[dict, Any]:
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
    return cfg, qwen_vl_processor(Qwen2VLProcessor)


def qwen_vl_processor(processor_class: type, specials: tuple[str, ...] = ()) -> Any:
    """Qwen-VL's processing (its image processor at 56-112 px, ids 259-262 for its markers and
    placeholders, then `specials`) under the family's processor class."""
    from transformers import Qwen2VLImageProcessor

    tok = _tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", *specials],
                     "<|vision_start|><|image_pad|><|vision_end|>")
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                            temporal_patch_size=2, merge_size=2)
    processor = processor_class(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
    processor.video_processor = image_processor  # (saved once; no video processor without torchvision)
    return processor


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


# MiniCPM-V 4.7's MoE form: a Qwen3.5-MoE decoder.
MINICPMV_MOE = {"model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}


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


def _step3p7(path: str) -> tuple[dict, Any]:
    """Step 3.7: a Perception Encoder tower (2D RoPE, 728 px whole views and 504 px crops at
    the sizes its processor fixes: 169 and 81 rows after its strided projector) over Step
    3.5's decoder (mlx-lm's `step3p5`), each view between its own markers, plain positions."""
    from mlx_vlm.models.step3p7.processing_step3p7 import Step3VLProcessor

    from tests.zoo import tiny_config

    text = {**tiny_config("step3p5"), "model_type": "step3p5"}
    vision = {"model_type": "perception_encoder", "width": 32, "layers": 2, "heads": 2, "image_size": 728,
              "patch_size": 14, "mlp_ratio": 2.0}
    tok = _tokenizer(["<im_patch>", "<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"],
                     "<im_patch>")
    cfg = {"model_type": "step3p7", "text_config": text, "vision_config": vision, "image_token_id": 259,
           "eos_token_id": 2}
    return cfg, Step3VLProcessor(tokenizer=tok, chat_template=tok.chat_template)


def _minicpmo(path: str) -> tuple[dict, Any]:
    """MiniCPM-o 4.5's vision path: MiniCPM-V's SigLIP tower and resampler (a whole view and
    slices, each `<image>`/`<slice>` around its placeholders), a Qwen3 decoder with its config
    at the root; its audio tower and speech decoder are off here (their inputs are refused)."""
    from mlx_vlm.models.minicpmo.processing_minicpmo import MiniCPMOImageProcessor, MiniCPMOProcessor
    from transformers import WhisperFeatureExtractor

    text = {k: v for k, v in TEXT.items() if k != "model_type"}
    cfg = {"model_type": "minicpmo", **text, "head_dim": 16, "vision_config": {
        "model_type": "siglip", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "image_size": 112, "patch_size": 14},
        "query_num": 4, "image_size": 112, "patch_size": 14, "init_audio": False, "init_tts": False,
        "slice_config": {"max_slice_nums": 4, "patch_size": 14, "scale_resolution": 112}, "eos_token_id": 2}
    specials = ["<image>", "</image>", "<slice>", "</slice>", "<image_id>", "</image_id>", "<|audio_start|>",
                "<|audio_end|>", "<|spk_bos|>", "<|spk_eos|>", "<|tts_bos|>", "<|tts_eos|>", "<|listen|>"]
    tok = _tokenizer(specials, "<image>./</image>")
    kw = dict(patch_size=14, scale_resolution=112, image_feature_size=4, max_slice_nums=4)
    return cfg, MiniCPMOProcessor(image_processor=MiniCPMOImageProcessor(**kw), tokenizer=tok,
                                  audio_processor=WhisperFeatureExtractor(), chat_template=tok.chat_template)
