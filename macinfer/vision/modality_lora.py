"""A vision checkpoint whose language model runs image prompts under a LoRA of its own
(Phi-4 multimodal: `lora_A.vision` / `lora_B.vision` beside each adapted layer's
`base_layer`, rank and alpha in the config's `vision_lora`). Transformers switches that
LoRA on for prompts with images and off for text alone; mlx-vlm merges it into the weights
at load (every prompt runs under it until one switches it). The engine keeps the base
weights and serves the LoRA as an adapter of its own (`macinfer/lora/`), which each request
with images runs under, row by row in a batch with text requests."""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Any

import mlx.core as mx

from macinfer.lora.adapter import LoraAdapter, LoraPart

NAME = "image-prompts"  # the adapter's name in the engine's registry (not a served model name)


def vision_lora(path: str, config: dict[str, Any]) -> LoraAdapter | None:
    """The checkpoint's vision LoRA as an adapter (module paths as mlx-lm names them), or
    None when it keeps none (a conversion that merged it: every prompt runs merged)."""
    spec = config.get("vision_lora")
    if not isinstance(spec, dict):
        return None
    scale = float(spec.get("lora_alpha", 512)) / float(spec.get("r", 256))
    factors: dict[str, dict[str, mx.array]] = {}
    # Its identity (the prefix cache's key for what runs under it): the files' names, sizes
    # and safetensors headers (names, dtypes, shapes, offsets), not gigabytes of bytes.
    digest = hashlib.blake2b(digest_size=16)
    for fp in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(fp, "rb") as f:
            head = f.read(8)
            digest.update(os.path.basename(fp).encode() + head + f.read(int.from_bytes(head, "little")))
        for k, v in mx.load(fp).items():  # lazy: only the factors are read
            for tag, which in ((".lora_A.vision.weight", "a"), (".lora_B.vision.weight", "b")):
                if k.endswith(tag):
                    factors.setdefault(k[: -len(tag)], {})[which] = v
    if not factors:
        return None
    parts = {}
    for module, f in sorted(factors.items()):
        if set(f) != {"a", "b"}:
            raise ValueError(f"its vision LoRA lacks lora_A or lora_B for {module}")
        # PEFT: A [r, in], B [out, r]; kept in the checkpoint's dtype (Phi-4 multimodal's rank-256
        # factors are ~370M values: 0.7 GB in bf16, twice that in float32)
        a, b = f["a"].T, (f["b"] * scale).T
        parts[module] = LoraPart(a, b)
    return LoraAdapter(NAME, path, digest.hexdigest(), "peft", parts)
