"""Architecture registry: `model_type` (HF config) -> the model that runs it.

No allowlist: every architecture mlx-lm implements is built with mlx-lm's own
classes and probed (`mlx_lm_adapter`): it runs when each of its caches maps to a
cache spec and its attention goes through the paged path; otherwise it is refused
at load with the reason. The Llama family also has a hand-written file (`llama`)
with fused q/k/v and gate/up matmuls, kept because it is measurably faster on the
CPU (see the README); the same probe decides when it applies (every layer full
attention).

`ARCHITECTURES` (what `macinfer models` and the CLI help list) is the verdict of
that probe on a tiny model of every mlx-lm `model_type`, recorded in
`architectures.json` by `scripts/architectures.py` and checked by the test suite.
"""

from __future__ import annotations

import json
import os
from typing import Any

from macinfer.kv.spec import FullAttention
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
MODEL_IMPLS = ("auto", "mlx-lm")
VERDICTS_FILE = os.path.join(os.path.dirname(__file__), "architectures.json")


def _verdicts() -> dict[str, str]:
    """model_type -> "runs" or the reason it is refused (see scripts/architectures.py)."""
    try:
        with open(VERDICTS_FILE) as f:
            return json.load(f)
    except OSError:
        return {}


VERDICTS = _verdicts()
ARCHITECTURES = tuple(sorted(t for t, v in VERDICTS.items() if v == "runs") or HAND_WRITTEN)


class UnsupportedArchitectureError(ValueError):
    pass


def supported_message() -> str:
    return f"{len(ARCHITECTURES)} architectures run: " + ", ".join(ARCHITECTURES)


def build_model(config: dict[str, Any], impl: str = "auto"):
    """Instantiate the (uninitialised) model for an HF-style config dict.
    impl "mlx-lm" runs even the Llama family through mlx-lm's classes."""
    model_type = config.get("model_type")
    try:
        check_rope(mlx_lm_adapter.text_config(config))
    except ValueError as e:
        if model_type in HAND_WRITTEN or "rope_freq_factors" in config:
            raise UnsupportedArchitectureError(str(e)) from None  # mlx-lm's classes check their own RoPE
    try:
        adapted = mlx_lm_adapter.build(config)
    except mlx_lm_adapter.UnsupportedModelError as e:
        if "rope_freq_factors" in config and model_type in HAND_WRITTEN:
            adapted = None  # GGUF rope_freqs: the hand-written file applies them
        else:
            raise UnsupportedArchitectureError(f"unsupported architecture {model_type!r}: {e}") from None
    full = adapted is None or all(type(s.kind) is FullAttention for s in adapted.layer_specs)
    if impl == "auto" and model_type in HAND_WRITTEN and full:
        module, overrides = HAND_WRITTEN[model_type]
        return module.Model(ModelArgs.from_dict({**config, **overrides}))
    if "rope_freq_factors" in config:  # GGUF rope_freqs: mlx-lm's classes would silently ignore them
        raise UnsupportedArchitectureError(
            "per-pair RoPE factors (GGUF rope_freqs) run on the hand-written Llama path only; "
            "load this model with the default model_impl")
    return adapted
