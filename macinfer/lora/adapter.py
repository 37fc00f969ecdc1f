"""A LoRA adapter as it is published: mlx-lm's (`adapters.safetensors` + `adapter_config.json`,
LoRA or DoRA, as `mlx_lm.lora` trains them) or PEFT's (`adapter_model.safetensors` +
`adapter_config.json`: rank, alpha, rsLoRA, DoRA), read into one form: for each adapted
module (by its mlx-lm path) the low-rank factors A [in, r] and B [r, out] with the scale
folded into B, and DoRA's magnitude. Its identity is a hash of its files' bytes."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import mlx.core as mx


class LoraError(ValueError):
    """An adapter that cannot be served, and why (the request's or the operator's fault)."""


@dataclass
class LoraPart:
    a: mx.array  # [in, r] ([experts, in, r] for an MoE's expert layer)
    b: mx.array  # [r, out] ([experts, r, out]), the scale folded in
    magnitude: mx.array | None = None  # DoRA: [out]


@dataclass
class LoraAdapter:
    name: str
    path: str
    digest: str  # content hash of the adapter's files: the prefix cache's key for it
    format: str  # "mlx-lm" | "peft"
    parts: dict[str, LoraPart] = field(default_factory=dict)  # mlx-lm module path -> factors

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes + (p.magnitude.nbytes if p.magnitude is not None else 0)
                   for p in self.parts.values())


def load_adapter(name: str, path: str) -> LoraAdapter:
    """Read the adapter at `path` (a folder, or a Hugging Face repo id already in the local
    cache: nothing is downloaded). Raises LoraError with the reason."""
    if not os.path.isdir(path):
        path = _from_hf_cache(path) or path
    if not os.path.isdir(path):
        raise LoraError(f"LoRA adapter {name!r}: {path} is not a folder (nor a repo in the Hugging Face cache)")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise LoraError(f"LoRA adapter {name!r}: {path} has no adapter_config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json is unreadable ({e})") from None
    peft = "peft_type" in config or os.path.isfile(os.path.join(path, "adapter_model.safetensors"))
    weights_path = os.path.join(path, "adapter_model.safetensors" if peft else "adapters.safetensors")
    if not os.path.isfile(weights_path):
        raise LoraError(f"LoRA adapter {name!r}: {os.path.basename(weights_path)} is missing in {path}")
    digest = hashlib.blake2b(digest_size=16)
    for p in (config_path, weights_path):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    try:
        weights = mx.load(weights_path)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: MLX's own message
        raise LoraError(f"LoRA adapter {name!r}: {os.path.basename(weights_path)} cannot be read ({e})") from None
    adapter = LoraAdapter(name, path, digest.hexdigest(), "peft" if peft else "mlx-lm")
    adapter.parts = _peft_parts(name, config, weights) if peft else _mlx_lm_parts(name, config, weights)
    if not adapter.parts:
        raise LoraError(f"LoRA adapter {name!r}: its file holds no LoRA factors")
    return adapter


def _from_hf_cache(repo: str) -> str | None:
    if repo.count("/") != 1 or repo.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or no hub library): not an adapter we can read
        return None


def _group(weights: dict[str, mx.array]) -> dict[str, dict[str, mx.array]]:
    modules: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        module, _, leaf = key.rpartition(".")
        modules.setdefault(module, {})[leaf] = value
    return modules


def _mlx_lm_parts(name: str, config: dict, weights: dict[str, mx.array]) -> dict[str, LoraPart]:
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise LoraError(f"LoRA adapter {name!r}: a full fine-tune (fine_tune_type 'full') is a model, not an adapter: "
                        "serve it as one")
    if kind not in ("lora", "dora"):
        raise LoraError(f"LoRA adapter {name!r}: fine_tune_type {kind!r} is not LoRA or DoRA")
    scale = float((config.get("lora_parameters") or {}).get("scale", 20.0))
    parts = {}
    for module, leaves in _group(weights).items():
        unknown = set(leaves) - {"lora_a", "lora_b", "m"}
        if unknown or "lora_a" not in leaves or "lora_b" not in leaves:
            raise LoraError(f"LoRA adapter {name!r}: {module} holds {sorted(leaves)}, not lora_a and lora_b")
        a, b = leaves["lora_a"], leaves["lora_b"]
        if a.ndim == 3 and b.ndim == 3 and "m" not in leaves:  # an MoE's experts: [E, r, in], [E, out, r]
            if a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
                raise LoraError(f"LoRA adapter {name!r}: {module}: lora_a {a.shape} and lora_b {b.shape} disagree")
            parts[module] = LoraPart(a.swapaxes(1, 2).astype(mx.float32), (scale * b.swapaxes(1, 2)).astype(mx.float32))
            continue
        if a.ndim != 2 or b.ndim != 2:
            raise LoraError(f"LoRA adapter {name!r}: {module}: factors of {a.ndim} and {b.ndim} dimensions")
        if a.shape[1] != b.shape[0]:
            raise LoraError(f"LoRA adapter {name!r}: {module}: lora_a {a.shape} and lora_b {b.shape} disagree on the rank")
        if (kind == "dora") != ("m" in leaves):
            raise LoraError(f"LoRA adapter {name!r}: {module}: a {kind} adapter "
                            f"{'without' if kind == 'dora' else 'with'} a magnitude vector")
        parts[module] = LoraPart(a.astype(mx.float32), (scale * b).astype(mx.float32),
                                 leaves["m"].astype(mx.float32) if "m" in leaves else None)
    return parts


def _peft_parts(name: str, config: dict, weights: dict[str, mx.array]) -> dict[str, LoraPart]:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: PEFT type {peft_type} is not LoRA")
    if config.get("fan_in_fan_out"):
        raise LoraError(f"LoRA adapter {name!r}: fan_in_fan_out (GPT-2 style Conv1D layers) is not taken")
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraError(f"LoRA adapter {name!r}: per-module ranks or alphas (rank_pattern, alpha_pattern) are not taken")
    parts = {}
    by_module: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        for leaf, tag in ((".lora_A.weight", "a"), (".lora_B.weight", "b"), (".lora_magnitude_vector", "m"),
                          (".lora_magnitude_vector.weight", "m")):
            if key.endswith(leaf):
                module = key[: -len(leaf)]
                module = module[len("base_model.model."):] if module.startswith("base_model.model.") else module
                by_module.setdefault(module, {})[tag] = value
                break
        else:
            raise LoraError(f"LoRA adapter {name!r}: {key} is not a LoRA factor (embedding or bias adapters are "
                            "not taken)")
    for module, f in by_module.items():
        if "a" not in f or "b" not in f:
            raise LoraError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B")
        a, b = f["a"].T, f["b"].T  # PEFT: A [r, in], B [out, r]
        if a.ndim != 2 or a.shape[1] != b.shape[0]:
            raise LoraError(f"LoRA adapter {name!r}: {module}: lora_A and lora_B disagree on the rank")
        if bool(config.get("use_dora")) != ("m" in f):
            raise LoraError(f"LoRA adapter {name!r}: {module}: use_dora and the magnitude vectors disagree")
        parts[module] = LoraPart(a.astype(mx.float32), (scale * b).astype(mx.float32),
                                 f["m"].reshape(-1).astype(mx.float32) if "m" in f else None)
    return parts
