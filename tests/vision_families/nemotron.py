"""NVIDIA's Nemotron 3 Nano Omni (its image path): a RADIO ViT (class and register tokens,
position embeddings resized to the picture), pixel shuffle, a squared-ReLU MLP projector; a
Nemotron-H decoder (Mamba-2, attention, MLP and MoE layers); mlx-vlm's own processor with a
dynamic-resolution image processor."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.vision_families.common import _tokenizer


def _nemotron_h_nano_omni(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.nemotron_h_nano_omni.image_processing_nemotron_h_nano_omni import (
        NemotronHNanoOmniImageProcessor,
    )
    from mlx_vlm.models.nemotron_h_nano_omni.processing_nemotron_h_nano_omni import NemotronHNanoOmniProcessor

    from tests.zoo import tiny_config

    text = {**tiny_config("nemotron_h"), "num_hidden_layers": 4}  # one Mamba, attention, MLP and MoE layer
    vision = {"model_type": "radio", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "image_size": 64, "patch_size": 16, "max_resolution": 128,
              "args": {"register_multiple": 4}}
    cfg = {"model_type": "nemotron_h_nano_omni", "text_config": text, "vision_config": vision,
           "downsample_ratio": 0.5, "projector_hidden_size": 64, "vit_hidden_size": 32,
           "img_context_token_id": 259, "eos_token_id": 2}
    tok = _tokenizer(["<image>", "<img>", "</img>", "<video>", "<so_embedding>"], "<image>")
    sizes = {"patch_size": 16, "downsample_ratio": 0.5, "min_num_patches": 4, "max_num_patches": 36,
             "norm_mean": [0.48, 0.46, 0.41], "norm_std": [0.27, 0.26, 0.28]}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:  # what its processor reads back
        json.dump(sizes, f)
    return cfg, NemotronHNanoOmniProcessor(image_processor=NemotronHNanoOmniImageProcessor(**sizes), tokenizer=tok,
                                           chat_template=tok.chat_template)
