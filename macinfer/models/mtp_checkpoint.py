"""The MTP layers' tensors in a checkpoint (which mlx-lm's loading drops): which names are
theirs, reading only those, and renaming them from each published layout onto the head's
modules (`models/mtp.py`): norms stored zero-centred shifted, experts stacked, and a
DeepSeek- or Nemotron-style layer passed through the target's own sanitizer."""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.models.mlx_lm_adapter import MlxLmModel
from macinfer.models.mlx_lm_classes import text_config


def declared_layers(config: dict[str, Any]) -> int:
    """How many MTP layers a config declares (0: none)."""
    tcfg = text_config(config)
    return int(tcfg.get("mtp_num_hidden_layers") or tcfg.get("num_nextn_predict_layers") or 0)


NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
         "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


def mtp_keys(config: dict[str, Any]) -> Any:
    """A predicate for the checkpoint tensors of its MTP layers (which the target never loads)."""
    n = text_config(config).get("num_hidden_layers")
    deep = tuple(f"model.layers.{n + j}." for j in range(declared_layers(config))) if n else ()
    return lambda k: k.startswith(("mtp.", "model.mtp.", "model.mtp_layers.")) or (bool(deep) and k.startswith(deep))


def _glm_lite_name(k: str, n: int) -> str:
    """GLM-4.7-Flash's split names (`model.{enorm,hnorm,eh_proj,embed_tokens}`, `model.mtp_block.*`,
    `model.shared_head_norm`, `lm_head`) -> its checkpoint's `model.layers.{n}.*`."""
    if k == "lm_head.weight":
        return f"model.layers.{n}.shared_head.head.weight"
    k = k.removeprefix("model.").removeprefix("mtp_block.").replace("shared_head_norm.", "shared_head.norm.")
    return f"model.layers.{n}.{k}"


# mlx-vlm's split MTP drafter folders (`mlx_vlm.split_mtp`: a checkpoint's MTP tensors alone,
# written by MLX, `model_type` "<family>_mtp") the engine reads: their model type -> (the
# head's layout, a split name and the target's layer count -> the name in the checkpoint).
SPLIT_DRAFTERS: dict[str, tuple[str, Any]] = {
    "qwen3_5_mtp": ("qwen", lambda k, n: f"mtp.{k}"),
    "glm4_moe_lite_mtp": ("deepseek", _glm_lite_name),
    "glm_moe_dsa_mtp": ("deepseek", lambda k, n: f"model.layers.{n}." + k.removeprefix("mtp.").replace(
        "shared_head_norm.", "shared_head.norm.")),
    "nemotron_h_mtp": ("nemotron", lambda k, n: f"mtp.{k}"),
}


