"""Config a GGUF's metadata does not carry but its tensors do: llama.cpp's converters write some
RoPE forms as `rope_freqs` factors (Llama 3 scaling; Gemma 4's partial rotation) and leave some
sizes to the tensors' shapes. `from_tensors` puts them back into the config `load.py` builds."""

from __future__ import annotations

import math
from typing import Any, Callable

from macinfer.gguf.file import ModelLoadError

ROPE_FREQS_READ = {"gemma4", "llama4", "exaone4"}  # their `rope_freqs` are read into the config here


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


def llama3_scaling(factors: list[float], head_dim: int, theta: float) -> dict[str, Any] | None:
    """The llama3 rope_scaling whose `rope_freqs` factors these are, when they are of Meta's
    published forms (low 1 and high 4 or 1, an original 8192); else None."""
    for low, high in ((1.0, 4.0), (1.0, 1.0)):
        guess = {"rope_type": "llama3", "factor": float(max(factors)), "low_freq_factor": low,
                 "high_freq_factor": high, "original_max_position_embeddings": 8192}
        ref = llama3_factors(head_dim, theta, guess)
        if len(ref) == len(factors) and all(abs(a - b) < 1e-3 * max(1.0, b) for a, b in zip(factors, ref)):
            return guess
    return None


def from_tensors(arch: str, config: dict[str, Any], shapes: dict[str, tuple], read: Callable) -> None:
    """What the config takes from tensors rather than metadata (`read(name)`: its values):
    Gemma 4's per-layer embedding rows (the converter does not trim them to the vocabulary)
    and its global layers' rotated share, which the converter wrote as `rope_freqs` factors
    (1 for a turned pair, 1e30 for a still one: ggml's NeoX RoPE with its pairs in order);
    Llama 4's and EXAONE 4's RoPE scaling, written as Llama 3's factors."""
    if arch in ("llama4", "exaone4") and "rope_freqs.weight" in shapes:
        text = config.get("text_config", config)
        text["rope_scaling"] = llama3_scaling(read("rope_freqs.weight").ravel().tolist(), text["head_dim"],
                                              text["rope_theta"])
        if text["rope_scaling"] is None:
            raise ModelLoadError(f"{arch} GGUF: rope_freqs that are no Llama 3 scaling of Meta's published form")
    if arch == "gemma3n":  # (rows padded to the whole vocabulary by the converter: the padding reads as zeros)
        text = config["text_config"]
        text["vocab_size_per_layer_input"] = int(shapes["per_layer_token_embd.weight"][0])
        text["laurel_rank"] = int(shapes["blk.0.laurel_l.weight"][0])
    if arch != "gemma4":
        return
    if "per_layer_token_embd.weight" in shapes:
        config["vocab_size_per_layer_input"] = int(shapes["per_layer_token_embd.weight"][0])
    if "rope_freqs.weight" in shapes:
        factors = read("rope_freqs.weight").ravel()
        turned = int((factors < 1e10).sum())
        if (factors[:turned] != 1).any():
            raise ModelLoadError("gemma4 GGUF: rope_freqs other than Gemma 4's proportional rotation (1 then 1e30)")
        config["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 2 * turned / config["global_head_dim"]
