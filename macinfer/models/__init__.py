"""Architecture registry: `model_type` (HF config) -> the model that runs it.

The one list of what macinfer runs. Most families run through mlx-lm's own
model classes on the paged cache (`mlx_lm_adapter`); the Llama family also has
a hand-written file (`llama`) with fused q/k/v and gate/up matmuls, kept
because it is measurably faster on the CPU (see the README), and used unless a
sliding window is configured.
"""

from __future__ import annotations

from typing import Any

from macinfer.models import llama, mlx_lm_adapter
from macinfer.models.base import ModelArgs
from macinfer.models.rope import check_rope

# model_type -> (module, overrides applied to the config)
HAND_WRITTEN: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (llama, {}),
    "mistral": (llama, {}),
    "qwen2": (llama, {"attention_bias": True}),
    "qwen3": (llama, {"qk_norm": True}),
}
# Families verified through mlx-lm's classes by the parity matrix (tests/test_architectures.py).
MLX_LM_FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text", "gpt_oss",
    "phi3", "granite", "olmo2", "glm4", "starcoder2",
)
ARCHITECTURES = tuple(sorted(set(HAND_WRITTEN) | set(MLX_LM_FAMILIES)))
MODEL_IMPLS = ("auto", "mlx-lm")


class UnsupportedArchitectureError(ValueError):
    pass


def supported_message() -> str:
    return "supported: " + ", ".join(ARCHITECTURES)


def _sliding_window(config: dict[str, Any]) -> bool:
    """Per-layer sliding windows, as mlx-lm's llama reads them (`layer_types`); a bare
    `sliding_window` (Mistral v0.1) is full attention there too."""
    return "sliding_attention" in (config.get("layer_types") or [])


def build_model(config: dict[str, Any], impl: str = "auto"):
    """Instantiate the (uninitialised) model for an HF-style config dict.
    impl "mlx-lm" runs even the Llama family through mlx-lm's classes."""
    model_type = config.get("model_type")
    if model_type in mlx_lm_adapter.REFUSED:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}: {mlx_lm_adapter.REFUSED[model_type]}; {supported_message()}")
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(f"unsupported architecture {model_type!r}; {supported_message()}")
    try:
        check_rope(config)
    except ValueError as e:
        raise UnsupportedArchitectureError(str(e)) from None
    if impl == "auto" and model_type in HAND_WRITTEN and not _sliding_window(config):
        module, overrides = HAND_WRITTEN[model_type]
        return module.Model(ModelArgs.from_dict({**config, **overrides}))
    if "rope_freq_factors" in config:  # GGUF rope_freqs: mlx-lm's classes would silently ignore them
        raise UnsupportedArchitectureError(
            "per-pair RoPE factors (GGUF rope_freqs) run on the hand-written Llama path only; "
            "load this model with the default model_impl")
    try:
        return mlx_lm_adapter.build(config)
    except mlx_lm_adapter.UnsupportedModelError as e:
        raise UnsupportedArchitectureError(f"unsupported architecture {model_type!r}: {e}") from None
