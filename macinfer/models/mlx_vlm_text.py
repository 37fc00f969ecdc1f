"""Language models that mlx-vlm implements and mlx-lm does not (K2-Horizon, Cohere2-MoE,
HY-V4, Z1T, ...): mlx-vlm's own classes, run by the same adapter as mlx-lm's
(`mlx_lm_adapter.py`: its caches mapped to cache specs by the probe, its SDPA replaced
inside our forward). A model type counts as a text model of mlx-vlm's when its `Model`
holds a language model and nothing else (no vision tower, no encoder head); the vision
families are `macinfer/vision`'s. mlx-vlm is optional: without it these stay refused.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import mlx.nn as nn

from macinfer.models.paged_layers import UnsupportedModelError


def _norm(model_type: str) -> str:
    return model_type.lower().replace("-", "_")


def _module(model_type: str) -> Any | None:
    """mlx-vlm's module for `model_type` (its own remapping), or None."""
    try:
        from mlx_vlm.utils import MODEL_REMAPPING
    except ImportError:
        return None
    name = MODEL_REMAPPING.get(model_type, model_type)
    try:
        return importlib.import_module(f"mlx_vlm.models.{name}")
    except ImportError:
        return None


def _language_class(module: Any) -> type | None:
    """The family's LanguageModel class (exported, or in its `language` submodule)."""
    if hasattr(module, "LanguageModel"):
        return module.LanguageModel
    try:
        return getattr(importlib.import_module(f"{module.__name__}.language"), "LanguageModel", None)
    except ImportError:
        return None


def mlx_vlm_only_model_types(mlx_lm_types: list[str]) -> list[str]:
    """mlx-vlm's model directories whose type mlx-lm (`mlx_lm_types`) does not implement under
    any spelling (each is a text model, a vision family, or something that generates no text)."""
    try:
        import mlx_vlm.models as vm
    except ImportError:
        return []
    lm = {_norm(t) for t in mlx_lm_types}
    root = os.path.dirname(vm.__file__)
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
                  and not d.startswith("_") and _norm(d) not in lm)


class LanguageOnly(nn.Module):
    """A vision family's language model alone, by mlx-vlm's own class for it (its decoder has
    no mlx-lm class: `vision/text_model.OWN_LANGUAGE`), held as mlx-vlm's wrappers hold it."""

    def __init__(self, language_model: nn.Module):
        super().__init__()
        self.language_model = language_model

    def __call__(self, inputs: Any, cache: Any = None) -> Any:
        return self.language_model(inputs, cache=cache)

    @property
    def layers(self) -> list[nn.Module]:
        return self.language_model.layers

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The language model's own names (`vision/text_model.language_model`) under the wrapper's."""
        return {f"language_model.{k}": v for k, v in weights.items()}


def _language_only(family: str, config: dict[str, Any]) -> nn.Module:
    module = _module(family)
    language = _language_class(module) if module is not None else None
    if language is None or not hasattr(module, "TextConfig"):
        raise UnsupportedModelError(f"mlx-vlm has no language model class for {family}")
    return LanguageOnly(language(module.TextConfig.from_dict(config)))


def instantiate(config: dict[str, Any]) -> nn.Module | None:
    """mlx-vlm's model object for a text-only `config` (or, marked `mlx_vlm_language`, a vision
    family's language model alone); None when mlx-vlm has no such model type. Raises
    UnsupportedModelError for one it has that is not a text model here."""
    if config.get("mlx_vlm_language"):
        return _language_only(config["mlx_vlm_language"], config)
    model_type = config.get("model_type", "")
    module = _module(model_type)
    if module is None:
        return None
    if not hasattr(module, "Model") or not hasattr(module, "ModelConfig"):
        raise UnsupportedModelError(f"mlx-vlm's {model_type} has no Model and ModelConfig to build (a pipeline "
                                    "of its own, e.g. image or video generation): not a language model")
    if "vision_config" in getattr(module.ModelConfig, "__dataclass_fields__", {}):
        raise UnsupportedModelError(
            f"mlx-vlm's {model_type} is a vision family (its config has a vision tower): "
            "`macinfer models architectures --vision` says whether its images run")
    language = _language_class(module)
    if language is None:
        raise UnsupportedModelError(f"mlx-vlm's {model_type} has no language model (an encoder, embedding, "
                                    "classifier or detection model): nothing here generates text")
    if any(callable(getattr(c, "generate", None)) for c in (module.Model, language)):
        # Diffusion language models unmask blocks of positions with their own sampler; omni
        # models add speech: token-by-token decoding would not be the model.
        raise UnsupportedModelError(
            f"mlx-vlm runs {model_type} through a generate() of its own (a diffusion sampler unmasking blocks of "
            "positions, or a speech pipeline), not one token at a time as this engine decodes")
    try:
        model = module.Model(module.ModelConfig.from_dict(config))
    except Exception as e:  # noqa: BLE001 - a config mlx-vlm's class cannot take
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UnsupportedModelError(f"mlx-vlm's {module.__name__} cannot build this config ({msg})") from None
    others = sorted(k for k in model.children() if k != "language_model")
    if "language_model" not in model.children() or others:
        holds = ", ".join(others) or "no language_model"
        raise UnsupportedModelError(f"mlx-vlm's {model_type} holds more than a language model ({holds}): a "
                                    "detection, encoder or multimodal model, no text generator")
    return model
