"""Which class builds a config, and what a config says of each layer's window: the model
types mlx-lm implements, mlx-lm's class for a config (mlx-vlm's for a language model only
mlx-vlm implements: `mlx_vlm_text.py`), the families refused before any probe, and the
windows some mlx-lm files leave out (`config_windows`: the one place a layer's window is
read from a config). The adapter (`mlx_lm_adapter.py`) runs what is built here."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.nn as nn

from macinfer.models import mlx_vlm_text
from macinfer.models.paged_layers import UnsupportedModelError

SPARSE = ("MiniMax M3's sparse attention (a block selection over its own index cache) picks each query's keys; "
          "the paged path runs DeepSeek Sparse Attention's indexer only, and dense attention would not be this "
          "model past the selection's budget")
# Families mlx-lm runs that the probe would pass (the selection keeps every key of a short
# context) but that the paged path would run wrong on long ones.
REFUSED = {"minimax_m3_vl": SPARSE, "minimax_m3": SPARSE}  # (the text-only one: mlx-vlm's)

# Families whose mlx-lm file applies no sliding window although transformers (and
# llama.cpp) do: the window of layer i, from the config. `layer_types` wins when given.
CONFIG_WINDOWS = {
    "gemma2": lambda cfg, i: cfg.get("sliding_window") if i % 2 == 0 else None,  # even layers slide
    "starcoder2": lambda cfg, i: cfg.get("sliding_window"),
    "phi3": lambda cfg, i: cfg.get("sliding_window"),
    # Mistral 7B v0.1 (sliding_window 4096 of 32768 positions): the paper's and transformers'
    # and vLLM's semantics; mlx-lm and llama.cpp attend to everything (docs/architectures.md).
    "mistral": lambda cfg, i: cfg.get("sliding_window"),
    # Limite (mlx-vlm's): a query reads its last `window` keys and itself; global layers
    # their own window, -1 none.
    "limite": lambda cfg, i: (lambda w: w + 1 if w is not None and w >= 0 else None)(
        cfg.get("global_window") if i in (cfg.get("global_layers") or ()) else cfg["sliding_window"]),
}


def config_windows(config: dict[str, Any], n: int) -> list[int | None]:
    """The window transformers gives each of `n` layers: `layer_types` (with
    `sliding_window`), or the family's rule for those whose mlx-lm file applies none.
    The one place a layer's window is read from a config; a cache mlx-lm's
    `make_cache()` already windows keeps its own."""
    w = config.get("sliding_window")
    if not w or config.get("use_sliding_window") is False or w >= (config.get("max_position_embeddings") or 1 << 62):
        return [None] * n
    layer_types = config.get("layer_types")
    if layer_types and len(layer_types) == n:
        return [int(w) if t == "sliding_attention" else None for t in layer_types]
    rule = CONFIG_WINDOWS.get(config.get("model_type"))
    return [None] * n if rule is None else [int(rule(config, i)) if rule(config, i) else None for i in range(n)]


def config_prompt_window(config: dict[str, Any]) -> int | None:
    """The window after the prompt every layer reads besides the whole prompt (`prompt_window`:
    set at load for a family whose decoder reads so, Unlimited-OCR's; `vision/families.py`)."""
    w = config.get("prompt_window")
    return int(w) if w else None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's text part over its top level (the text model's sizes)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


# Packages an mlx-lm model file imports only to check they are installed (it exits when one is
# missing) and never uses: OLMo's `hf_olmo` (ai2-olmo, which brings torch and CUDA libraries).
AVAILABILITY_PROBES = ("hf_olmo",)


@contextmanager
def availability_probes_met() -> Iterator[None]:
    import importlib.util
    import sys
    import types

    stubs = [n for n in AVAILABILITY_PROBES if n not in sys.modules and importlib.util.find_spec(n) is None]
    for name in stubs:
        sys.modules[name] = types.ModuleType(name, "stand-in: the importing model file only checks it exists")
    try:
        yield
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


def instantiate(config: dict[str, Any]) -> nn.Module:
    """mlx-lm's own model object for `config` (mlx-vlm's, for a language model only mlx-vlm
    implements: `mlx_vlm_text.py`); its arrays stay lazy until evaluated."""
    from mlx_lm.utils import _get_classes

    if config.get("mlx_vlm_language"):  # a vision family's decoder that only mlx-vlm implements
        return mlx_vlm_text.instantiate(config)
    try:
        with availability_probes_met():
            model_class, args_class = _get_classes(config)
    except ValueError as e:  # not an mlx-lm model type
        lm = mlx_vlm_text.instantiate(config)
        if lm is None:
            raise UnsupportedModelError(str(e)) from None
        return lm
    except (ImportError, SystemExit) as e:  # olmo's module exits when ai2-olmo is missing
        raise UnsupportedModelError(f"mlx-lm's module for it cannot be imported here ({type(e).__name__})") from None
    try:
        lm = model_class(args_class.from_dict(config))
    except Exception as e:  # noqa: BLE001 - a config mlx-lm's class cannot take
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UnsupportedModelError(f"mlx-lm's {model_class.__module__} cannot build this config ({msg})") from None
    return lm


def mlx_lm_model_types() -> list[str]:
    """Every model_type mlx-lm implements: its model files and its remapped aliases."""
    import os

    from mlx_lm import models
    from mlx_lm.utils import MODEL_REMAPPING

    files = {f[:-3] for f in os.listdir(os.path.dirname(models.__file__))
             if f.endswith(".py") and not f.startswith("_")}
    files -= {"base", "cache", "activations", "rope_utils", "switch_layers", "pipeline", "bitlinear_layers", "mla",
              "ssm", "gated_delta"}
    return sorted(files | set(MODEL_REMAPPING))


def import_model_module(model_type: str) -> Any:
    from mlx_lm.utils import MODEL_REMAPPING

    with availability_probes_met():
        return importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
