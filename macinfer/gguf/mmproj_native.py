"""Projector types whose towers read an image at its own resolution, a patch grid per image
(`gguf/mmproj.py` reads the file; the shared rules are in `mmproj_families.py`): Qwen2-VL's,
Qwen2.5-VL's and Qwen3-VL's mergers (also Qwen3.5's), LFM2-VL's SigLIP2 NaFlex tower and
Kimi-VL's MoonViT."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from macinfer.gguf.file import GGUFFile
from macinfer.gguf.mmproj_families import MmprojError, Projector, _token_id, meta_value, projector_kind

def _qwen_vl_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Qwen2-VL's (`qwen2vl_merger`) or Qwen2.5-VL's (`qwen2.5vl_merger`) checkpoint config."""
    kind = projector_kind(f)
    if "mrope_section" not in text:
        raise MmprojError(f"its language model's GGUF names no multimodal RoPE sections (a qwen2vl architecture's "
                          f"rope.dimension_sections): it is not the model of a {kind} projector")
    depth, width = int(meta_value(f, "clip.vision.block_count")), int(meta_value(f, "clip.vision.embedding_length"))
    vision = {"depth": depth, "num_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "patch_size": int(meta_value(f, "clip.vision.patch_size")), "temporal_patch_size": 2,
              # (llama.cpp's default where older converters wrote none)
              "spatial_merge_size": int(f.metadata.get("clip.vision.spatial_merge_size", 2)),
              "layer_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6))}
    if kind == "qwen2vl_merger":  # its MLP's width is its up projection's rows (the file's ffn length is not)
        up = f.tensors.get("v.blk.0.ffn_up.weight")
        if up is None or up.shape[0] % width:
            raise MmprojError(f"{os.path.basename(f.path)}: no v.blk.0.ffn_up.weight a whole multiple of the "
                              f"tower's width ({width}) to size its MLP by")
        model_type = "qwen2_vl"
        vision.update(embed_dim=width, hidden_size=int(meta_value(f, "clip.vision.projection_dim")),
                      mlp_ratio=up.shape[0] // width)  # (transformers' config takes an int)
    else:
        model_type = "qwen2_5_vl"
        every = int(f.metadata.get("clip.vision.n_wa_pattern", 0))  # windowed blocks but every n-th
        vision.update(hidden_size=width, intermediate_size=int(meta_value(f, "clip.vision.feed_forward_length")),
                      out_hidden_size=int(meta_value(f, "clip.vision.projection_dim")),
                      window_size=int(f.metadata.get("clip.vision.window_size", 112)),  # (llama.cpp's default)
                      fullatt_block_indexes=list(range(every - 1, depth, every)) if every else list(range(depth)))
    ids = {k: _token_id(tokenizer, t) for k, t in (("image_token_id", "<|image_pad|>"),
                                                    ("video_token_id", "<|video_pad|>"),
                                                    ("vision_start_token_id", "<|vision_start|>"))}
    flat = {k: v for k, v in text.items() if k != "mrope_section"}
    return {**flat, "model_type": model_type, "rope_scaling": {"type": "mrope", "mrope_section": text["mrope_section"]},
            "vision_config": {"model_type": model_type, **vision}, **ids}


def _qwen_vl_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor  # (Qwen2.5-VL's prompts are Qwen2-VL's)
    from transformers import Qwen2VLImageProcessor

    vision = config["vision_config"]
    images = Qwen2VLImageProcessor(
        # (the published preprocessor's range where the file names none)
        min_pixels=int(f.metadata.get("clip.vision.image_min_pixels", 56 * 56)),
        max_pixels=int(f.metadata.get("clip.vision.image_max_pixels", 28 * 28 * 16384)),
        patch_size=vision["patch_size"], temporal_patch_size=2, merge_size=vision["spatial_merge_size"],
        image_mean=[float(x) for x in meta_value(f, "clip.vision.image_mean")],
        image_std=[float(x) for x in meta_value(f, "clip.vision.image_std")])
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    processor.video_processor = images  # (videos are refused; saving wants one, and torchvision's is absent)
    return processor


# The language models Qwen3-VL's projector type serves: llama.cpp's qwen3vl / qwen3vlmoe (Qwen3-VL)
# and qwen35 / qwen35moe (Qwen3.5 / 3.6, hybrid), as mlx-vlm's model types.
QWEN3_FAMILIES = {"qwen3": "qwen3_vl", "qwen3_moe": "qwen3_vl_moe", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}


def _qwen3vl_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    family = QWEN3_FAMILIES.get(text.get("model_type"))
    if "mrope_section" not in text or family is None:
        raise MmprojError("its language model is not Qwen3-VL's or Qwen3.5's (llama.cpp's qwen3vl, qwen3vlmoe, "
                          "qwen35 or qwen35moe architecture, with rope.dimension_sections)")
    deep = [i for i, on in enumerate(f.metadata.get("clip.vision.is_deepstack_layers", [])) if on]
    size, patch = int(meta_value(f, "clip.vision.image_size")), int(meta_value(f, "clip.vision.patch_size"))
    vision = {"model_type": family, "depth": int(meta_value(f, "clip.vision.block_count")),
              "num_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "hidden_size": int(meta_value(f, "clip.vision.embedding_length")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "out_hidden_size": int(meta_value(f, "clip.vision.projection_dim")), "patch_size": patch,
              "spatial_merge_size": int(f.metadata.get("clip.vision.spatial_merge_size", 2)),
              "temporal_patch_size": 2, "num_position_embeddings": (size // patch) ** 2,
              "deepstack_visual_indexes": deep}
    ids = {k: _token_id(tokenizer, t) for k, t in (("image_token_id", "<|image_pad|>"),
                                                    ("video_token_id", "<|video_pad|>"),
                                                    ("vision_start_token_id", "<|vision_start|>"))}
    own = {k: v for k, v in text.items() if k != "mrope_section"}
    mrope = {"mrope_section": text["mrope_section"], "mrope_interleaved": True}
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        own["rope_scaling"] = {"type": "default", **mrope}
        if family == "qwen3_vl_moe":
            own["model_type"] = "qwen3_vl_moe_text"
    else:  # (Qwen3.5's text config: its own model type, RoPE under rope_parameters)
        own.update(model_type=f"{family}_text", rope_parameters={**own["rope_parameters"], **mrope})
    return {"model_type": family, "text_config": own, "vision_config": vision, **ids}


def _qwen3vl_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, Qwen3VLProcessor

    vision = config["vision_config"]
    images = Qwen3VLImageProcessor(
        patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
        # (the published preprocessor's range where the file names none)
        min_pixels=int(f.metadata.get("clip.vision.image_min_pixels", 56 * 56)),
        max_pixels=int(f.metadata.get("clip.vision.image_max_pixels", 16 * 16 * 4 * 16384)),
        image_mean=[float(x) for x in meta_value(f, "clip.vision.image_mean")],
        image_std=[float(x) for x in meta_value(f, "clip.vision.image_std")])
    return Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=images,
                            chat_template=tokenizer.chat_template)


def _qwen3vl_rename(key: str, config: dict[str, Any]) -> str | None:
    """The merger's and DeepStack mergers' names, which the converter writes by hand (the
    DeepStack ones by the tower layer each reads)."""
    parts = key.split(".")
    if key.startswith("vision_tower.merger."):
        module, kind = parts[2], parts[-1]
        return {"linear_fc1": f"mm.0.{kind}", "linear_fc2": f"mm.2.{kind}", "norm": f"v.post_ln.{kind}"}.get(module)
    if key.startswith("vision_tower.deepstack_merger_list."):
        layer = config["vision_config"]["deepstack_visual_indexes"][int(parts[2])]
        part = {"linear_fc1": "fc1", "linear_fc2": "fc2", "norm": "norm"}.get(parts[3])
        return f"v.deepstack.{layer}.{part}.{parts[-1]}" if part else None
    return None


def _lfm2_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """LFM2-VL's: a SigLIP2 NaFlex tower (its position table resized to each image's patch
    grid), a pixel unshuffle by the file's scale factor and a two-layer projector, layer-normed
    where the file holds the norm. The converter writes a fixed `image_size` (256) and drops
    the tower layers past the feature layer from its block count, so the tower kept is the
    file's blocks and its features the last one's."""
    patch = int(meta_value(f, "clip.vision.patch_size"))
    vision = {"model_type": "siglip2_vision_model", "patch_size": patch,
              "hidden_size": int(meta_value(f, "clip.vision.embedding_length")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(meta_value(f, "clip.vision.block_count")),
              "num_attention_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "num_patches": int(f.dequantize("v.position_embd.weight").shape[0]),
              "layer_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6))}
    return {"model_type": "lfm2_vl", "text_config": text, "vision_config": vision,
            "image_token_id": _token_id(tokenizer, "<image>"),
            "downsample_factor": int(f.metadata.get("clip.vision.projector.scale_factor", 2)),
            "encoder_patch_size": patch, "vision_feature_layer": -1,
            "projector_hidden_size": int(f.dequantize("mm.1.weight").shape[0]),
            "projector_bias": "mm.1.bias" in f.tensors, "projector_use_layernorm": "mm.input_norm.weight" in f.tensors,
            **LFM2_PREPROCESSOR, "vocab_size": text["vocab_size"], "eos_token_id": text.get("eos_token_id")}


# LFM2-VL's published preprocessor (its checkpoints' `preprocessor_config.json`, which a projector
# file does not carry; llama.cpp's runtime tiles by the same rule).
LFM2_PREPROCESSOR = {"min_image_tokens": 64, "max_image_tokens": 256, "tile_size": 512, "do_image_splitting": True,
                     "min_tiles": 2, "max_tiles": 10, "use_thumbnail": True, "max_pixels_tolerance": 2.0}


def _lfm2_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.lfm2_vl.processing_lfm2_vl import Lfm2VlNumpyImageProcessor
    from transformers import Lfm2VlProcessor

    images = Lfm2VlNumpyImageProcessor(
        downsample_factor=config["downsample_factor"], encoder_patch_size=config["encoder_patch_size"],
        image_mean=[float(x) for x in meta_value(f, "clip.vision.image_mean")],
        image_std=[float(x) for x in meta_value(f, "clip.vision.image_std")], **LFM2_PREPROCESSOR)
    return Lfm2VlProcessor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _lfm2_fix(name: str, x: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    # The converter stores the linear patch embedding as a convolution, [out, 3, p, p]; the
    # checkpoint's rows are each patch's pixels in (row, column, channel) order.
    return x.transpose(0, 2, 3, 1).reshape(x.shape[0], -1) if name == "v.patch_embd.weight" else x


def _kimivl_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Kimi-VL's: a MoonViT tower (native resolution, 2D RoPE, its position table interpolated
    to each image's grid), patches merged by the file's scale factor, a normed MLP projector.
    The converter writes a fixed `image_size` (64 x 14) and the position table flattened."""
    side = round(f.dequantize("v.position_embd.weight").shape[0] ** 0.5)
    hidden, merge = int(meta_value(f, "clip.vision.embedding_length")), int(
        f.metadata.get("clip.vision.projector.scale_factor", 2))
    vision = {"model_type": "moonvit", "depth": int(meta_value(f, "clip.vision.block_count")), "embed_dim": hidden,
              "hidden_size": hidden, "num_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "patch_size": int(meta_value(f, "clip.vision.patch_size")), "init_pos_emb_height": side,
              "init_pos_emb_width": side, "merge_kernel_size": [merge, merge]}
    return {"model_type": "kimi_vl", "text_config": text, "vision_config": vision,
            "media_placeholder_token_id": _token_id(tokenizer, "<|media_pad|>"), "vocab_size": text["vocab_size"],
            "eos_token_id": text.get("eos_token_id")}


def _kimivl_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.kimi_vl.processing_kimi_vl import KimiVLImageProcessor, KimiVLProcessor

    vision = config["vision_config"]
    # (its published preprocessor's token limit, 4096 patches, the class default: the file has none)
    images = KimiVLImageProcessor(patch_size=vision["patch_size"], merge_kernel_size=vision["merge_kernel_size"],
                                  image_mean=tuple(float(x) for x in meta_value(f, "clip.vision.image_mean")),
                                  image_std=tuple(float(x) for x in meta_value(f, "clip.vision.image_std")))
    return KimiVLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _kimivl_fix(name: str, x: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    if name == "v.position_embd.weight":  # flattened [h * w, dim] by the converter: the table is square
        side = round(x.shape[0] ** 0.5)
        return x.reshape(side, side, x.shape[-1])
    return x


def _kimivl_checkpoint(key: str) -> str:
    """MoonViT's blocks and final norm sit under `encoder.` in the checkpoint, its attention's
    projections on the block itself (mlx-vlm moves them under `attn.`)."""
    if key.startswith(("vision_tower.blocks.", "vision_tower.final_layernorm")):
        return key.replace("vision_tower.", "vision_tower.encoder.", 1).replace(".attn.", ".")
    return key


def _glm4v_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """GLM-4.1V's / GLM-4.6V-Flash's (over the `glm4` text GGUF with M-RoPE sections) or
    GLM-4.5V's (over `glm4moe`): Qwen-style patches through a tower with its own position
    table, a strided convolution merging 2 x 2 patches (the converter writes no merge size:
    2, its checkpoints'), a gated MLP merger."""
    if "mrope_section" not in text:
        raise MmprojError("its language model's GGUF names no multimodal RoPE sections (rope.dimension_sections): "
                          "it is not GLM-4V's")
    moe = text.get("model_type") == "glm4_moe"
    model_type = "glm4v_moe" if moe else "glm4v"
    vision = {"model_type": model_type, "depth": int(meta_value(f, "clip.vision.block_count")),
              "hidden_size": int(meta_value(f, "clip.vision.embedding_length")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "num_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "patch_size": int(meta_value(f, "clip.vision.patch_size")),
              "image_size": int(meta_value(f, "clip.vision.image_size")),
              "out_hidden_size": int(meta_value(f, "clip.vision.projection_dim")), "spatial_merge_size": 2,
              "temporal_patch_size": 2,
              "rms_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-5))}
    flat = {k: v for k, v in text.items() if k != "mrope_section"}
    eos = text.get("eos_token_id", tokenizer.eos_token_id)  # (mlx-vlm's config reads it from the text's)
    text_config = {**flat, "model_type": f"{model_type}_text", "eos_token_id": eos,
                   "rope_scaling": {"rope_type": "default", "mrope_section": text["mrope_section"]}}
    ids = {k: _token_id(tokenizer, t) for k, t in (("image_token_id", "<|image|>"), ("video_token_id", "<|video|>"),
                                                    ("vision_start_token_id", "<|begin_of_image|>"),
                                                    ("vision_end_token_id", "<|end_of_image|>"))}
    return {"model_type": model_type, "text_config": text_config, "vision_config": vision, **ids,
            "image_token_index": ids["image_token_id"], "video_token_index": ids["video_token_id"],
            "hidden_size": text["hidden_size"], "vocab_size": text["vocab_size"], "eos_token_id": eos}


def _glm4v_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.glm4v.processing import Glm46VProcessor
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    vision = config["vision_config"]
    # (the published preprocessor's pixel range, the class default: the file names none)
    images = Glm4vImageProcessorPil(patch_size=vision["patch_size"], temporal_patch_size=2, merge_size=2,
                                    image_mean=[float(x) for x in meta_value(f, "clip.vision.image_mean")],
                                    image_std=[float(x) for x in meta_value(f, "clip.vision.image_std")])
    return Glm46VProcessor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _dots_ocr_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """dots.ocr's (over the `qwen2` text GGUF, plain positions): a NaViT tower (2D RoPE,
    RMSNorm, SwiGLU), patches merged by the file's scale factor through a normed MLP."""
    vision = {"model_type": "dots_vit", "embed_dim": int(meta_value(f, "clip.vision.embedding_length")),
              "hidden_size": int(meta_value(f, "clip.vision.projection_dim")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(meta_value(f, "clip.vision.block_count")),
              "num_attention_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "patch_size": int(meta_value(f, "clip.vision.patch_size")), "temporal_patch_size": 1,
              "spatial_merge_size": int(f.metadata.get("clip.vision.projector.scale_factor", 2)),
              "rms_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-5)),
              "post_norm": "mm.post_norm.weight" in f.tensors, "use_bias": "v.blk.0.attn_qkv.bias" in f.tensors}
    return {**text, "model_type": "dots_ocr", "vision_config": vision,
            "image_token_id": _token_id(tokenizer, "<|imgpad|>"), "video_token_id": _token_id(tokenizer, "<|video_pad|>")}


def _dots_ocr_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.dots_ocr.processing_dots_ocr import DotsVLProcessor
    from transformers import Qwen2VLImageProcessor

    vision = config["vision_config"]
    images = Qwen2VLImageProcessor(min_pixels=int(meta_value(f, "clip.vision.image_min_pixels")),
                                   max_pixels=int(meta_value(f, "clip.vision.image_max_pixels")),
                                   patch_size=vision["patch_size"], temporal_patch_size=1,
                                   merge_size=vision["spatial_merge_size"],
                                   image_mean=[float(x) for x in meta_value(f, "clip.vision.image_mean")],
                                   image_std=[float(x) for x in meta_value(f, "clip.vision.image_std")])
    return DotsVLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _dots_ocr_checkpoint(key: str) -> str:
    """The converter names the tower's SwiGLU as Qwen2.5-VL's (fc1 gate, fc2 down, fc3 up)."""
    if key.startswith("vision_tower.blocks.") and ".mlp.fc" in key:
        for old, new in ((".fc1.", ".gate_proj."), (".fc2.", ".down_proj."), (".fc3.", ".up_proj.")):
            key = key.replace(old, new)
        return key.replace("vision_tower.blocks.", "visual.blocks.", 1)
    return key


GEMMA4_TOKENS = {"image_token_id": "<|image|>", "boi_token_id": "<|image>", "eoi_token_id": "<image|>"}
GEMMA4_AUDIO_TOKENS = {"audio_token_id": "<|audio|>", "boa_token_id": "<|audio>", "eoa_token_id": "<audio|>"}
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
# The published processor's and tower's tokens a picture at most (llama.cpp's limit too; it also
# enlarges a small picture to 40 tokens at least, where the published processor keeps its size).
GEMMA4_SOFT_TOKENS = 280


def _gemma4v_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Gemma 4's: a native-resolution tower (each patch placed by a learned table of columns and
    rows, 2D RoPE in its attention), average-pooled by the file's scale factor (3 when unset,
    as llama.cpp reads it), standardized where the file holds the statistics, an RMS-normed
    linear projection; its image tokens attend each other both ways (the published config)."""
    table = f.tensors["v.position_embd.weight"].shape  # [2, positions, width]
    heads = int(meta_value(f, "clip.vision.attention.head_count"))
    width = int(meta_value(f, "clip.vision.embedding_length"))
    vision = {"model_type": "gemma4_vision", "hidden_size": width,
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(meta_value(f, "clip.vision.block_count")),
              "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": width // heads,
              "global_head_dim": width // heads, "patch_size": int(meta_value(f, "clip.vision.patch_size")),
              "pooling_kernel_size": int(f.metadata.get("clip.vision.projector.scale_factor", 3)),
              "position_embedding_size": int(table[1]), "default_output_length": GEMMA4_SOFT_TOKENS,
              "rms_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
              "standardize": "v.std_bias" in f.tensors,
              "use_clipped_linears": any(n.endswith(_CLIP_BOUNDS) for n in f.tensors)}
    ids = {k: _token_id(tokenizer, t) for k, t in GEMMA4_TOKENS.items()}
    vocab = tokenizer.get_vocab()
    ids.update({k: vocab[t] for k, t in GEMMA4_AUDIO_TOKENS.items() if t in vocab})
    return {"model_type": "gemma4", "text_config": {**text, "use_bidirectional_attention": "vision"},
            "vision_config": vision, **ids, "vision_soft_tokens_per_image": GEMMA4_SOFT_TOKENS,
            "hidden_size": text["hidden_size"], "vocab_size": text["vocab_size"],
            "eos_token_id": text.get("eos_token_id")}


def _gemma4v_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    # The published processor: pixels rescaled to [0, 1], not normalized (the tower maps them to
    # [-1, 1] itself), resized to at most 280 pooled tokens.
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor, Gemma4Processor

    vision = config["vision_config"]
    images = Gemma4ImageProcessor(patch_size=vision["patch_size"], max_soft_tokens=GEMMA4_SOFT_TOKENS,
                                  pooling_kernel_size=vision["pooling_kernel_size"])
    return Gemma4Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=GEMMA4_SOFT_TOKENS,
                           chat_template=tokenizer.chat_template)


def _gemma4v_checkpoint(key: str) -> str:
    """The converter's names before its map: the tower's layers under `vision_model.model.`, the
    clippable linears' `.linear` dropped (the `.weight` it gives the position table is found by
    the lookup, as InternViT's bare parameters are)."""
    if key.startswith("vision_tower.encoder."):
        key = "vision_model.model." + key[len("vision_tower.encoder."):]
    return key.replace(".linear.weight", ".weight")


def _gemma4v_rename(key: str, config: dict[str, Any]) -> str | None:
    # A clippable linear's bounds: the linear's llama.cpp name and the bound's own suffix.
    if not key.endswith(_CLIP_BOUNDS):
        return None
    import gguf

    base, bound = _gemma4v_checkpoint(key).rsplit(".", 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(config["vision_config"]["num_hidden_layers"], 8))
    name = names.get_name(base.removesuffix(".linear"))
    return f"{name}.{bound}" if name else None


def _gemma4v_fix(name: str, x: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    # The patch embedding as a convolution [out, 3, p, p] (LFM2-VL's rule); scalar bounds stored as [1].
    if name.endswith(_CLIP_BOUNDS):
        return x.reshape(())
    return _lfm2_fix(name, x, meta)


NATIVE_SIZE: dict[str, Projector] = {
    "qwen2vl_merger": Projector(_qwen_vl_config, _qwen_vl_processor),
    "qwen2.5vl_merger": Projector(_qwen_vl_config, _qwen_vl_processor),
    "qwen3vl_merger": Projector(_qwen3vl_config, _qwen3vl_processor, rename=_qwen3vl_rename),
    "lfm2": Projector(_lfm2_config, _lfm2_processor, _lfm2_fix),  # (LFM2-VL, LFM2.5-VL)
    "kimivl": Projector(_kimivl_config, _kimivl_processor, _kimivl_fix, checkpoint=_kimivl_checkpoint),
    "glm4v": Projector(_glm4v_config, _glm4v_processor),  # (GLM-4.1V, GLM-4.5V, GLM-4.6V)
    "dots_ocr": Projector(_dots_ocr_config, _dots_ocr_processor, checkpoint=_dots_ocr_checkpoint),
    "gemma4v": Projector(_gemma4v_config, _gemma4v_processor, _gemma4v_fix, _gemma4v_rename, _gemma4v_checkpoint),
}
