"""DFlash drafters (block diffusion: a whole block of drafts in one forward), run with
mlx-vlm's own classes and loader on a paged pool of their own.

A DFlash drafter reads the outputs of some of the target's layers (`target_layer_ids`) at
every target position, concatenated and projected (`fc`, `hidden_norm`) into one context
row a position; each of its layers keeps K/V of those rows (its own `k_proj`/`v_proj` of
the context row, the same row for every layer). To draft k tokens after the last token b
at position n, the block [b, mask x k] at positions n..n+k goes through its layers, each
block query attending over the context keys [0, n) and over the whole block (both ways);
the block's rows 1..k, normed, through the target's head give the k drafts at once. Here
the context K/V live in the drafter's paged pool (written as the target computes), and
the block is a prompt chunk whose queries read up to the block's end (key ceilings).
"""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macinfer.kv.attention import AttentionMetadata, attend
from macinfer.kv.spec import FullAttention, LayerKV
from macinfer.models.eagle3 import LayerInputs
from macinfer.models.mlx_lm_adapter import MlxLmModel


def dflash_type(path: str) -> str | None:
    """The mlx-vlm drafter type of a DFlash checkpoint at `path` (None: not one)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    from mlx_vlm.utils import get_model_type

    kind = get_model_type(config)
    return kind if kind and ("dflash" in kind or kind in ("dspark",)) else None


class DFlashHead(nn.Module):
    """mlx-vlm's DFlash drafter as the engine's drafter model: its cache specs (one
    full-attention cache a layer, of context K/V) and the paged forward."""

    def __init__(self, draft: Any, embed: Any, vocab_size: int, max_position_embeddings: int):
        super().__init__()
        self.draft = draft
        self.embed = embed  # the target's token embedding (x its scale), not a child: not counted twice
        cfg = draft.config
        self.layer_specs = [LayerKV(FullAttention(), cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
                            for _ in draft.layers]
        self.args = type("Args", (), {"vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings})
        self.mask_id = int(cfg.mask_token_id)

    def kv_dtype(self) -> mx.Dtype:
        return self.draft.fc.weight.dtype

    def context(self, features: mx.array) -> mx.array:
        """Context rows [T, D] from the target layers' outputs concatenated [T, n x target D]."""
        return self.draft.hidden_norm(self.draft.fc(features))

    def _rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return self.draft.rope(x[:, :, None, :], offset=positions)[:, :, 0, :]  # x [T, heads, d]

    def forward(self, ctx: mx.array | None, ctx_meta: AttentionMetadata | None, embeds: mx.array | None,
                block_meta: AttentionMetadata | None, block_rows: np.ndarray) -> mx.array | None:
        """Write the context rows `ctx` ([C, D], at `ctx_meta`'s positions; None: none) into
        every layer's cache, run the blocks (`embeds` [T, D] at `block_meta`'s positions,
        each block's rows reading the context and the whole block; None: none) and return
        the normed hidden of `block_rows` (the rows whose tokens are drafted)."""
        d = self.draft
        h = embeds
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            if ctx_meta is not None:  # the same context row for every layer, projected by its own k/v
                k, v = attn._project_kv(ctx)
                k = self._rope(attn.k_norm(k.reshape(ctx.shape[0], attn.n_kv_heads, -1)), ctx_meta.positions)
                ctx_meta.write(i, k, v.reshape(ctx.shape[0], attn.n_kv_heads, -1))
            if block_meta is None:
                continue
            x = layer.input_layernorm(h)
            T = x.shape[0]
            q = self._rope(attn.q_norm(attn.q_proj(x).reshape(T, attn.n_heads, -1)), block_meta.positions)
            k, v = attn._project_kv(x)
            k = self._rope(attn.k_norm(k.reshape(T, attn.n_kv_heads, -1)), block_meta.positions)
            block_meta.write(i, k, v.reshape(T, attn.n_kv_heads, -1))
            o = attend(q, block_meta, i, attn.scale)
            h = h + attn.o_proj(o.reshape(T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return None if block_meta is None else d.norm(h[mx.array(block_rows)])


def load_dflash(path: str, engine: Any) -> tuple[DFlashHead, LayerInputs]:
    """The DFlash drafter at `path` for `engine`'s target, and the recorder of the target
    layer outputs it reads; a ValueError with the reason when it cannot draft for it."""
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel

    kind = dflash_type(path)
    try:
        draft, _ = load_drafter(path, kind="dflash")
    except Exception as e:  # noqa: BLE001 - mlx-vlm's own loading error is the reason
        raise ValueError(f"draft model {path}: mlx-vlm could not load this DFlash drafter ({e})") from None
    cfg = draft.config
    if type(draft) is not DFlashDraftModel:
        raise ValueError(f"draft model {path}: a {kind} drafter ({type(draft).__name__}); macinfer runs the DFlash "
                         "drafters of mlx-vlm's DFlashDraftModel (z-lab's Qwen3 DFlash layout) only")
    odd = [what for what, on in (("causal block attention", cfg.is_causal), ("sliding layers", any(
        t != "full_attention" for t in cfg.layer_types)), ("a draft window", bool(cfg.draft_window_size)),
        ("attention sinks", cfg.attention_sink_bias), ("logit soft-capping", cfg.final_logit_softcapping))
        if on]
    if odd:
        raise ValueError(f"draft model {path}: a DFlash drafter with {', '.join(odd)}, which macinfer does not run "
                         "yet (full-attention, bidirectional blocks only)")
    model = engine.model
    # The target's decoder layers and token embedding (mlx-lm's classes, or macinfer's Llama file).
    mlx_lm = isinstance(model, MlxLmModel)
    layers = model.decoder_layers if mlx_lm else getattr(model, "layers", None)
    embed = model.embed_module() if mlx_lm else getattr(getattr(model, "model", None), "embed_tokens", None)
    if layers is None or embed is None:
        raise ValueError(f"draft model {path}: the target's decoder layers and token embedding are not reachable "
                         "(a DFlash drafter reads them)")
    ids = [int(i) for i in cfg.target_layer_ids]
    n = len(layers)
    if cfg.num_target_layers != n or any(not 0 <= i < n - 1 for i in ids):
        raise ValueError(f"draft model {path}: trained on a target of {cfg.num_target_layers} layers reading "
                         f"layers {ids}; this target has {n}")
    width = embed(mx.array([0])).shape[-1]
    if cfg.hidden_size != width or draft.fc.weight.shape[1] != len(ids) * width:
        raise ValueError(f"draft model {path}: built for a target of hidden size {cfg.hidden_size}; this one's is "
                         f"{width}")
    if cfg.vocab_size != model.args.vocab_size or not 0 <= cfg.mask_token_id < model.args.vocab_size:
        raise ValueError(f"draft model {path}: its vocabulary ({cfg.vocab_size}, mask token {cfg.mask_token_id}) is "
                         f"not the target's ({model.args.vocab_size})")
    scale = model.embed_scale() if mlx_lm else 1.0
    head = DFlashHead(draft, lambda ids: embed(ids) * scale, model.args.vocab_size,
                      model.args.max_position_embeddings)
    # A layer's output is the next layer's input: those are recorded on every forward.
    return head, LayerInputs(layers, [i + 1 for i in ids])