def split_drafter(path: str) -> str | None:
    """The model type of the split MTP drafter folder at `path` (None: not one)."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            model_type = str(json.load(f).get("model_type") or "")
    except (OSError, ValueError):
        return None
    return model_type if model_type.endswith("_mtp") else None


def checkpoint_tensors(path: str, keep: Any) -> tuple[dict[str, mx.array], bool]:
    """The checkpoint's tensors whose names `keep` accepts (mx.load reads lazily: only
    these are ever read from disk), and whether they were written by MLX (already in
    mlx-lm's layout: norms shifted, experts stacked, maybe quantized)."""
    out: dict[str, mx.array] = {}
    mlx_format = False
    for fp in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors, meta = mx.load(fp, return_metadata=True)
        picked = {k: v for k, v in tensors.items() if keep(k)}
        mlx_format |= bool(picked) and (meta or {}).get("format") == "mlx"
        out.update(picked)
    return out, mlx_format


def qwen_weights(raw: dict[str, mx.array], depth: int, mlx_format: bool) -> dict[str, mx.array]:
    """`mtp.*` in transformers' layout -> the stack's names: norms 1 + w, experts stacked
    (written by MLX: already so)."""
    out: dict[str, mx.array] = {}
    for k, v in raw.items():
        k = k[len("mtp."):]
        if k.endswith(NORMS) and v.ndim == 1 and not mlx_format:
            v = v + 1.0
        out[k] = v
    for i in range(depth):
        p = f"layers.{i}.mlp"
        if f"{p}.experts.gate_up_proj" in out:  # fused experts (Qwen3.5 MoE)
            gate_up = out.pop(f"{p}.experts.gate_up_proj")
            mid = gate_up.shape[-2] // 2
            out[f"{p}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
            out[f"{p}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
            out[f"{p}.switch_mlp.down_proj.weight"] = out.pop(f"{p}.experts.down_proj")
        experts = sorted({int(m.group(1)) for k in out if (m := re.match(rf"{p}\.experts\.(\d+)\.", k))})
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if experts:
                out[f"{p}.switch_mlp.{proj}.weight"] = mx.stack(
                    [out.pop(f"{p}.experts.{e}.{proj}.weight") for e in experts])
    return out


def deepseek_weights(raw: dict[str, mx.array], first: int, target: MlxLmModel,
                     zero_centred: bool = False) -> dict[str, mx.array]:
    """`model.layers.{first}.*` -> the stack's names, its decoder layer's through the
    target's own sanitizer (experts stacked, FP8 expanded, MLA's kv_b split) under the
    name of the target's last layer. `zero_centred`: the checkpoint stores every norm as
    w - 1 (Step 3.5's), which the target's sanitizer shifts only when it sees the whole
    model's tensors: shifted here. Step 3.5 names its shared head's projection `output`."""
    own = {"enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens", "final_layernorm"}
    prefix = f"model.layers.{first}."

    def named():
        for k, v in raw.items():
            name = k[len(prefix):].replace("shared_head.output.", "shared_head.head.")
            if zero_centred and "norm" in name and name.endswith(".weight"):
                v = v + 1.0
            yield name, v
    return _own_and_layer(named(), own, target, f"model.layers.{first - 1}.")


def _own_and_layer(named: Any, own: set[str], target: MlxLmModel, last: str) -> dict[str, mx.array]:
    """The head's own tensors (those whose first name part is in `own`) as named, and its decoder
    layer's through the target's sanitizer under the target layer prefix `last`, as `layers.0.*`."""
    out, layer = {}, {}
    for name, v in named:
        if name.split(".")[0] in own:
            out[name] = v
        else:
            layer[last + name] = v
    for k, v in target.sanitize(layer).items():
        if k.startswith(last):
            out["layers.0." + k[len(last):]] = v
    return out


def longcat_weights(raw: dict[str, mx.array], n_layers: int, target: MlxLmModel) -> dict[str, mx.array]:
    """LongCat-Flash's `model.mtp.*` -> the stack's names (the names vLLM's reader maps):
    `layers.0.{eh_proj, enorm.m, hnorm.m}` and `norm` are the stack's own, the block's
    latent attention goes through the target's sanitizer (its `kv_b_proj` split) as the
    first attention of the target's last layer, `transformer_layer.mlp` is the block's MLP."""
    own = {"layers.0.eh_proj.": "eh_proj.", "layers.0.enorm.m.": "enorm.", "layers.0.hnorm.m.": "hnorm.",
           "norm.": "final_layernorm.", "embed_tokens.": "embed_tokens."}
    attn = f"model.layers.{n_layers - 1}.self_attn.0."
    out, layer = {}, {}
    for k, v in raw.items():
        name = k[len("model.mtp."):]
        mapped = next((new + name[len(old):] for old, new in own.items() if name.startswith(old)), None)
        if mapped is not None:
            out[mapped] = v
        elif name.startswith("layers.0.self_attn."):
            layer[attn + name[len("layers.0.self_attn."):]] = v
        elif name.startswith("layers.0.transformer_layer.mlp."):
            out["layers.0.mlp." + name[len("layers.0.transformer_layer.mlp."):]] = v
        elif name.startswith("layers.0."):  # its norms
            out[name] = v
    for k, v in target.sanitize(layer).items():
        if k.startswith(attn):
            out["layers.0.self_attn." + k[len(attn):]] = v
    return out


def mimo_v2_weights(raw: dict[str, mx.array], target: MlxLmModel) -> dict[str, mx.array]:
    """MiMo-V2-Flash's first MTP layer (`model.mtp.layers.0.*`) -> the stack's names: its
    norms and projection, its block (`pre_mlp_layernorm` is mlx-lm's `post_attention_layernorm`)
    through the target's own sanitizer (FP8 expanded) under the name of the target's last layer.
    MiMo-V2-Pro's fused `qkv_proj` (chunked by key/value head) is refused."""
    if any(".qkv_proj." in k for k in raw):
        raise ValueError("its MTP layer keeps a fused qkv_proj (MiMo-V2-Pro's layout), which is not read here")
    named = ((k[len("model.mtp.layers.0."):].replace("pre_mlp_layernorm.", "post_attention_layernorm."), v)
             for k, v in raw.items())
    return _own_and_layer(named, {"enorm", "hnorm", "eh_proj", "final_layernorm"}, target,
                          f"model.layers.{len(target.decoder_layers) - 1}.")


# ERNIE 4.5's MTP tensors (`model.mtp_{part}.{depth}`, as transformers' MTP conversion reads
# them): each part's name in the stack; its post-norm is the model's final norm.
ERNIE_PARTS = {"model.mtp_emb_norm.0.": "enorm.", "model.mtp_hidden_norm.0.": "hnorm.",
               "model.mtp_linear_proj.0.": "eh_proj.", "model.norm.": "shared_head.norm."}


def ernie_weights(raw: dict[str, mx.array], target: MlxLmModel) -> dict[str, mx.array]:
    """ERNIE 4.5's first MTP layer -> the stack's names: its norms and projection, the model's
    final norm as the head's, its decoder block (`model.mtp_block.0.*`) through the target's
    own sanitizer (experts stacked) under the name of the target's last layer."""
    last = f"model.layers.{len(target.decoder_layers) - 1}."
    out, layer = {}, {}
    for k, v in raw.items():
        part = next((p for p in ERNIE_PARTS if k.startswith(p)), None)
        if part is not None:
            out[ERNIE_PARTS[part] + k[len(part):]] = v
        elif k.startswith("model.mtp_block.0."):
            layer[last + k[len("model.mtp_block.0."):]] = v
    for k, v in target.sanitize(layer).items():
        if k.startswith(last):
            out["layers.0." + k[len(last):]] = v
    return out


# Families whose checkpoints store norms zero-centred (w - 1) and whose MTP layers are read
# apart from the model (their sanitizer decides from the whole model's tensors).
ZERO_CENTRED_NORMS = ("step3p5",)


def nemotron_weights(raw: dict[str, mx.array], blocks: int, target: MlxLmModel) -> dict[str, mx.array]:
    """`mtp.layers.{i}.*` -> the stack's names: the input projection and its norms off the
    first block, the final norm off the last, the blocks' own through the target's sanitizer
    (experts stacked) under the target's names."""
    own = {"eh_proj", "enorm", "hnorm", "final_layernorm"}
    out, layer = {}, {}
    for k, v in raw.items():
        i, name = k[len("mtp.layers."):].split(".", 1)
        if name.split(".")[0] in own:
            out[name] = v
        else:
            layer[f"backbone.layers.{i}.{name}"] = v
    for k, v in target.sanitize(layer).items():
        if k.startswith("backbone.layers.") and int(k.split(".")[2]) < blocks:
            out["layers." + k[len("backbone.layers."):]] = v
    return out


def quantize_like(head: nn.Module, config: dict[str, Any], names: dict[str, mx.array]) -> None:
    """Quantize the head's layers whose weights come quantized (an MLX conversion that
    kept them), with the checkpoint's settings (per-layer overrides included)."""
    if not any(k.endswith(".scales") for k in names):
        return
    quant = config.get("quantization") or config.get("quantization_config") or {}
    if "bits" not in quant:
        raise ValueError("the MTP weights are quantized but the config names no quantization settings")

    def predicate(path: str, module: nn.Module) -> Any:
        if f"{path}.scales" not in names:
            return False
        override = quant.get(path) or quant.get(path.replace("model.", "mtp.", 1))
        group = override["group_size"] if isinstance(override, dict) else quant.get("group_size", 64)
        # The width tells the bits (packed uint32 columns over the groups): a GGUF block's layers
        # may mix them, and their names are not the ones the config's overrides use.
        packed, groups = names[f"{path}.weight"].shape[-1], names[f"{path}.scales"].shape[-1]
        return {"group_size": group, "bits": packed * 32 // (groups * group)}

    nn.quantize(head, group_size=quant.get("group_size", 64), bits=quant["bits"], mode=quant.get("mode", "affine"),
                class_predicate=predicate)
