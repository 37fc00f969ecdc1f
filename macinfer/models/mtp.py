"""Multi-token prediction (MTP) heads that checkpoints ship beside their model: one more
decoder layer that reads the target's last hidden state and the next token's embedding
and predicts the token after it (Qwen3.5/3.6 and Qwen3-Next: `mtp.*`; DeepSeek V3, Kimi K2
and GLM-4.5/4.7/5: `model.layers.{num_hidden_layers}.*`, or in a GGUF file the `blk.N` block
llama.cpp's converter keeps). mlx-lm drops these weights at load;
here they are read from the checkpoint's own files and built with the target's own
decoder-layer class (mlx-lm's), so the head runs on the paged engine like any model
(`MlxLmModel`): `engine/mtp_drafter.py` feeds it the target's hidden rows.

The layouts, the published ones (transformers / vLLM):
- "qwen": h = fc([norm_e(embed(t)), norm_h(H)]); the layers; out = norm(h); logits =
  the target's head(out); the next draft reads out. Norms are stored zero-centred (1 + w).
  Mellum (JetBrains, `mtp.*` as transformers' MTP conversion reads it) and K-EXAONE
  (EXAONE-MoE, as vLLM reads it) have this layout with plain norms (w, not 1 + w) and their
  layer of `mtp_layer_types` (Mellum's sliding by default); K-EXAONE's layer is dense (its
  MLP the model's dense one, whatever the model's last layer is).
- "deepseek": h = eh_proj([enorm(embed(t)), hnorm(H)]); the layer; out = h; logits =
  shared_head.head(shared_head.norm(out)) (the target's head where the checkpoint has
  none); the next draft reads out. A checkpoint with several such layers (one per
  prediction depth) runs its first for every draft.
- "mimo" (MiMo, `model.mtp_layers.*`): h = input_proj([hidden_layernorm(H),
  token_layernorm(embed(t))]) (the hidden state first); the layer; out =
  final_layernorm(h); logits = the target's head(out). MiMo trained its head for one
  step; later drafts read out as the others do.
- "longcat" (LongCat-Flash, `model.mtp.*`, one layer whatever the config says, as vLLM
  reads it): h = eh_proj([enorm(embed(t)), hnorm(H)]); one DeepSeek-V2-style block (latent
  attention, a dense MLP: mlx-lm's LongCat attention and MLP classes, where the model's own
  layers are pairs); out = final norm(h); logits = the target's head(out). The head's own
  copy of the embedding is used where the checkpoint keeps one.
- "ernie" (ERNIE 4.5 MoE, `model.mtp_{block,emb_norm,hidden_norm,linear_proj}.0.*`, the names
  transformers' MTP conversion reads): as "deepseek", its block built as the model's layer 0
  (dense or MoE by the model's rule, as transformers builds it), its post-norm the model's
  final norm, logits the target's head; the next draft reads out.
- "bailing" (Bailing MoE v2.5 / Ling 2.5, mlx-lm's `bailing_hybrid`, `model.layers.{N}.*` as vLLM
  reads it): h = eh_proj([enorm(embed(t)), hnorm(H)]), the token's embedding zeroed at
  position 0; the layer (the target's class as layer N: latent attention, MoE); out =
  final_layernorm(h); logits = the target's head(out).
- "mimo_v2" (MiMo-V2-Flash, `model.mtp.layers.{k}.*` as vLLM reads it, its first layer for
  every draft): h = eh_proj([enorm(embed(t)), hnorm(H)]); one sliding-window layer of the
  target's class with a dense MLP (its norm before the MLP named `pre_mlp_layernorm`); out =
  final_layernorm(h); logits = the target's head(out). MiMo-V2-Pro's fused `qkv_proj` is refused.
- "nemotron" (Nemotron-H, `mtp.layers.*`): h = eh_proj([enorm(embed(t)), hnorm(H)]) (kept
  on its first block); its blocks in `mtp_hybrid_override_pattern` (attention "*", MoE "E":
  the target's block class); out = final_layernorm(h) (on its last block); logits = the
  target's head(out).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from macinfer.models.mlx_lm_adapter import MlxLmModel
from macinfer.models.mlx_lm_classes import text_config
from macinfer.models.mtp_checkpoint import (ERNIE_PARTS, SPLIT_DRAFTERS, ZERO_CENTRED_NORMS, checkpoint_tensors,
                                            declared_layers, deepseek_weights, ernie_weights, longcat_weights,
                                            mimo_v2_weights, nemotron_weights, quantize_like, qwen_weights,
                                            split_drafter)
from macinfer.models.mtp_modules import MLABlock, MTPHead, MTPStack, SharedHead


@dataclass(frozen=True)
class MTPLayout:
    style: str  # "qwen" | "deepseek" | "mimo" | "nemotron" | "ernie" | "longcat" | "bailing" | "mimo_v2"
    depth: int  # layers the checkpoint declares


QWEN = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "mellum", "exaone_moe")
# Qwen's layout (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`) with plain norms and a layer of
# `mtp_layer_types`: its default kind (None: the config must say), and whether it is dense.
PLAIN_QWEN = {"mellum": ("sliding_attention", False), "exaone_moe": (None, True)}
DEEPSEEK = ("deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "step3p5")
MIMO = ("mimo",)
NEMOTRON = ("nemotron_h",)
ERNIE = ("ernie4_5_moe",)
LONGCAT = ("longcat_flash",)
BAILING = ("bailing_hybrid",)
MIMO_V2 = ("mimo_v2_flash",)


def _style(config: dict[str, Any]) -> str | None:
    """The family's MTP head layout, whatever its config declares (None: none macinfer runs)."""
    model_type = config.get("model_type")
    text_type = text_config(config).get("model_type", model_type)
    for style, family, either in (("longcat", LONGCAT, False), ("mimo_v2", MIMO_V2, False), ("qwen", QWEN, True),
                                  ("deepseek", DEEPSEEK, True), ("mimo", MIMO, False), ("nemotron", NEMOTRON, False),
                                  ("ernie", ERNIE, False), ("bailing", BAILING, False)):
        if model_type in family or (either and text_type in family):
            return style
    return None


