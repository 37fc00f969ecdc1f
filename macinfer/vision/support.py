"""Which vision checkpoints take images on the engine, decided once at load: the family
table (`FAMILIES`: verified against mlx-vlm's own generation on tiny random models) and,
for a checkpoint that runs, its processor and encoder (`Vision`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from macinfer.vision.encoder import VisionEncoder
from macinfer.vision.images import ImageLimits
from macinfer.vision.processor import VisionProcessor

log = logging.getLogger(__name__)

MROPE = "its language model's multimodal RoPE (GLM-4V's sectioned form) is not run yet"
DEEPSTACK = "its vision tower feeds features into the first decoder layers (DeepStack), not run yet"
# model_type -> None (runs: same greedy tokens as mlx-vlm, tests/test_vision.py) or why it is refused.
FAMILIES: dict[str, str | None] = {
    "llava": None, "mistral3": None, "qwen2_vl": None, "qwen2_5_vl": None,
    "qwen3_5": None, "qwen3_5_moe": None,
    "qwen3_vl": DEEPSTACK, "qwen3_vl_moe": DEEPSTACK, "glm4v": MROPE, "glm4v_moe": MROPE,
}
# Families whose language model turns image positions by multimodal RoPE: the style.
MROPE_STYLE = {"qwen2_vl": "chunked", "qwen2_5_vl": "chunked", "qwen3_5": "interleaved", "qwen3_5_moe": "interleaved"}
UNVERIFIED = "its image path has not been verified on the engine yet (docs/vision.md lists the families that run)"


def is_vision_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict)


def verdict(config: dict[str, Any]) -> str | None:
    """None when images run for this config, else why not (a text-only model: None is never
    asked: `is_vision_config` first)."""
    return FAMILIES.get(config.get("model_type"), UNVERIFIED)


def image_token_id(config: dict[str, Any]) -> int | None:
    for key in ("image_token_index", "image_token_id", "image_token"):
        v = config.get(key)
        if isinstance(v, int):
            return v
    return None


@dataclass
class Vision:
    """A loaded model's image path: its processor, encoder and limits."""
    processor: VisionProcessor
    encoder: VisionEncoder
    limits: ImageLimits
    mrope: tuple[list[int], str] | None = None  # (mrope_section, style) of a multimodal RoPE family


def load_vision(path: str, config: dict[str, Any], tokenizer: Any, embed: Any, dtype: mx.Dtype,
                limits: ImageLimits | None = None, cache_bytes: int = 256 * 2**20) -> tuple[Vision | None, str | None]:
    """(the image path, None) for a checkpoint whose family runs, else (None, why not)."""
    if not is_vision_config(config):
        return None, None
    why = verdict(config)
    token = image_token_id(config)
    if why is None and token is None:
        why = "its config names no image token id"
    if why is not None:
        return None, why
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return None, "mlx-vlm is not installed (pip install 'macinfer[vision]'; `make setup` installs it)"
    try:
        style = MROPE_STYLE.get(config.get("model_type"))
        mrope = None
        if style is not None:
            text = config.get("text_config") or config
            scaling = text.get("rope_scaling") or text.get("rope_parameters") or config.get("rope_scaling") or {}
            if not scaling.get("mrope_section"):
                return None, "its config names no mrope_section for its multimodal RoPE"
            mrope = (list(scaling["mrope_section"]), style)
        processor = VisionProcessor.load(path, tokenizer, token)
        encoder = VisionEncoder.load(path, embed, token, dtype, cache_bytes, mrope=mrope is not None)
    except (ValueError, OSError, KeyError, ImportError) as e:
        log.warning("%s: images are off: %s", config.get("model_type"), e)
        return None, f"its processor or vision tower could not be loaded ({str(e).splitlines()[0][:200]})"
    return Vision(processor, encoder, limits or ImageLimits(), mrope), None
