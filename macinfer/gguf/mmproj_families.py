"""The projector types of llama.cpp's vision projector files (`mmproj-*.gguf`) that macinfer
reads, each mapped back onto an mlx-vlm family (`gguf/mmproj.py` reads the file and holds the
table of them; the towers of native resolution are in `mmproj_native.py`): the
checkpoint config from the file's `clip.vision.*` hyperparameters and the language model's GGUF
config, the family's own processor classes, and what the converter did to a tensor beyond
naming it (`fix`) or which names it wrote by hand (`rename`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from macinfer.gguf.file import GGUFFile


class MmprojError(ValueError):
    """Why a GGUF's vision projector cannot be used (a load-time reason)."""


def meta_value(f: GGUFFile, key: str, default: Any = None) -> Any:
    """The file's `key`, or a MmprojError naming it when absent."""
    value = f.metadata.get(key, default)
    if value is None:
        raise MmprojError(f"{os.path.basename(f.path)}: its metadata has no {key}")
    return value


@dataclass(frozen=True)
class Projector:
    """How one llama.cpp projector type maps back onto an mlx-vlm family."""
    config: Callable[[GGUFFile, dict[str, Any], Any], dict[str, Any]]  # (mmproj, text config, tokenizer) -> config
    processor: Callable[[GGUFFile, dict[str, Any], Any], Any]  # (mmproj, config, HF tokenizer) -> processor
    # (the file's name, its tensor, the file's metadata) -> the tensor as the checkpoint holds it
    fix: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray] = lambda name, x, meta: x
    # mlx-vlm's parameter -> the file's name, where the converter names it by hand (None: by the map)
    rename: Callable[[str, dict[str, Any]], str | None] = lambda key, config: None
    # mlx-vlm's parameter -> the checkpoint's, where mlx-vlm's sanitize moved it (the map names the latter)
    checkpoint: Callable[[str], str] = lambda key: key


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def _token_id(tokenizer: Any, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise MmprojError(f"the model's vocabulary has no {token} token, which its projector's prompts need")
    return int(tid)


def _gemma3_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    size, patch = int(meta_value(f, "clip.vision.image_size")), int(meta_value(f, "clip.vision.patch_size"))
    scale = int(f.metadata.get("clip.vision.projector.scale_factor", 4))  # (the converter writes it when not 4)
    tokens = (size // patch // scale) ** 2
    vision = {"model_type": "siglip_vision_model", "image_size": size, "patch_size": patch,
              "hidden_size": int(meta_value(f, "clip.vision.embedding_length")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(meta_value(f, "clip.vision.block_count")),
              "num_attention_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "layer_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6))}
    ids = {k.replace("_token", "_token_index"): _token_id(tokenizer, t) for k, t in GEMMA3_TOKENS.items()}
    # (transformers' Gemma3TextConfig, which the processor's loading builds, takes the scalar as an int)
    text = {**text, "query_pre_attn_scalar": int(text["query_pre_attn_scalar"]), "mm_tokens_per_image": tokens}
    return {"model_type": "gemma3", "text_config": text, "vision_config": vision,
            "mm_tokens_per_image": tokens, **ids, "hidden_size": text["hidden_size"],
            "vocab_size": text["vocab_size"], "eos_token_id": text.get("eos_token_id")}


def _gemma3_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor
    from transformers import Gemma3ImageProcessor

    size = config["vision_config"]["image_size"]
    images = Gemma3ImageProcessor(size={"height": size, "width": size},
                                  image_mean=[float(x) for x in meta_value(f, "clip.vision.image_mean")],
                                  image_std=[float(x) for x in meta_value(f, "clip.vision.image_std")])
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=config["mm_tokens_per_image"],
                           chat_template=tokenizer.chat_template)


def _gemma3_fix(name: str, x: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    # llama.cpp's converter stores the projector's RMSNorm as 1 + w (Gemma's rule); the tower's are plain.
    return x - 1 if name.endswith("soft_emb_norm.weight") else x


def _idefics3_type(f: GGUFFile) -> str:
    """SmolVLM and Idefics3 share llama.cpp's projector type; the file's name tells them apart."""
    name = f"{f.metadata.get('general.name', '')} {f.metadata.get('general.basename', '')}".lower()
    return "smolvlm" if "smolvlm" in name else "idefics3"


def _idefics3_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    kind = _idefics3_type(f)
    vision = {"model_type": f"{kind}_vision", "image_size": int(meta_value(f, "clip.vision.image_size")),
              "patch_size": int(meta_value(f, "clip.vision.patch_size")),
              "hidden_size": int(meta_value(f, "clip.vision.embedding_length")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(meta_value(f, "clip.vision.block_count")),
              "num_attention_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "layer_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-5))}
    return {"model_type": kind, "text_config": text, "vision_config": vision,
            "scale_factor": int(f.metadata.get("clip.vision.projector.scale_factor", 2)),
            "image_token_id": _token_id(tokenizer, "<image>"), "vocab_size": text["vocab_size"],
            "eos_token_id": text.get("eos_token_id")}