def layout(config: dict[str, Any]) -> MTPLayout:
    """The checkpoint's MTP layout; a ValueError with the reason when it has none macinfer runs."""
    model_type, style, depth = config.get("model_type"), _style(config), declared_layers(config)
    if style in ("longcat", "mimo_v2"):  # (their configs declare none or several; one layer drafts, as vLLM's)
        return MTPLayout(style, 1)
    if depth <= 0:
        raise ValueError(f"{model_type}: its config declares no multi-token-prediction layers "
                         "(mtp_num_hidden_layers / num_nextn_predict_layers): this model ships no MTP head; use "
                         "--draft-model or prompt lookup")
    if style is None:
        known = ", ".join(QWEN + DEEPSEEK + MIMO + NEMOTRON + ERNIE + LONGCAT + BAILING + MIMO_V2)
        raise ValueError(f"{model_type}: its config declares {depth} MTP layer(s), but macinfer runs MTP heads of "
                         f"{known} only (this family's head layout is not verified here)")
    return MTPLayout(style, depth)


@contextmanager
def hidden_rows(model: MlxLmModel, hidden: mx.array | None) -> Iterator[None]:
    """Run `model` (an MTP head) with `hidden` [T, D] as the target rows of its next call."""
    stack = model.lm.model
    object.__setattr__(stack, "given", None if hidden is None else hidden[:, None, :])
    try:
        yield
    finally:
        object.__setattr__(stack, "given", None)


def _gguf_block(path: str, config: dict[str, Any], target: MlxLmModel, first: int,
                read_block: Any) -> dict[str, mx.array]:
    """The MTP block llama.cpp's converter keeps as `blk.{first}` (its layer's tensors and
    `nextn.eh_proj/enorm/hnorm/shared_head_*`), in the checkpoint's names
    (`model.layers.{first}.*`, the layer's already in mlx-lm's form), read by the GGUF
    loader's `read_block`."""
    tcfg = text_config(config)
    dims, eps = int(tcfg["hidden_size"]), float(tcfg.get("rms_norm_eps") or tcfg.get("layernorm_epsilon") or 1e-6)

    def names_for(in_file: set[str]) -> nn.Module:
        block = _layer_like(target.decoder_layers[-1], target.text_model.args, first)
        block.eh_proj = nn.Linear(2 * dims, dims, bias=False)
        block.enorm, block.hnorm = nn.RMSNorm(dims, eps=eps), nn.RMSNorm(dims, eps=eps)
        own_head = f"blk.{first}.nextn.shared_head_head.weight" in in_file
        block.shared_head = SharedHead(dims, eps, int(tcfg["vocab_size"]) if own_head else None)
        names = nn.Module()  # parameters named model.layers.{first}.*: what the file's block maps onto
        names.model = nn.Module()
        names.model.layers = [nn.Module() for _ in range(first)] + [block]
        return names

    try:
        return read_block(path, first, names_for, config)
    except Exception as e:  # noqa: BLE001 - a block the tensor map cannot place: the reason
        raise ValueError(f"the GGUF file's MTP block {first} cannot be read ({e})") from None


