"""GGUF -> MLX-format directory (config.json, model.safetensors, tokenizer files).

The result loads in macinfer and in mlx-lm alike: HF tensor names, Q/K rows
un-permuted, quantization recorded the way mlx-lm reads it, the tokenizer saved
by transformers (post-processor, added tokens, chat template) and every EOS id
in generation_config.json.
"""

from __future__ import annotations

import json
import logging
import os

import mlx.core as mx

from macinfer.gguf.load import load_gguf
from macinfer.gguf.tensor_config import llama3_scaling
from macinfer.text.tokenizer import TokenizerWrapper

log = logging.getLogger("macinfer")


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    config, weights, meta = load_gguf(gguf_path)
    tokenizer = TokenizerWrapper.from_gguf_metadata(meta)
    os.makedirs(out_dir, exist_ok=True)
    config = dict(config)
    config["architectures"] = ["LlamaForCausalLM"] if config["model_type"] == "llama" else None
    eos = sorted(tokenizer.eos_token_ids)
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id
    if "rope_freq_factors" in config and (scaling := llama3_scaling(
            config["rope_freq_factors"], config["head_dim"], config["rope_theta"])) is not None:
        config["rope_scaling"] = scaling
        del config["rope_freq_factors"]
    elif "rope_freq_factors" in config:
        log.warning("rope_freqs kept as rope_freq_factors in config.json: macinfer applies them, mlx-lm does not")
    if config.get("quantization"):
        config["quantization_config"] = config["quantization"]
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save(out_dir)
    return out_dir
