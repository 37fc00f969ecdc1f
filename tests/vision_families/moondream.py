"""Moondream 2: a SigLIP-style ViT over 378 px crops of a picture (a whole view and overlapping
crops merged back to one 27 x 27 grid: 729 rows), an MLP projector; a Phi-1.5-style decoder
(mlx-lm's `phi`) under its own names. Its processor writes the whole query around a question:
BOS and 729 placeholders of id 0 (BOS's id), the question, an answer token; BOS and the image
attend to each other both ways (a prefix)."""

from __future__ import annotations

from typing import Any

from tests.vision_families.common import _tokenizer


def _tower(family: str) -> dict:
    # mlx-vlm's processor fixes 378 px crops and 729 rows an image: the tiny tower keeps the patch grid
    return {"model_type": f"{family}_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "patch_size": 14, "crop_size": 378, "max_crops": 2, "overlap_margin": 4,
            "proj_inner_dim": 64, "proj_out_dim": 64}


def _moondream2(path: str) -> tuple[dict, Any]:
    from mlx_vlm.models.moondream2 import processing_moondream2
    from mlx_vlm.models.moondream3.processing_moondream3 import Moondream3Processor

    text = {"model_type": "moondream2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "vocab_size": 300, "max_position_embeddings": 2048, "num_attention_heads": 4, "num_key_value_heads": 4,
            "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5}
    cfg = {"model_type": "moondream2", "text_config": text, "vision_config": _tower("moondream2"), "eos_token_id": 0,
           "bos_token_id": 0}
    tok = _tokenizer([], "<image>")
    tok.chat_template = None  # (as published: the engine writes its query format)
    tok.bos_token, tok.eos_token = "<unk>", "<unk>"  # id 0, as the published tokenizer's <|endoftext|>
    tok.save_pretrained(path)
    # Its processor (and the engine's tokenizer) load the tokenizer from a hub repository its code
    # names: the tiny one for the test process.
    processing_moondream2.TOKENIZER_REPO = path
    processor = Moondream3Processor(tokenizer=tok, crop_size=378, max_crops=2, overlap_margin=4)
    processor.save_pretrained = lambda _path: None  # (written above)
    return cfg, processor


def _moondream3(path: str) -> tuple[dict, Any]:
    """Moondream 3: Moondream 2's tower and processor (its tokenizer in the checkpoint's folder),
    a decoder only mlx-vlm implements (learned query and value temperatures, `Tau`; MoE layers
    from `moe_start_layer`; a biased head): run by mlx-vlm's own language class."""
    from mlx_vlm.models.moondream3.processing_moondream3 import Moondream3Processor

    text = {"model_type": "moondream3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "vocab_size": 300, "max_position_embeddings": 2048, "num_attention_heads": 4, "num_key_value_heads": 4,
            "head_dim": 16, "rope_dim": 8, "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "moe_start_layer": 1, "prefix_attn": 730}
    cfg = {"model_type": "moondream3", "text_config": text, "vision_config": _tower("moondream3"), "eos_token_id": 0,
           "bos_token_id": 0}
    tok = _tokenizer([], "<image>")
    tok.chat_template = None
    tok.bos_token, tok.eos_token = "<unk>", "<unk>"
    tok.save_pretrained(path)  # (its tokenizer ships in the checkpoint)
    processor = Moondream3Processor(tokenizer=tok, crop_size=378, max_crops=2, overlap_margin=4)
    processor.save_pretrained = lambda _path: None
    return cfg, processor


def random_temperatures(params: dict, seed: int) -> dict:
    """Moondream 3's temperature weights initialise to zeros (every temperature 1: the `Tau`
    path unchecked): random ones, so a temperature dropped or at the wrong position shows."""
    import mlx.core as mx

    mx.random.seed(seed + 1)
    return {k: (0.5 * mx.random.normal(v.shape) if ".tau." in k else v) for k, v in params.items()}


def moondream_question(rendered: str) -> str:
    """mlx-vlm's processor writes Moondream's query around a question itself: the question."""
    return rendered.split("Question: ", 1)[1].rsplit("\n\nAnswer: ", 1)[0]
