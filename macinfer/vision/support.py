"""A vision checkpoint's image path, loaded once: for a family that runs (`families.py`), its
processor and encoder, its template made to write what its processor writes
(`templates.py`), and the rules its language model runs by (`Vision`)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from macinfer.vision.encoder import VisionEncoder
from macinfer.vision.families import (BOS_FIRST, DEEPSTACK_FAMILIES, IMAGES_FIRST, MODALITY_LORA, MROPE_STYLE,
                                      NORMED_ROWS, ONE_IMAGE, ONE_IMAGE_MERGES, OWN_VOCAB, PREFIX_LM, PROMPT_WRITERS,
                                      SCALED_TEXT_ROWS, SENTINEL_FAMILIES, TORCH_FREE, both_ways_images,
                                      deepstack_layers, family, image_token_id, is_vision_config, verdict)
from macinfer.vision.images import ImageLimits
from macinfer.vision.processor import VisionProcessor
from macinfer.vision.processor_fixes import torch_free_siglip2
from macinfer.vision.templates import OWN_TEMPLATES, PREFIX_LM_TEMPLATE, bos_first

log = logging.getLogger(__name__)


@dataclass
class Vision:
    """A loaded model's image path: its processor, encoder and limits."""
    processor: VisionProcessor
    encoder: VisionEncoder
    limits: ImageLimits
    mrope: tuple[list[int], str] | None = None  # (mrope_section, style) of a multimodal RoPE family
    both_ways: bool = False  # an image's tokens attend to each other both ways
    deepstack: tuple[int, ...] = ()  # the decoder layers DeepStack entries are added after (`models/deepstack.py`)
    # The language model also reads the prompt's ids (Gemma 3n/4's per-layer inputs): an image
    # placeholder's id is read as the pad id there, as the family's own merge does.
    pad_image_ids: bool = False
    prefix_lm: bool = False  # the whole prompt attends both ways (PaliGemma)
    token_embed_scale: float = 1.0  # what given text rows are multiplied by (`SCALED_TEXT_ROWS`)
    lora: Any = None  # the LoRA image prompts run under (`MODALITY_LORA`; a `LoraAdapter`)
    projector: str | None = None  # a GGUF model's vision projector file (`gguf/mmproj.py`)


def load_vision(path: str, config: dict[str, Any], tokenizer: Any, embed: Any, dtype: mx.Dtype,
                limits: ImageLimits | None = None, cache_bytes: int = 256 * 2**20,
                prepared: Any = None) -> tuple[Vision | None, str | None]:
    """(the image path, None) for a checkpoint whose family runs, else (None, why not).
    `prepared`: the family's mlx-vlm model already holding its tower and projector (a GGUF's
    projector file, `gguf/mmproj.py`); else they are read from `path`."""
    if not is_vision_config(config):
        return None, None
    why = verdict(config)
    if why is not None:
        return None, why
    try:
        from mlx_vlm.utils import get_model_and_args
    except ImportError:
        return None, "mlx-vlm is not installed (pip install 'macinfer[vision]'; `make setup` installs it)"
    try:
        get_model_and_args(config)  # imports the family's module: it registers its own processor classes
    except (ImportError, KeyError, ValueError) as e:
        return None, f"mlx-vlm has no model class for it ({e})"
    kind = family(config)  # (the checkpoint's own spelling resolved: Unlimited-OCR's `unlimited-ocr`)
    try:
        style = MROPE_STYLE.get(kind)
        mrope = None
        if style is not None:
            text = config.get("text_config") or config
            scaling = text.get("rope_scaling") or text.get("rope_parameters") or config.get("rope_scaling") or {}
            section = scaling.get("mrope_section") or scaling.get("xdrope_section")  # (HunyuanOCR's name)
            if not section:
                return None, "its config names no mrope_section for its multimodal RoPE"
            mrope = (list(section), style)
        prefix_lm = kind in PREFIX_LM
        if prefix_lm and not tokenizer.chat_template:
            tokenizer.set_chat_template(PREFIX_LM_TEMPLATE)
        if kind in OWN_TEMPLATES and not tokenizer.chat_template:
            tokenizer.set_chat_template(OWN_TEMPLATES[kind](tokenizer))
        if kind in BOS_FIRST | IMAGES_FIRST:
            bos_first(tokenizer, or_eos=kind in IMAGES_FIRST)
        if kind in TORCH_FREE:
            torch_free_siglip2()
        own = config["vision_config"] if kind in OWN_VOCAB else None
        processor = VisionProcessor.load(path, tokenizer, image_token_id(config),
                                         placeholders_only=prefix_lm or kind in PROMPT_WRITERS,
                                         model_type=config.get("model_type"),  # (as mlx-vlm spells it)
                                         own_vocab=(own["vocab_offset"], own["vocab_offset"] + own["vocab_size"])
                                         if own else None)
        token = processor.image_token_id
        deepstack = deepstack_layers(config)
        encoder = VisionEncoder.load(path, embed, token, dtype, cache_bytes, mrope=mrope is not None,
                                     deepstack=kind in DEEPSTACK_FAMILIES,
                                     normed_rows=kind in NORMED_ROWS, prepared=prepared)
        if kind in SENTINEL_FAMILIES:
            encoder.sentinel, processor.sentinel_rows = True, encoder.sentinel_rows
        encoder.alone = kind in ONE_IMAGE_MERGES
        lora = None
        if kind in MODALITY_LORA:
            from macinfer.vision.modality_lora import vision_lora

            lora = vision_lora(path, config)
    except (ValueError, OSError, KeyError, ImportError, AttributeError, TypeError) as e:  # the checkpoint's fault
        log.warning("%s: images are off: %s", config.get("model_type"), e)
        return None, f"its processor or vision tower could not be loaded ({str(e).splitlines()[0][:200]})"
    text = config.get("text_config") or config
    scale = text["hidden_size"] ** 0.5 if kind in SCALED_TEXT_ROWS else 1.0
    limits = limits or ImageLimits()
    if kind in ONE_IMAGE:
        limits = dataclasses.replace(limits, max_images=1)
    return Vision(processor, encoder, limits, mrope, both_ways_images(config), deepstack,
                  bool(text.get("hidden_size_per_layer_input")), prefix_lm, scale, lora), None
