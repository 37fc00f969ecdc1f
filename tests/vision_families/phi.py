"""A tiny Phi-4 multimodal checkpoint as Microsoft publishes it: a SigLIP2 NaFlex tower and a
two-layer projector, an audio tower (tiny here; audio input is refused), one sentinel id
(-200) an image, and the vision LoRA of its language model kept as PEFT factors beside the
base weights (`base_layer`, `lora_A.vision`, `lora_B.vision`), which transformers switches
on for prompts with images."""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx

from tests.vision_families.common import TEXT, _tokenizer

VISION_LORA = {"r": 4, "lora_alpha": 8}
ADAPTED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _phi4mm(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.phi4mm.processing_phi4mm import Phi4MMImageProcessor, Phi4MMProcessor

    text = {k: v for k, v in TEXT.items() if k not in ("model_type", "tie_word_embeddings")}
    vision = {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 2, "num_hidden_layers": 3, "patch_size": 14, "image_size": 56}
    audio = {"attention_dim": 32, "attention_heads": 2, "num_blocks": 1, "linear_units": 64,
             "ext_pw_out_channel": 32, "depthwise_seperable_out_channel": 32, "conv_channels": 32}
    cfg = {"model_type": "phi4mm", **text, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 2048,
           "tie_word_embeddings": True, "vision_config": vision, "mm_hidden_size": 32, "image_token_index": -200,
           "audio_token_index": 299, "pad_token_id": 0, "eos_token_id": 2, "vision_lora": VISION_LORA,
           "audio_processor": {"config": audio}, "min_num_patches": 4, "max_num_patches": 16}
    tok = _tokenizer([], "<image>")
    processor = Phi4MMProcessor(image_processor=Phi4MMImageProcessor(patch_size=14, min_num_patches=4,
                                                                      max_num_patches=16),
                                tokenizer=tok, chat_template=tok.chat_template)
    return cfg, processor


def phi4mm_lora_layout(params: dict[str, mx.array], seed: int) -> dict[str, mx.array]:
    """The language model's adapted layers as the published checkpoint holds them: each
    base weight under `model.layers.N.<layer>.base_layer.weight`, its vision LoRA factors
    (random, so the LoRA shows in the logits) beside it in PEFT's layout."""
    mx.random.seed(seed + 1)
    out = {}
    r = VISION_LORA["r"]
    for k, v in params.items():
        layer = k[len("language_model."):-len(".weight")] if k.startswith("language_model.model.layers.") else None
        if layer is None or not layer.endswith(ADAPTED):
            out[k] = v
            continue
        out[f"{layer}.base_layer.weight"] = v
        out[f"{layer}.lora_A.vision.weight"] = 0.2 * mx.random.normal((r, v.shape[1]))
        out[f"{layer}.lora_B.vision.weight"] = 0.2 * mx.random.normal((v.shape[0], r))
    return out



def _tiny_clip336() -> None:
    """mlx-vlm builds Phi-3 Vision's tower from a CLIP ViT-L/14-336 config fixed in its code
    (24 layers, 300M parameters); its HD merge fixes the width (1024) and the 336 px tiles:
    the tiny model keeps those and two narrow-MLP layers. Set for the test process, as the
    FastViT block lists are."""
    from types import SimpleNamespace

    from mlx_vlm.models.phi3_v.vision import VisionModel

    VisionModel.CLIP_VIT_LARGE_PATCH14_336_CONFIG = SimpleNamespace(
        model_type="phi3_v", hidden_size=1024, image_size=336, intermediate_size=64, layer_norm_eps=1e-05,
        num_attention_heads=16, num_channels=3, num_hidden_layers=2, patch_size=14)


_tiny_clip336()


def _phi3_v(path: str) -> tuple[dict, Any]:
    """Phi-3.5 Vision: that tower's tiles (an HD transform to 336 px tiles and a global view,
    2 x 2 merged, newline rows), a projector, Phi-3's decoder (mlx-lm's `phi3`) inside the
    same module as the tower; each image's placeholders are negative ids (-k for image k)."""
    from mlx_vlm.models.phi3_v.processing_phi3_v import Phi3VImageProcessor, Phi3VProcessor

    text = {k: v for k, v in TEXT.items() if k != "model_type"}
    cfg = {"model_type": "phi3_v", **text, "original_max_position_embeddings": 2048, "eos_token_id": 2,
           "vision_config": {"model_type": "phi3_v", "image_dim_out": 1024, "num_img_tokens": 144},
           "embd_layer": {"embedding_cls": "image", "hd_transform_order": "sub_glb", "projection_cls": "mlp",
                          "use_hd_transform": True, "with_learnable_separator": True}}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:  # what its processor reads back
        json.dump({"num_crops": 4, "num_img_tokens": 144}, f)
    tok = _tokenizer([], "<|image_1|>")
    return cfg, Phi3VProcessor(image_processor=Phi3VImageProcessor(num_crops=4), tokenizer=tok,
                               chat_template=tok.chat_template)


def _phi4_siglip(path: str) -> tuple[dict, Any]:
    """Phi-4-SigLIP (Phi-4 with a SigLIP2 NaFlex tower): the tower's second-to-last layer through
    a two-layer projector, one sentinel id (-200) an image, grown into its rows at the merge;
    Phi-4's decoder (fused projections, mlx-lm's `phi3`) with its config at the root. Its
    processor builds transformers' Siglip2 image processor, loaded torch-free here as on a Mac."""
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil
    from mlx_vlm.models.phi4_siglip.processing_phi4_siglip import Phi4SigLipProcessor

    text = {k: v for k, v in TEXT.items() if k != "model_type"}
    vision = {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 16, "num_patches": 64}
    # (its config keeps the decoder's fields at the root; mlx-vlm's loader reads them there)
    cfg = {"model_type": "phi4-siglip", **text, "partial_rotary_factor": 1.0, "vision_config": vision,
           "text_config": {**{k: v for k, v in text.items() if k not in ("max_position_embeddings",
                                                                         "tie_word_embeddings")},
                           "model_type": "phi4-siglip", "partial_rotary_factor": 1.0},
           "mm_hidden_size": 32, "mm_projector_type": "mlp2x_gelu", "mm_vision_select_layer": -2,
           "mm_vision_tower": "google/siglip2-so400m-patch16-naflex", "min_num_patches": 16, "max_num_patches": 64,
           "image_token_index": -200, "eos_token_id": 2}
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], "<image>")
    # ChatML as published: its processor templates any text without `<|im_start|>` itself
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                         "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
                         "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    image_processor = Siglip2ImageProcessorPil(patch_size=16, max_num_patches=64, min_num_patches=16,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Phi4SigLipProcessor(image_processor=image_processor, tokenizer=tok)
    processor.save_pretrained = tok.save_pretrained  # (its loader builds the image processor from the config)
    return cfg, processor
