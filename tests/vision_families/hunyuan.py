"""HunyuanOCR (Hunyuan-VL): a ViT over 16 px patches merged 2 x 2 by convolutions, each merged
row closed by a newline row and the image between begin and end rows; Hunyuan's dense decoder
(mlx-lm's `hunyuan_v1_dense`) turning positions by XD-RoPE over four axes (the token's index,
then column, row and image inside each image's grid: transformers' rule)."""

from __future__ import annotations

from typing import Any

from tests.vision_families.common import TEXT, _tokenizer

SPECIALS = ["<image>", "<im_start>", "<im_end>"]


def _tiny_ids(tok: Any) -> None:
    """mlx-vlm's processor fixes its token ids to the published vocabulary's (120118-120120), which
    the 300-row tiny tokenizer cannot hold: for the test process they are the tiny tokenizer's."""
    from mlx_vlm.models.hunyuan_vl.processing_hunyuan_vl import HunYuanVLProcessor

    image, start, end = (tok.convert_tokens_to_ids(t) for t in SPECIALS)
    HunYuanVLProcessor.IMAGE_TOKEN_ID, HunYuanVLProcessor.IM_START_TOKEN_ID = image, start
    HunYuanVLProcessor.IM_END_TOKEN_ID, HunYuanVLProcessor.PAD_TOKEN_ID = end, 299


def _hunyuan_vl(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.hunyuan_vl.processing_hunyuan_vl import HunYuanVLImageProcessor, HunYuanVLProcessor

    tok = _tokenizer(SPECIALS, "<image>")
    _tiny_ids(tok)
    image, start, end = (tok.convert_tokens_to_ids(t) for t in SPECIALS)
    text = {**TEXT, "model_type": "hunyuan_vl", "head_dim": 16, "use_qk_norm": True, "tie_word_embeddings": True,
            "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "type": "xdrope", "xdrope_section": [2, 2, 2, 2]},
            "bos_token_id": 1, "eos_token_id": 2, "pad_id": 299}
    vision = {"model_type": "hunyuan_vl", "hidden_size": 32, "out_hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "intermediate_size": 64, "patch_size": 16, "spatial_merge_size": 2,
              "max_image_size": 256}
    cfg = {"model_type": "hunyuan_vl", "text_config": text, "vision_config": vision, "image_token_id": image,
           "image_start_token_id": start, "image_end_token_id": end, "vocab_size": 300, "eos_token_id": 2,
           "bos_token_id": 1, "pad_id": 299, "tie_word_embeddings": True}
    image_processor = HunYuanVLImageProcessor(min_pixels=32 * 32, max_pixels=96 * 96, patch_size=16, merge_size=2)
    return cfg, HunYuanVLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)


def random_markers(params: dict, seed: int) -> dict:
    """The tower's begin, end and newline rows initialise to zeros: random ones, so a row out
    of place shows."""
    import mlx.core as mx

    mx.random.seed(seed + 1)
    marks = ("image_newline", "image_begin", "image_end", "image_sep")
    return {k: (0.5 * mx.random.normal(v.shape) if k.rsplit(".", 1)[-1] in marks else v) for k, v in params.items()}
