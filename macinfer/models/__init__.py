"""Architecture registry: `model_type` (HF config) -> model file."""

from __future__ import annotations

from typing import Any

from macinfer.models import llama
from macinfer.models.base import ModelArgs
from macinfer.models.rope import check_rope

# model_type -> (module, overrides applied to the config)
ARCHITECTURES: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (llama, {}),
    "mistral": (llama, {}),
    "qwen2": (llama, {"attention_bias": True}),
    "qwen3": (llama, {"qk_norm": True}),
}


class UnsupportedArchitectureError(ValueError):
    pass


def build_model(config: dict[str, Any]):
    """Instantiate the (uninitialised) model for an HF-style config dict."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}; supported: "
            + ", ".join(sorted(ARCHITECTURES))
        )
    try:
        check_rope(config)
    except ValueError as e:
        raise UnsupportedArchitectureError(str(e)) from None
    module, overrides = ARCHITECTURES[model_type]
    args = ModelArgs.from_dict({**config, **overrides})
    return module.Model(args)
