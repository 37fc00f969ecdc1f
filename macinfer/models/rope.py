"""RoPE for the model files: mlx-lm's implementations, plus llama.cpp's per-pair
frequency factors (`rope_freqs` in Llama 3.1+ GGUF files). Kinds that cannot
run on the ragged batch are refused when the config is read, not at the first
forward."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

# Kinds whose mlx-lm module takes per-token position offsets (the ragged batch).
# `dynamic` rescales by the sequence length, which has no meaning for a batch of
# sequences of different lengths sharing one forward. `mrope` (Qwen2-VL's) is plain RoPE
# for text, whose positions are equal on every axis; images turn by `models/mrope.py`.
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "mrope")


def rope_kind(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("type") or scaling.get("rope_type") or "default"


def check_rope(config: dict[str, Any]) -> None:
    kind = rope_kind(config.get("rope_scaling"))
    if kind not in SUPPORTED_ROPE:
        raise ValueError(
            f"unsupported RoPE scaling {kind!r} (rope_scaling in config.json); supported: {', '.join(SUPPORTED_ROPE)}"
        )


# Kinds `--rope-scaling` can stretch a model's trained context with (llama.cpp's
# --rope-scaling takes the same two).
CONTEXT_EXTENSIONS = ("yarn", "linear")


def trained_context(config: dict[str, Any]) -> int | None:
    text = config.get("text_config") or config
    return text.get("max_position_embeddings") or text.get("max_seq_len")


def extend_context(config: dict[str, Any], max_model_len: int, kind: str) -> dict[str, Any]:
    """The config with RoPE scaled by `kind` from its trained context to `max_model_len`
    (factor = max_model_len / trained, `original_max_position_embeddings` = trained), as
    model cards tell users to edit config.json (Qwen3's YaRN). Unchanged if it fits."""
    if kind not in CONTEXT_EXTENSIONS:
        raise ValueError(f"--rope-scaling {kind!r}: supported: {', '.join(CONTEXT_EXTENSIONS)}")
    trained = trained_context(config)
    if trained is None or max_model_len <= trained:
        return config
    config = dict(config)
    text = config["text_config"] = dict(config["text_config"]) if "text_config" in config else config
    if rope_kind(text.get("rope_scaling")) != "default":
        raise ValueError(f"--rope-scaling {kind}: this model already scales RoPE "
                         f"({rope_kind(text['rope_scaling'])}) to its {trained}-token context")
    text["rope_scaling"] = {"rope_type": kind, "type": kind, "factor": max_model_len / trained,
                            "original_max_position_embeddings": trained}
    text["max_position_embeddings"] = max_model_len
    if "max_seq_len" in text:
        text["max_seq_len"] = max_model_len
    return config


def uses_scaled_rope(model: nn.Module, kind: str) -> bool:
    """Whether the built model's RoPE modules took a `kind` scaling from the config
    (an architecture that reads RoPE settings from elsewhere would silently not)."""
    from mlx_lm.models.rope_utils import YarnRoPE

    for _, m in model.named_modules():
        if kind == "yarn" and isinstance(m, YarnRoPE):
            return True
        if kind == "linear" and isinstance(m, nn.RoPE) and m.scale != 1.0:
            return True
    return False


class FreqFactorRoPE(nn.Module):
    """Rotary embedding whose pair i rotates with period base^(2i/d) * factors[i]:
    llama.cpp divides each pair's frequency by the stored factor."""

    def __init__(self, dims: int, base: float, traditional: bool, factors: list[float]):
        super().__init__()
        if len(factors) != dims // 2:
            raise ValueError(f"rope_freqs has {len(factors)} factors; expected {dims // 2}")
        self.dims, self.traditional = dims, traditional
        self._freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * mx.array(factors, dtype=mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)


def make_rope(head_dim: int, base: float, traditional: bool, scaling: dict[str, Any] | None,
              max_position_embeddings: int, freq_factors: list[float] | None = None) -> nn.Module:
    if freq_factors is not None:
        return FreqFactorRoPE(head_dim, base, traditional, freq_factors)
    return initialize_rope(head_dim, base, traditional, scaling, max_position_embeddings)


def rope_tables(rope: nn.Module, positions: mx.array, head_dim: int) -> tuple[mx.array, mx.array] | None:
    """(cos, sin), each [T, 1, dims / 2], of `rope` at `positions`, read off the module
    itself: rotating a probe that is 1 in the first element of every pair and 0 in
    the second gives each pair's (cos, sin), whatever the variant's frequencies and
    scaling (YaRN's magnitude scale included). None unless it rotates all `head_dim` values.

    For backends where `mx.fast.rope` is not a fused kernel (MLX's CPU backend
    computes its cos/sin in every call): once a step instead of once a layer, then
    `apply_rope_tables` per layer. A 512-token step's RoPE across 30 layers: 108 -> 33 ms."""
    dims = getattr(rope, "dims", None)
    if dims != head_dim or not hasattr(rope, "traditional"):
        return None
    half = dims // 2
    one, zero = mx.ones((half,)), mx.zeros((half,))
    probe = mx.stack([one, zero], axis=-1).reshape(dims) if rope.traditional else mx.concatenate([one, zero])
    out = rope(mx.broadcast_to(probe, (positions.shape[0], 1, 1, dims)), offset=positions)[:, :, 0, :]
    if rope.traditional:
        out = out.reshape(-1, 1, half, 2)
        return out[..., 0], out[..., 1]
    return out[..., :half], out[..., half:]


@mx.compile
def _rotate_halves(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


@mx.compile
def _rotate_pairs(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def apply_rope_tables(x: mx.array, tables: tuple[mx.array, mx.array], traditional: bool) -> mx.array:
    """x [T, heads, dims] rotated by `rope_tables`' (cos, sin): what the module gives,
    as one compiled op (traced once per token count, no kernel rebuilt)."""
    return (_rotate_pairs if traditional else _rotate_halves)(x, *tables)