def _cache_of(owner: Any, index: int, pick: Any) -> Any:
    """A fresh cache of the kind the target keeps for layer `index` (`pick`: the part a layer uses)."""
    return pick(owner()[index])


def _layer_like(layer: nn.Module, args: Any, index: int, mtp_type: str = "sliding_attention",
                dense: bool = False) -> nn.Module:
    """A new decoder layer of `layer`'s class, built as layer `index` where the class takes one.
    Per-layer lists in the config that stop at the decoder's layers (Step 3.5's `layer_types`)
    go on as the MTP layers are published: `mtp_type`, sliding-window attention unless the
    config says (Mellum's `mtp_layer_types`); `dense`: not an MoE layer (K-EXAONE's `is_moe_layer`)."""
    import dataclasses
    import inspect

    cls = type(layer)
    takes = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    if len(takes) > 1 and dataclasses.is_dataclass(args):
        for name, value in (("layer_types", mtp_type), ("is_moe_layer", False if dense else None)):
            have = getattr(args, name, None)
            if value is not None and isinstance(have, list) and index >= len(have):
                args = dataclasses.replace(args, **{name: have + [value] * (index + 1 - len(have))})
    return cls(args, index) if len(takes) > 1 else cls(args)


def _split_source(source: str, config: dict[str, Any]) -> tuple[MTPLayout, dict[str, mx.array], dict[str, Any]]:
    """(layout, the head's tensors under the checkpoint's own names, the drafter's config) of an
    mlx-vlm split MTP drafter folder for a target of `config`; a ValueError with the reason."""
    import json

    kind = split_drafter(source)
    if kind not in SPLIT_DRAFTERS:
        raise ValueError(f"draft model {source}: mlx-vlm's {kind} drafter folder; macinfer reads the split MTP "
                         f"drafters of {', '.join(SPLIT_DRAFTERS)} only")
    with open(os.path.join(source, "config.json")) as f:
        drafter = json.load(f)
    style, name = SPLIT_DRAFTERS[kind]
    theirs, ours = text_config(drafter), text_config(config)
    if _style(config) != style:  # (the target's config may declare no head: its files dropped it)
        raise ValueError(f"draft model {source}: a {kind} drafter drafts for its own family's targets, "
                         f"not {config.get('model_type')}")
    odd = [k for k in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads")
           if theirs.get(k) is not None and theirs.get(k) != ours.get(k)]
    if odd:
        raise ValueError(f"draft model {source}: split from another model ({', '.join(odd)} differ from the target's)")
    n = int(ours.get("num_hidden_layers") or 0)
    tensors, _ = checkpoint_tensors(source, lambda k: True)
    keep = style != "qwen"  # (Qwen's head reads the target's embedding and head: its folder's copies are unused)
    raw = {name(k, n): v for k, v in tensors.items() if keep or not k.startswith(("embed_tokens.", "lm_head."))}
    return MTPLayout(style, declared_layers(drafter) or 1), raw, drafter


