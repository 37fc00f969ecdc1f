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
VLM_VERDICTS_FILE = os.path.join(os.path.dirname(__file__), "architectures_mlx_vlm.json")


def _verdicts(path: str) -> dict[str, str]:
    """model_type -> "runs" or the reason it is refused (see scripts/architectures.py)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError:
        return {}


VERDICTS = _verdicts(VERDICTS_FILE)  # every model_type mlx-lm implements
VLM_VERDICTS = _verdicts(VLM_VERDICTS_FILE)  # mlx-vlm's that mlx-lm lacks (`mlx_vlm_text.py`)
ARCHITECTURES = tuple(sorted(t for t, v in {**VERDICTS, **VLM_VERDICTS}.items() if v == "runs") or HAND_WRITTEN)


class UnsupportedArchitectureError(ValueError):
    pass


def supported_message() -> str:
    return f"{len(ARCHITECTURES)} architectures run: " + ", ".join(ARCHITECTURES)


def build_model(config: dict[str, Any], impl: str = "auto"):
    """Instantiate the (uninitialised) model for an HF-style config dict.
    impl "mlx-lm" runs even the Llama family through mlx-lm's classes."""
    model_type = config.get("model_type")
    freq_factors = "rope_freq_factors" in config  # GGUF rope_freqs: only the hand-written file applies them
    try:
        check_rope(config)
        rope_error = None
    except ValueError as e:
        rope_error = str(e)
    try:
        adapted, refusal = mlx_lm_adapter.build(config), None
    except mlx_lm_adapter.UnsupportedModelError as e:
        adapted, refusal = None, f"unsupported architecture {model_type!r}: {e}"
    # The probe decides: the hand-written file serves its families when every layer is full attention.
    full = adapted is None or all(type(s.kind) is FullAttention for s in adapted.layer_specs)
    hand_written = model_type in HAND_WRITTEN and impl == "auto" and full
    if hand_written and rope_error is None:
        module, overrides = HAND_WRITTEN[model_type]
        return module.Model(ModelArgs.from_dict({**config, **overrides}))
    if freq_factors:
        raise UnsupportedArchitectureError(rope_error or (
            "per-pair RoPE factors (GGUF rope_freqs) run on the hand-written Llama path only; "
            "load this model with the default model_impl"))
    if adapted is None:
        raise UnsupportedArchitectureError(rope_error if rope_error and model_type in HAND_WRITTEN else refusal)
    return adapted
