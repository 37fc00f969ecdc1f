"""GGUF -> MLX-format directory (config.json, model.safetensors, tokenizer files).

The result loads in macinfer and in mlx-lm alike: HF tensor names, Q/K rows
un-permuted, quantization recorded the way mlx-lm reads it.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx

from macinfer.gguf import load_gguf
from macinfer.tokenizer import TokenizerWrapper


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
    if config.get("quantization"):
        config["quantization_config"] = config["quantization"]
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save(out_dir)
    return out_dir
