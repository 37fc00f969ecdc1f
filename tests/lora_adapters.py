"""LoRA adapters made with mlx-lm's own LoRA layers (as `mlx_lm.lora` trains and saves them)
and PEFT's file layout, with random factors, and mlx-lm's own greedy generation under one:
the reference for the engine's adapters."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten


def mlx_lm_adapter(base: str, out: str, rank: int = 4, scale: float = 10.0, num_layers: int = -1,
                   keys: list[str] | None = None, dora: bool = False, seed: int = 1) -> str:
    """An adapter for the model at `base`, saved as mlx-lm saves one (adapters.safetensors,
    adapter_config.json), its factors random (lora_b is zeros when trained from scratch)."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(base)
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0, **({"keys": keys} if keys else {})}
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    mx.random.seed(seed)
    leaves = {k: v for k, v in tree_flatten(model.trainable_parameters())}
    leaves = {k: (0.2 * mx.random.normal(v.shape) if k.endswith("lora_b") else
                  v * (1 + 0.1 * mx.random.normal(v.shape)) if k.endswith(".m") else v) for k, v in leaves.items()}
    os.makedirs(out, exist_ok=True)
    mx.save_safetensors(os.path.join(out, "adapters.safetensors"), leaves)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"fine_tune_type": "dora" if dora else "lora", "num_layers": num_layers,
                   "lora_parameters": params}, f)
    return out


def mlx_lm_lora_greedy(base: str, adapter: str | None, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own load (with `adapter_path`) and generation loop, greedy."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(base, adapter_path=adapter)
    tokens = []
    for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        tokens.append(int(t))
    return tokens


def peft_from_mlx_lm(adapter: str, out: str, alpha: float | None = None, rslora: bool = False) -> str:
    """The same factors in PEFT's layout (lora_A [r, in], lora_B [out, r] under
    `base_model.model.`), with lora_alpha chosen so that PEFT's scale equals mlx-lm's."""
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    r, scale = config["lora_parameters"]["rank"], config["lora_parameters"]["scale"]
    weights = mx.load(os.path.join(adapter, "adapters.safetensors"))
    tensors, modules = {}, set()
    for k, v in weights.items():
        module, leaf = k.rsplit(".", 1)
        modules.add(module.rsplit(".", 1)[-1])
        name = f"base_model.model.{module}.lora_{'A' if leaf == 'lora_a' else 'B'}.weight"
        tensors[name] = mx.array(np.ascontiguousarray(np.array(v).T))
    os.makedirs(out, exist_ok=True)
    mx.save_safetensors(os.path.join(out, "adapter_model.safetensors"), tensors)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha or (scale * (r ** 0.5 if rslora else r)),
                   "use_rslora": rslora, "target_modules": sorted(modules), "use_dora": False,
                   "fan_in_fan_out": False}, f)
    return out
