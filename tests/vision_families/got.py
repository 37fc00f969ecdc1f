"""GOT-OCR 2.0 (mlx-vlm's `got`: the published remote-code layout): a SAM-style ViT at 1024 px
(windowed and global blocks, a neck, two stride-2 convolutions: 256 rows), a linear projector,
a Qwen2 decoder with its config at the root; no chat template (the engine writes GOT's MPT
conversation) and mlx-vlm's own processor."""

from __future__ import annotations

from typing import Any

from tests.vision_families.common import TEXT, _tokenizer


def _got(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.got.processing_got import GotOcrImageProcessor, GotOcrProcessor

    tok = _tokenizer(["<img>", "</img>", "<imgpad>", "<|im_start|>", "<|im_end|>"], "<image>")
    tok.chat_template = None  # (as published)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<imgpad>")}
    # mlx-vlm's processor fixes 1024 px and 256 rows an image: the tiny tower keeps the patch grid
    vision = {"img_size": 1024, "patch_size": 16, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0,
              "out_chans": 16, "out_dim": 64, "window_size": 14, "global_attn_indexes": [1]}
    cfg = {**TEXT, "model_type": "got", "rope_theta": 1000000.0, "vision_config": vision,
           "im_start_token": ids["<img>"], "im_end_token": ids["</img>"], "im_patch_token": ids["<imgpad>"],
           "eos_token_id": 2}
    return cfg, GotOcrProcessor(image_processor=GotOcrImageProcessor(), tokenizer=tok)


def got_instruction(rendered: str) -> str:
    """mlx-vlm's processor writes GOT's conversation around an instruction itself: the user's
    turn of the engine's rendered prompt."""
    return rendered.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
