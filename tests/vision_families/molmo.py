"""Tiny checkpoints of AllenAI's Molmo line: Molmo 1 and 2 (a ViT, an attention-pooling
adapter over two tower layers, a Qwen2 or Qwen3 decoder under its own weight names whose
embedding has rows past the output head's for the image tokens), and Jina-VLM (Molmo 2's
layout)."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers import byte_tokenizer

MOLMO2_TOKENS = ["<im_start>", "<im_end>", "<im_patch>", "<im_col>", "<low_res_im_start>", "<|image|>", "<im_low>",
                 "<frame_start>", "<frame_end>"]


def _past_the_head(tokens: list[str]) -> Any:
    """A 300-token vocabulary (the head's) and 16 tokens past it (the embedding's: the image
    tokens, `tokens` first), with the test template writing `<|image|>` for an image part."""
    from transformers import PreTrainedTokenizerFast

    from tests.vision_families.common import TEMPLATE

    tok = byte_tokenizer()
    tok.add_tokens([f"<unused_{i}>" for i in range(300 - tok.get_vocab_size())])
    tok.add_special_tokens(tokens + [f"<extra_{i}>" for i in range(16 - len(tokens))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>")
    fast.chat_template = TEMPLATE.replace("MARKER", "<|image|>")
    return fast


def _molmo2(path: str) -> tuple[dict, Any]:
    """Molmo 2: 378 px crops of 14 px patches (a whole view and overlapping crops of a large
    picture), pooled 2 x 2 by the adapter, each row closed by `<im_col>`; the decoder's vocabulary
    is 300 tokens, its embedding 316 rows (the image tokens past the head, as published)."""
    from mlx_vlm.models.molmo2.processing import Molmo2ImageProcessor, Molmo2Processor

    fast = _past_the_head(MOLMO2_TOKENS)
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


MOLMO_TOKENS = ["<im_start>", "<im_end>", "<im_patch>", "<im_col>"]


def _molmo(path: str) -> tuple[dict, Any]:
    """Molmo 1 (Molmo-7B-D's layout): an OpenAI CLIP-style tower over 112 px crops of 14 px
    patches (a whole view and overlapping crops), two tower layers pooled 2 x 2 by attention,
    an MLP projector; a Qwen2 decoder under its own names, its embedding 16 rows past the head's.
    Its processor puts the images' tokens before the whole prompt: the template renders an image
    part as nothing."""
    from mlx_vlm.models.molmo.processing_molmo import MolmoImageProcessor, MolmoProcessor

    from tests.vision_families.common import TEMPLATE

    fast = _past_the_head(MOLMO_TOKENS)
    fast.chat_template = TEMPLATE.replace("MARKER", "")
    text = {"model_type": "molmo", "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2,
            "mlp_hidden_size": 256, "act_output_multiplier": 0.5, "vocab_size": 300, "embedding_size": 300,
            "additional_vocab_size": 16, "layer_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "weight_tying": False}
    vision = {"model_type": "molmo", "image_default_input_size": [112, 112], "image_patch_size": 14,
              "image_pos_patch_size": 14, "hidden_size": 128, "image_emb_dim": 32, "image_num_heads": 2,
              "image_num_key_value_heads": 2, "image_num_layers": 2, "image_head_dim": 16, "image_mlp_dim": 64,
              "image_num_pos": 65, "d_model": 64, "vit_layers": [-1, -2]}
    cfg = {"model_type": "molmo", "text_config": text, "vision_config": vision, "eos_token_id": 2}
    sizes = {"max_crops": 4, "overlap_margins": [2, 2], "base_image_input_size": [112, 112],
             "image_token_length_w": 4, "image_token_length_h": 4, "image_patch_size": 14}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:  # what its processor reads back
        json.dump(sizes, f)
    return cfg, MolmoProcessor(image_processor=MolmoImageProcessor(**sizes), tokenizer=fast,
                               chat_template=fast.chat_template)


def random_tables(params: dict, seed: int) -> dict:
    """Molmo 2's and Jina-VLM's embedding tables initialise to zeros in mlx-vlm's modules (every
    text row would be 0): random rows, so the text shows in the logits."""
    import mlx.core as mx

    mx.random.seed(seed + 1)
    tables = (".wte.embedding", ".wte.new_embedding", ".embedding.embedding", ".embedding.new_embedding")
    return {k: (0.02 * mx.random.normal(v.shape) if k.startswith("language_model.") and k.endswith(tables) else v)
            for k, v in params.items()}


JINA_TOKENS = ["<im_patch>", "<im_start>", "<im_end>", "<im_col>", "<|image|>"]


def _tiny_jina_ids() -> None:
    """Jina-VLM's processor builds its image processor with the published checkpoint's token ids
    fixed in mlx-vlm's code (151665-151668): the tiny vocabulary's ids for them are set for the
    test process (after the 300 tokens of the tiny vocabulary: 300-303)."""
    from mlx_vlm.models.jina_vlm import image_processor

    d = list(image_processor.ImageProcessor.__init__.__defaults__)
    d[-4:] = [300, 301, 302, 303]  # patch, start, end, column
    image_processor.ImageProcessor.__init__.__defaults__ = tuple(d)


_tiny_jina_ids()


def _jina_vlm(path: str) -> tuple[dict, Any]:
    """Jina-VLM: a SigLIP2 tower over 378 px crops, features of two tower layers pooled 2 x 2 by
    an attention connector, each row closed by `<im_col>`; a Qwen3 decoder under its own weight
    names, its embedding 16 rows past the head's (`<|image|>` among them); mlx-vlm's own
    processor (the image where the prompt says `<|image|>`). Its config is the published one
    (model type `jvlm`, nested blocks)."""
    from mlx_vlm.models.jina_vlm.processing_jinavlm import JinaVLMProcessor

    fast = _past_the_head(JINA_TOKENS)
    attn = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "q_lnorm": True}
    text = {"hidden_size": 64, "n_layers": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 300,
            "additional_vocab_size": 16, "rope_theta": 10000.0, "max_sequence_length": 8192,
            "max_position_embeddings": 8192, "block_config": {"attn_config": attn, "ffn_config": {"size": 128},
                                                              "lnorm_config": {"eps": 1e-6}}}
    vision = {"hidden_size": 32, "n_layers": 2, "num_hidden_layers": 2, "patch_size": 14, "input_size": [378, 378],
              "vit_layers": [-1, -2], "output_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
              "head_dim": 16, "block_config": {"attn_config": {"n_heads": 2, "head_dim": 16}, "ffn_config": {"size": 64}},
              "vl_connector_config": {"pooling_h": 2, "pooling_w": 2, "mlp_projector_config": {"size": 64}}}
    cfg = {"model_type": "jvlm", "text_config": text, "vision_config": vision, "vocab_size": 300,
           "image_token_index": fast.convert_tokens_to_ids("<|image|>"),
           "image_patch_token_id": fast.convert_tokens_to_ids("<im_patch>"), "bos_token_id": 1, "eos_token_id": 2,
           "pad_token_id": 0}
    return cfg, JinaVLMProcessor(tokenizer=fast, chat_template=fast.chat_template)
