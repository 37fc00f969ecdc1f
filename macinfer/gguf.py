"""Read a GGUF file into an HF-style config, MLX weights and a tokenizer.

`mx.load` does the tensor decoding: Q4_0 / Q4_1 / Q8_0 come back as MLX
affine-quantized triples (`weight`, `scales`, `biases`, group size 32), F16 and
F32 as plain arrays. This module maps llama.cpp names and metadata onto the
Hugging Face names the model files use.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

GGUF_ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_GROUP_SIZE = 32  # every block format mx.load decodes uses 32-element blocks

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, mx.array) else v


def _hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)", name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    m = re.fullmatch(r"(\w+)\.(weight|bias|scales|biases)", name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (HF half-split RoPE -> interleaved).

    Rows are output features; quantization groups run along columns, so the
    same row permutation applies to weight, scales and biases alike.
    """
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCH_TO_MODEL_TYPE:
        from macinfer.models import UnsupportedArchitectureError

        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r} in GGUF; supported: "
            + ", ".join(sorted(GGUF_ARCH_TO_MODEL_TYPE))
        )

    def get(key: str, default: Any = None) -> Any:
        return _scalar(meta.get(f"{arch}.{key}", default))

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    config = {
        "model_type": GGUF_ARCH_TO_MODEL_TYPE[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
    }
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    return config


def _quant_bits(weights: dict[str, mx.array], prefix: str) -> int:
    w, s = weights[f"{prefix}.weight"], weights[f"{prefix}.scales"]
    in_features = s.shape[-1] * GGUF_GROUP_SIZE
    return w.shape[-1] * 32 // in_features


def load_gguf(path: str) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any]]:
    """Returns (HF-style config, HF-named weights, raw GGUF metadata)."""
    raw, meta = mx.load(path, return_metadata=True)
    config = gguf_config(meta)
    weights: dict[str, mx.array] = {}
    for name, value in raw.items():
        hf = _hf_name(name)
        if hf is not None:
            weights[hf] = value

    # llama.cpp permutes Q/K for interleaved RoPE only for the llama arch.
    if meta.get("general.architecture") in ("llama", "mistral"):
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        for name in list(weights):
            for proj, n in heads.items():
                if f"self_attn.{proj}." in name:
                    weights[name] = _unpermute_rows(weights[name], n)

    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    quant: dict[str, Any] = {}
    for name in weights:
        if name.endswith(".scales"):
            prefix = name[: -len(".scales")]
            quant[prefix] = {"group_size": GGUF_GROUP_SIZE, "bits": _quant_bits(weights, prefix)}
    if quant:
        bits = sorted({q["bits"] for q in quant.values()})
        # mlx-lm's convention: a default plus per-layer overrides.
        default_bits = max(bits, key=lambda b: sum(q["bits"] == b for q in quant.values()))
        config["quantization"] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
        for prefix, q in quant.items():
            if q["bits"] != default_bits:
                config["quantization"][prefix] = q
    return config, weights, meta
