"""Tiny checkpoints of AllenAI's Molmo line: Molmo 2 (a SigLIP tower, an attention-pooling
adapter over two tower layers, a Qwen3 decoder under its own weight names whose embedding has
rows past the output head's for the image tokens)."""

from __future__ import annotations

from typing import Any

from tests.helpers import byte_tokenizer

MOLMO2_TOKENS = ["<im_start>", "<im_end>", "<im_patch>", "<im_col>", "<low_res_im_start>", "<|image|>", "<im_low>",
                 "<frame_start>", "<frame_end>"]


def _molmo2(path: str) -> tuple[dict, Any]:
    """Molmo 2: 378 px crops of 14 px patches (a whole view and overlapping crops of a large
    picture), pooled 2 x 2 by the adapter, each row closed by `<im_col>`; the decoder's vocabulary
    is 300 tokens, its embedding 316 rows (the image tokens past the head, as published)."""
    from mlx_vlm.models.molmo2.processing import Molmo2ImageProcessor, Molmo2Processor
    from transformers import PreTrainedTokenizerFast

    from tests.vision_families.common import TEMPLATE

    tok = byte_tokenizer()
    tok.add_tokens([f"<unused_{i}>" for i in range(300 - tok.get_vocab_size())])
    tok.add_special_tokens(MOLMO2_TOKENS + [f"<extra_{i}>" for i in range(16 - len(MOLMO2_TOKENS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>")
    fast.chat_template = TEMPLATE.replace("MARKER", "<|image|>")
    ids = {t: fast.convert_tokens_to_ids(t) for t in MOLMO2_TOKENS}
    text = {"model_type": "molmo2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
            "additional_vocab_size": 16, "layer_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192}
    vit = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 2, "head_dim": 16, "image_patch_size": 14, "image_num_pos": 729,
           "image_default_input_size": [378, 378]}
    adapter = {"hidden_size": 32, "intermediate_size": 64, "text_hidden_size": 64, "num_attention_heads": 2,
               "num_key_value_heads": 2, "head_dim": 16, "vit_layers": [-1, -2]}
    cfg = {"model_type": "molmo2", "text_config": text, "vision_config": {"vit_config": vit, "adapter_config": adapter},
           "image_start_token_id": ids["<im_start>"], "low_res_image_start_token_id": ids["<low_res_im_start>"],
           "image_end_token_id": ids["<im_end>"], "image_low_res_id": ids["<im_low>"],
           "image_patch_id": ids["<im_patch>"], "image_col_id": ids["<im_col>"],
           "frame_start_token_id": ids["<frame_start>"], "frame_end_token_id": ids["<frame_end>"], "eos_token_id": 2}
    # mlx-vlm's load replaces the checkpoint's image processor by its class's defaults (378 px crops
    # of 14 px patches, up to 8 crops and a whole view): the tiny tower takes those sizes.
    return cfg, Molmo2Processor(image_processor=Molmo2ImageProcessor(), tokenizer=fast, chat_template=fast.chat_template)


def molmo2_layout(params: dict, seed: int) -> dict:
    """Molmo 2's embedding tables initialise to zeros in mlx-vlm's module (every text row would
    be 0): random rows, so the text shows in the logits."""
    import mlx.core as mx

    mx.random.seed(seed + 1)
    return {k: (0.02 * mx.random.normal(v.shape) if k.startswith("language_model.model.wte.") else v)
            for k, v in params.items()}
