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
# sequences of different lengths sharing one forward.
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


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
