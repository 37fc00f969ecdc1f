"""GGUF -> MLX-format directory (config.json, model.safetensors, tokenizer files).

The result loads in macinfer and in mlx-lm alike: HF tensor names, Q/K rows
un-permuted, quantization recorded the way mlx-lm reads it, the tokenizer saved
by transformers (post-processor, added tokens, chat template) and every EOS id
in generation_config.json.
"""

from __future__ import annotations

import json
import logging
import math
import os

import mlx.core as mx

from macinfer.gguf.load import load_gguf
from macinfer.text.tokenizer import TokenizerWrapper

log = logging.getLogger("macinfer")


def llama3_factors(head_dim: int, base: float, scaling: dict) -> list[float]:
    """llama.cpp's `rope_freqs` for a llama3 rope_scaling (as its converter writes them)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    low_wl, high_wl = orig / low, orig / high
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _as_llama3_scaling(config: dict) -> dict | None:
    """Llama 3.x files store only the factors; recover the rope_scaling mlx-lm reads
    when they match Meta's published parameters (low 1, high 4, original 8192)."""
    factors = config["rope_freq_factors"]
    guess = {"rope_type": "llama3", "factor": max(factors), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
    ref = llama3_factors(config["head_dim"], config["rope_theta"], guess)
    return guess if all(abs(a - b) < 1e-3 * max(1.0, b) for a, b in zip(factors, ref)) else None


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
    if "rope_freq_factors" in config and (scaling := _as_llama3_scaling(config)) is not None:
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
