"""Model arguments shared by the Llama-family model files.

Field names follow Hugging Face `config.json` so an MLX-format directory loads
without translation; the GGUF loader fills the same fields from GGUF metadata.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in config.items() if k in names and k != "extra"}
        extra = {k: v for k, v in config.items() if k not in names}
        return cls(**known, extra=extra)