def _idefics3_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.idefics3.processing_idefics3 import Idefics3Processor
    from mlx_vlm.models.smolvlm.processing_smolvlm import SmolVLMProcessor
    from transformers import Idefics3ImageProcessor, SmolVLMImageProcessor

    vision = config["vision_config"]
    size = vision["image_size"]
    longest = int(f.metadata.get("clip.vision.preproc_image_size", size))
    image_class, processor_class = ((SmolVLMImageProcessor, SmolVLMProcessor) if config["model_type"] == "smolvlm"
                                    else (Idefics3ImageProcessor, Idefics3Processor))
    # Split into tiles when the preprocessor's edge is past the tower's, as llama.cpp does.
    images = image_class(do_image_splitting=longest > size, size={"longest_edge": longest},
                         max_image_size={"longest_edge": size},
                         image_mean=[float(x) for x in meta_value(f, "clip.vision.image_mean")],
                         image_std=[float(x) for x in meta_value(f, "clip.vision.image_std")])
    tokens = (size // vision["patch_size"]) ** 2 // config["scale_factor"] ** 2
    return processor_class(image_processor=images, tokenizer=tokenizer, image_seq_len=tokens,
                           chat_template=tokenizer.chat_template)


def _pixtral_kind(f: GGUFFile) -> str:
    """Mistral 3's (Mistral Small 3.1+) merges 2x2 patches; Pixtral 12B's none."""
    return "mistral3" if "mm.patch_merger.weight" in f.tensors else "pixtral"


def _pixtral_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    kind, heads = _pixtral_kind(f), int(meta_value(f, "clip.vision.attention.head_count"))
    width = int(meta_value(f, "clip.vision.embedding_length"))
    vision = {"model_type": "pixtral", "hidden_size": width, "head_dim": width // heads, "num_attention_heads": heads,
              "num_hidden_layers": int(meta_value(f, "clip.vision.block_count")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "image_size": int(meta_value(f, "clip.vision.image_size")),
              "patch_size": int(meta_value(f, "clip.vision.patch_size"))}
    merge = int(f.metadata.get("clip.vision.spatial_merge_size", 2 if kind == "mistral3" else 1))
    return {"model_type": kind, "text_config": text, "vision_config": vision,
            "image_token_index": _token_id(tokenizer, "[IMG]"), "spatial_merge_size": merge,
            "vision_feature_layer": -1, "vocab_size": text["vocab_size"], "eos_token_id": text.get("eos_token_id")}


def _pixtral_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.mistral3.processing_mistral3 import Mistral3Processor
    from mlx_vlm.models.pixtral.image_processing_pixtral import PixtralImageProcessor
    from mlx_vlm.models.pixtral.processing_pixtral import PixtralProcessor

    vision = config["vision_config"]
    patch = vision["patch_size"]
    images = PixtralImageProcessor(size={"longest_edge": vision["image_size"]},
                                   patch_size={"height": patch, "width": patch},
                                   image_mean=[float(x) for x in meta_value(f, "clip.vision.image_mean")],
                                   image_std=[float(x) for x in meta_value(f, "clip.vision.image_std")])
    processor_class = Mistral3Processor if config["model_type"] == "mistral3" else PixtralProcessor
    return processor_class(image_processor=images, tokenizer=tokenizer, patch_size=patch,
                           spatial_merge_size=config["spatial_merge_size"], chat_template=tokenizer.chat_template)


def _pixtral_fix(name: str, x: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    # llama.cpp's converter permutes the tower's Q and K rows as it does Llama's (its 2D RoPE
    # rotates interleaved pairs): back to the checkpoint's halves.
    if name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
        from macinfer.gguf.arch import unpermute_rows

        return unpermute_rows(x, int(meta["clip.vision.attention.head_count"]))
    return x


class _TokenizerAndConfig:
    """What a processor whose own saving its loading does not read (InternVL's, Llama 4's) loads
    from: the tokenizer's files and a config file (`name`) with its sizes."""

    def __init__(self, tokenizer: Any, processor_config: dict[str, Any], name: str = "processor_config.json"):
        self.tokenizer, self.processor_config, self.name = tokenizer, processor_config, name

    def save_pretrained(self, folder: str) -> None:
        import json

        self.tokenizer.save_pretrained(folder)
        with open(os.path.join(folder, self.name), "w") as out:
            json.dump(self.processor_config, out)


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _internvl_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    mean = [float(x) for x in meta_value(f, "clip.vision.image_mean")]
    std = [float(x) for x in meta_value(f, "clip.vision.image_std")]
    if not (np.allclose(mean, IMAGENET_MEAN, atol=1e-3) and np.allclose(std, IMAGENET_STD, atol=1e-3)):
        raise MmprojError(f"{os.path.basename(f.path)}: its image mean/std ({mean}, {std}) are not ImageNet's, "
                          "which InternVL's processor normalizes by")
    size = int(meta_value(f, "clip.vision.image_size"))
    vision = {"model_type": "intern_vit_6b", "hidden_size": int(meta_value(f, "clip.vision.embedding_length")),
              "num_attention_heads": int(meta_value(f, "clip.vision.attention.head_count")),
              "patch_size": int(meta_value(f, "clip.vision.patch_size")),
              "num_hidden_layers": int(meta_value(f, "clip.vision.block_count")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")), "image_size": size,
              "layer_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
              # InternViT-6B's RMSNorm and query/key norms; the 300M tower's LayerNorm without
              "norm_type": "layer_norm" if "v.blk.0.ln1.bias" in f.tensors else "rms_norm",
              "qk_normalization": "v.blk.0.attn_q_norm.weight" in f.tensors,
              "qkv_bias": "v.blk.0.attn_q.bias" in f.tensors}
    return {"model_type": "internvl_chat", "text_config": text, "vision_config": vision,
            "image_token_index": _token_id(tokenizer, "<IMG_CONTEXT>"),
            "downsample_ratio": 1 / int(f.metadata.get("clip.vision.projector.scale_factor", 2)),
            "force_image_size": size, "max_dynamic_patch": int(f.metadata.get("clip.vision.preproc_max_tiles", 12)),
            "min_dynamic_patch": int(f.metadata.get("clip.vision.preproc_min_tiles", 1)), "use_thumbnail": True,
            "vocab_size": text["vocab_size"], "eos_token_id": text.get("eos_token_id")}


def _internvl_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    return _TokenizerAndConfig(tokenizer, {"processor_class": "InternVLChatProcessor",
                                           "image_size": config["force_image_size"],
                                           "patch_size": config["vision_config"]["patch_size"],
                                           "downsample_ratio": config["downsample_ratio"]})


LLAMA4_MAX_TILES = 16  # (the published preprocessor's `max_patches`, which a projector file does not carry)


def _llama4_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Llama 4's: a ViT over tiles of the file's image size (a class token, a learned position
    table, 2D RoPE), pixel shuffle by the file's scale factor, an MLP adapter, one linear
    projection (which the converter names `mm.model.fc`); tiles chosen as the published
    processor does, at most 16 and a global view."""
    def rows(name: str, axis: int = 0) -> int:
        return int(f.tensors[name].shape[axis])

    vision = {"model_type": "llama4_vision_model", "hidden_size": int(meta_value(f, "clip.vision.embedding_length")),
              "image_size": int(meta_value(f, "clip.vision.image_size")),
              "intermediate_size": int(meta_value(f, "clip.vision.feed_forward_length")),
              "norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-5)),
              "num_attention_heads": int(meta_value(f, "clip.vision.attention.head_count")), "num_channels": 3,
              "num_hidden_layers": int(meta_value(f, "clip.vision.block_count")),
              "patch_size": int(meta_value(f, "clip.vision.patch_size")),
              "pixel_shuffle_ratio": 1 / int(f.metadata.get("clip.vision.projector.scale_factor", 2)),
              "projector_input_dim": rows("mm.model.mlp.1.weight"),
              "projector_output_dim": rows("mm.model.mlp.2.weight"),
              "vision_output_dim": rows("mm.model.fc.weight", 1), "rope_theta": 10000, "initializer_range": 0.02,
              "projector_dropout": 0.0,
              "vision_feature_layer": -1, "vision_feature_select_strategy": "default"}
    text = {**text.get("text_config", text), "model_type": "llama4_text"}
    return {"model_type": "llama4", "text_config": text, "vision_config": vision,
            "image_token_index": _token_id(tokenizer, "<|patch|>"), "vocab_size": text["vocab_size"],
            "eos_token_id": text.get("eos_token_id")}


def _llama4_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    # mlx-vlm's Llama 4 processor reads its sizes from preprocessor_config.json alone.
    size = config["vision_config"]["image_size"]
    return _TokenizerAndConfig(tokenizer, {"size": {"height": size, "width": size}, "max_patches": LLAMA4_MAX_TILES,
                                           "image_mean": [float(x) for x in meta_value(f, "clip.vision.image_mean")],
                                           "image_std": [float(x) for x in meta_value(f, "clip.vision.image_std")]},
                               "preprocessor_config.json")


def _llama4_rename(key: str, config: dict[str, Any]) -> str | None:
    # The converter names the projection by hand (the map would say mm.1)
    return "mm.model.fc.weight" if key == "multi_modal_projector.linear_1.weight" else None


FIXED_SIZE: dict[str, Projector] = {  # (towers of a fixed input size, tiled or not)
    "gemma3": Projector(_gemma3_config, _gemma3_processor, _gemma3_fix),
    "pixtral": Projector(_pixtral_config, _pixtral_processor, _pixtral_fix),  # (and Mistral 3)
    "internvl": Projector(_internvl_config, _internvl_processor),
    "idefics3": Projector(_idefics3_config, _idefics3_processor),  # (and SmolVLM)
    "llama4": Projector(_llama4_config, _llama4_processor, rename=_llama4_rename),
}


def projector_kind(f: GGUFFile) -> str | None:
    """The file's projector type as llama.cpp names it."""
    return f.metadata.get("clip.vision.projector_type") or f.metadata.get("clip.projector_type")