def load_mtp(target: Any, finish: Any = None, read_block: Any = None, source: str | None = None) -> MlxLmModel:
    """`target`'s (LoadedModel) MTP head, its weights read from the checkpoint (or from
    `source`, an mlx-vlm split MTP drafter folder: `--draft-model`); a ValueError with the
    reason when it has none macinfer runs. `finish(head)` runs once its weights are in (the
    loader's dequantization); `read_block` reads a GGUF file's block
    (`macinfer.gguf.load.read_block`, for a GGUF target)."""
    config, model = target.config, target.model
    split = _split_source(source, config) if source is not None else None
    lay = split[0] if split else layout(config)
    if not isinstance(model, MlxLmModel):
        raise ValueError(f"{config.get('model_type')}: MTP heads run on models served through mlx-lm's classes")
    gguf_file = not os.path.isdir(target.source) and not split
    if gguf_file and read_block is None:
        raise ValueError(f"{target.name}: a GGUF target's MTP head needs the GGUF block reader")
    if gguf_file and lay.style != "deepseek":
        raise ValueError(f"{target.name}: in GGUF, llama.cpp's tensor map names the MTP block (`nextn.*`) of "
                         "DeepSeek-style heads only (GLM-4.5/4.6/4.7, GLM-5); this file's is not read")
    tcfg = text_config(config)
    n_layers = int(tcfg.get("num_hidden_layers") or tcfg["num_layers"])  # (LongCat's name for it)
    if split:  # (written by MLX: norms shifted, experts stacked)
        raw, mlx_format = split[1], True
    elif gguf_file:
        raw, mlx_format = _gguf_block(target.source, config, model, n_layers, read_block), True
    elif lay.style == "qwen":
        raw, mlx_format = checkpoint_tensors(target.source, lambda k: k.startswith("mtp."))
    elif lay.style == "mimo":
        raw, mlx_format = checkpoint_tensors(target.source, lambda k: k.startswith("model.mtp_layers.0."))
    elif lay.style == "nemotron":
        raw, mlx_format = checkpoint_tensors(target.source, lambda k: k.startswith("mtp."))
    elif lay.style == "longcat":
        raw, mlx_format = checkpoint_tensors(target.source, lambda k: k.startswith("model.mtp."))
    elif lay.style == "mimo_v2":
        raw, mlx_format = checkpoint_tensors(target.source, lambda k: k.startswith("model.mtp.layers.0."))
    elif lay.style == "ernie":
        raw, mlx_format = checkpoint_tensors(target.source, lambda k: k.startswith(tuple(ERNIE_PARTS)) or
                                             k.startswith("model.mtp_block.0."))
        if not any(k.startswith("model.mtp_") for k in raw):
            raw = {}  # (the model's final norm alone: no head)
    else:
        raw, mlx_format = checkpoint_tensors(target.source, lambda k: k.startswith(f"model.layers.{n_layers}."))
    if not raw:
        raise ValueError(f"{target.name}: its config declares {lay.depth} MTP layer(s) but its files hold no MTP "
                         "weights (mlx-lm's conversions drop them): serve the original checkpoint")
    text = model.text_model
    args = text.args
    layers = model.decoder_layers
    dims, eps = int(tcfg["hidden_size"]), float(tcfg.get("rms_norm_eps") or tcfg.get("layernorm_epsilon") or 1e-6)
    target_caches = None
    if lay.style == "qwen" and config.get("model_type") in PLAIN_QWEN:
        # Its layer is of `mtp_layer_types`, its norms plain; its cache is a target layer's of
        # that type, or a sliding one of the config's window.
        default, dense = PLAIN_QWEN[config["model_type"]]
        kind = (tcfg.get("mtp_layer_types") or [default])[0]
        if kind not in ("sliding_attention", "full_attention") or lay.depth != 1:
            raise ValueError(f"{target.name}: its MTP head runs one layer of sliding or full attention as "
                             f"`mtp_layer_types` says (this config: {tcfg.get('mtp_layer_types')}, "
                             f"{lay.depth} layer(s))")
        mtp_layers = [_layer_like(layers[-1], args, n_layers, kind, dense)]
        same = [i for i, t in enumerate(tcfg.get("layer_types") or []) if t == kind]
        copied = same[0] if same else None
        if copied is None and kind == "sliding_attention":
            from mlx_lm.models.cache import RotatingKVCache

            target_caches = partial(RotatingKVCache, max_size=int(tcfg["sliding_window"]))
        weights = qwen_weights(raw, lay.depth, mlx_format=True)
        shared = None
    elif lay.style == "qwen":
        # A full-attention layer of the target's class (Gated DeltaNet layers have none).
        full = max(i for i, layer in enumerate(layers) if not getattr(layer, "is_linear", False))
        mtp_layers = [type(layers[full])(args, full) for _ in range(lay.depth)]
        copied = full
        weights = qwen_weights(raw, lay.depth, mlx_format)
        shared = None
    elif lay.style == "mimo":
        mtp_layers, copied = [_layer_like(layers[-1], args, n_layers)], -1
        own = ("input_proj.", "token_layernorm.", "hidden_layernorm.", "final_layernorm.")
        weights = {}
        for k, v in raw.items():
            name = k[len("model.mtp_layers.0."):]
            weights[name if name.startswith(own) else f"layers.0.{name}"] = v
        weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
        shared = None
    elif lay.style == "nemotron":
        pattern = list(tcfg.get("mtp_hybrid_override_pattern") or "")
        if not pattern or any(t not in "*E-" for t in pattern):
            raise ValueError(f"{target.name}: a Nemotron-H MTP head needs its block pattern "
                             "(mtp_hybrid_override_pattern: attention, MLP and MoE blocks)")
        mtp_layers, copied = [type(layers[0])(args, t) for t in pattern], -1
        weights = nemotron_weights(raw, len(pattern), model)
        shared = None
    elif lay.style == "ernie":
        mtp_layers, copied = [_layer_like(layers[0], args, 0)], 0
        weights = ernie_weights(raw, model)
        shared = SharedHead(dims, eps, None)
    elif lay.style == "mimo_v2":  # a sliding-window layer (the target's first such), its MLP dense
        copied = next(i for i, layer in enumerate(layers) if layer.is_sliding_window)
        mtp_layers = [type(layers[copied])(args, False, True)]
        weights = mimo_v2_weights(raw, model)
        shared = None
    elif lay.style == "longcat":
        last = layers[-1]
        mtp_layers, copied = [MLABlock(type(last.self_attn[0])(args), type(last.mlps[0])(args), dims, eps)], -1
        weights = longcat_weights(raw, n_layers, model)
        shared = None
    else:
        try:
            mtp_layers, copied = [_layer_like(layers[-1], args, n_layers)], -1
        except (IndexError, KeyError, TypeError) as e:  # a per-layer config list that stops short
            raise ValueError(f"{target.name}: its MTP layer cannot be built as layer {n_layers} ({e!r})") from None
        weights = deepseek_weights(raw, n_layers, model, zero_centred=config.get("model_type") in ZERO_CENTRED_NORMS
                                   and not mlx_format)
        if lay.style == "bailing":  # its final norm, then the target's head (vLLM loads lm_head into its own)
            weights = {k: v for k, v in weights.items() if not k.startswith("shared_head.")}
            shared = None
        else:
            has_head = any(k.startswith("shared_head.head.") for k in weights)
            shared = SharedHead(dims, eps, int(tcfg["vocab_size"]) if has_head else None)
    own_embed = None
    if lay.style == "longcat" and "embed_tokens.weight" in weights:  # (a copy of its own, trained with it)
        own_embed = nn.Embedding(*weights["embed_tokens.weight"].shape)
    else:
        weights = {k: v for k, v in weights.items() if not k.startswith("embed_tokens.")}  # the target's is the same
    embed = model.embed_module()
    if embed is None:
        raise ValueError(f"{config.get('model_type')}: the MTP head needs the target's token embedding")
    stack = MTPStack(lay.style, mtp_layers, dims, eps, embed, own_embed)
    owner = getattr(text, "make_cache", None)
    pick = (lambda c: c[0]) if lay.style == "longcat" else (lambda c: c)  # (LongCat's layers: a cache a pair)
    if target_caches is None and owner is not None and copied is not None:
        target_caches = partial(_cache_of, owner, copied, pick)
    head = MTPHead(stack, args, model.logits, shared, target_caches)
    names = {f"model.{k}" if not k.startswith("shared_head.") else k: v for k, v in weights.items()}
    quantize_like(head, split[2] if split else config, names)
    try:
        head.load_weights(list(names.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{target.name}: its MTP weights do not fit the {lay.style}-style head ({e})") from None
    if finish is not None:  # the loader's treatment of the target's modules (float32 on the CPU backend)
        finish(head)
    mx.eval(head.parameters())
    head.eval()
    cfg = {**tcfg, "model_type": f"{config.get('model_type')}_mtp", "layer_types": None, "sliding_window": None}
    return MlxLmModel(head, cfg)
