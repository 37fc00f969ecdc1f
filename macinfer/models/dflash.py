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

DFlash2 (mlx-vlm's `DFlash2DraftModel`) adds, in each layer, a grouped causal convolution
along the block before and after its attention and its MLP (taps from the block's own rows:
none reach another sequence's block), scales the input embedding and the logits, and picks
the drafts position by position among each row's top candidates by a scorer that reads the
previous pick (`CandidateSelector`). DSpark (`DSparkDraftModel`) starts its block at the
last token, whose row gives the first draft, and adds to each position's logits a low-rank
transition row of the previous pick (`VanillaMarkov`).
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
    return kind if kind and ("dflash" in kind or "dspark" in kind) else None


class DFlashHead(nn.Module):
    """mlx-vlm's DFlash drafter as the engine's drafter model: its cache specs (one
    full-attention cache a layer, of context K/V) and the paged forward."""

    def __init__(self, draft: Any, embed: Any, vocab_size: int, max_position_embeddings: int):
        super().__init__()
        self.draft = draft
        self.embed = embed  # the target's token embedding (x its scale), not a child: not counted twice
        cfg = draft.config
        # (each layer's own K/V shape: Gemma 4's DSpark layers are its global head width, one K/V head)
        self.layer_specs = [LayerKV(FullAttention(), layer.self_attn.n_kv_heads, layer.self_attn.head_dim,
                                    layer.self_attn.head_dim) for layer in draft.layers]
        self.args = type("Args", (), {"vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings})
        self.mask_id = int(cfg.mask_token_id)
        # DFlash2: its logits' multiplier and cap, and its scorer of candidates; DSpark: its
        # token-transition correction, its block starting at the last token (its first draft
        # read from that row). Either drafts position by position (`sequential`).
        self.selector = getattr(draft, "candidate_selector", None)
        self.markov = getattr(draft, "markov_head", None)
        self.sequential = self.selector is not None or self.markov is not None
        self.from_anchor = self.markov is not None and bool(getattr(cfg, "sample_from_anchor", False))
        self.out_multiplier = float(getattr(cfg, "output_multiplier", 1.0))
        self.softcap = getattr(cfg, "final_logit_softcapping", None) if self.sequential else None
        # Gemma 4's DSpark: an embedding and an output head of its own (untied from the target's)
        self.own_head = getattr(draft, "lm_head", None) if isinstance(getattr(draft, "lm_head", None), nn.Linear) \
            else None

    def logits(self, hidden: mx.array, target_logits: Any) -> mx.array:
        """The drafter's logits of its rows: the target head's reading of them (DFlash2's scaled,
        capped), or its own head's (Gemma 4's DSpark)."""
        out = self.own_head(hidden) if self.own_head is not None else target_logits(hidden)
        out = out * self.out_multiplier if self.out_multiplier != 1.0 else out
        return mx.tanh(out / self.softcap) * self.softcap if self.softcap else out

    def select(self, hidden: mx.array, logits: mx.array, anchors: list[int], ks: list[int],
               pick: Any) -> list[int]:
        """Drafts position by position, each read by the next, for each block (its k rows of
        `hidden`/`logits` in order, after the token `anchors[b]`): `pick(scores, rows)` draws
        from full-vocabulary scores. DFlash2: each row's top candidates, scored by logit plus
        affinity to the previous pick (the others -inf); DSpark: the logits plus the previous
        pick's transition row. Drafts, blocks in order."""
        if self.selector is not None:
            sel = self.selector
            top = mx.argpartition(logits, -sel.top_k, axis=-1)[:, -sel.top_k:]
            unary = mx.take_along_axis(logits, top, axis=-1).astype(mx.float32)
            proj = sel.hidden_projection(hidden)

            def scores(at: mx.array, prev: mx.array) -> mx.array:
                edges = (sel.predecessor_codebook(prev)[:, None] * proj[at][:, None]
                         * sel.successor_codebook(top[at])).sum(-1)
                full = mx.full((at.size, logits.shape[-1]), -mx.inf, dtype=mx.float32)
                return mx.put_along_axis(full, top[at], unary[at] + edges.astype(mx.float32), axis=-1)
        else:
            def scores(at: mx.array, prev: mx.array) -> mx.array:
                return logits[at] + self.markov.markov_w2(self.markov.markov_w1(prev))
        starts = np.concatenate([[0], np.cumsum(ks)[:-1]]).astype(np.int64)
        prev = np.array(anchors, dtype=np.int64)
        out = np.zeros(int(sum(ks)), dtype=np.int64)
        for j in range(max(ks)):
            live = np.array([b for b, k in enumerate(ks) if k > j])
            chosen = pick(scores(mx.array(starts[live] + j), mx.array(prev[live], dtype=mx.int32)),
                          [int(i) for i in starts[live] + j])
            out[starts[live] + j] = prev[live] = np.array(chosen)
        return out.tolist()

    def kv_dtype(self) -> mx.Dtype:
        return self.draft.fc.weight.dtype

    def context(self, features: mx.array) -> mx.array:
        """Context rows [T, D] from the target layers' outputs concatenated [T, n x target D]."""
        return self.draft.hidden_norm(self.draft.fc(features))

    def _rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return self.draft.rope(x[:, :, None, :], offset=positions)[:, :, 0, :]  # x [T, heads, d]

    def forward(self, ctx: mx.array | None, ctx_meta: AttentionMetadata | None, embeds: mx.array | None,
                block_meta: AttentionMetadata | None, block_rows: np.ndarray,
                within: np.ndarray | None = None) -> mx.array | None:
        """Write the context rows `ctx` ([C, D], at `ctx_meta`'s positions; None: none) into
        every layer's cache, run the blocks (`embeds` [T, D] at `block_meta`'s positions,
        each block's rows reading the context and the whole block; None: none) and return
        the normed hidden of `block_rows` (the rows whose tokens are drafted). `within`: each
        block row's index in its block (DFlash2's convolutions stop at the block's start)."""
        d = self.draft
        h = embeds
        reach = None if within is None else mx.array(within)
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            if ctx_meta is not None:  # the same context row for every layer, projected by its own k/v
                k, v = attn._project_kv(ctx)
                k = self._rope(attn.k_norm(k.reshape(ctx.shape[0], attn.n_kv_heads, -1)), ctx_meta.positions)
                ctx_meta.write(i, k, v.reshape(ctx.shape[0], attn.n_kv_heads, -1))
            if block_meta is None:
                continue
            convs = getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)
            x, after = _conv_in(convs[0], layer.input_layernorm(h), reach)
            T = x.shape[0]
            q = self._rope(attn.q_norm(attn.q_proj(x).reshape(T, attn.n_heads, -1)), block_meta.positions)
            k, v = attn._project_kv(x)
            k = self._rope(attn.k_norm(k.reshape(T, attn.n_kv_heads, -1)), block_meta.positions)
            block_meta.write(i, k, v.reshape(T, attn.n_kv_heads, -1))
            o = attend(q, block_meta, i, attn.scale)
            o = _conv_out(convs[0], attn.o_proj(o.reshape(T, -1)), after, reach)
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 4's sandwich norms and layer scalar
                h = h + layer.post_attention_layernorm(o)
                h = (h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))) \
                    * layer.layer_scalar
                continue
            h = h + o
            x, after = _conv_in(convs[1], layer.post_attention_layernorm(h), reach)
            h = h + _conv_out(convs[1], layer.mlp(x), after, reach)
        return None if block_meta is None else d.norm(h[mx.array(block_rows)])


def _block_conv(x: mx.array, dynamic: mx.array, base: mx.array, group: int, reach: mx.array) -> mx.array:
    """DFlash2's grouped causal convolution of block rows `x` [T, D]: row t sums, over taps o,
    (base[o] + dynamic[t, o]) x row t - o of its own block (`reach`: each row's index in it)."""
    T, D = x.shape
    groups = D // group
    rows = x.reshape(T, groups, group)
    out = mx.zeros_like(rows)
    for o in range(base.shape[0]):
        shifted = rows if o == 0 else mx.concatenate([mx.zeros_like(rows[:o]), rows[:-o]]) * \
            (reach >= o)[:, None, None].astype(x.dtype)
        out = out + (base[o].reshape(1, groups, group).astype(x.dtype) + dynamic[:, o, :, None]) * shifted
    return out.reshape(T, D)


def _conv_in(conv: Any, x: mx.array, reach: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """The convolution before a DFlash2 sublayer (its input convolved, and the taps of the one after)."""
    if conv is None:
        return x, None
    dynamic = conv.kernel_projection(x).reshape(x.shape[0], 2, conv.kernel_size, -1)
    return _block_conv(x, dynamic[:, 0], conv.base_kernel[0], conv.group_size, reach), dynamic[:, 1]


def _conv_out(conv: Any, x: mx.array, dynamic: mx.array | None, reach: mx.array | None) -> mx.array:
    return x if conv is None else _block_conv(x, dynamic, conv.base_kernel[1], conv.group_size, reach)


def load_dflash(path: str, engine: Any) -> tuple[DFlashHead, LayerInputs]:
    """The DFlash drafter at `path` for `engine`'s target, and the recorder of the target
    layer outputs it reads; a ValueError with the reason when it cannot draft for it."""
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.speculative.drafters.dflash2 import DFlash2DraftModel
    from mlx_vlm.speculative.drafters.dspark import DSparkDraftModel
    from mlx_vlm.speculative.drafters.gemma4_dflash import Gemma4DFlashDraftModel
    from mlx_vlm.speculative.drafters.gemma4_dspark import Gemma4DSparkDraftModel
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel

    kind = dflash_type(path)
    try:
        draft, _ = load_drafter(path, kind="dflash")
    except Exception as e:  # noqa: BLE001 - mlx-vlm's own loading error is the reason
        raise ValueError(f"draft model {path}: mlx-vlm could not load this DFlash drafter ({e})") from None
    cfg = draft.config
    # (Gemma 4's DFlash drafter is DFlash's class under its own name, its mask token 4 by default)
    if type(draft) not in (DFlashDraftModel, Gemma4DFlashDraftModel, DFlash2DraftModel, DSparkDraftModel,
                           Gemma4DSparkDraftModel):
        raise ValueError(f"draft model {path}: a {kind} drafter ({type(draft).__name__}); macinfer runs the DFlash "
                         "drafters of mlx-vlm's DFlashDraftModel (z-lab's Qwen3 DFlash layout, Gemma 4's), "
                         "DFlash2DraftModel and DSparkDraftModel (Gemma 4's too) only")
    # (their logits may be capped)
    second = type(draft) in (DFlash2DraftModel, DSparkDraftModel, Gemma4DSparkDraftModel)
    odd = [what for what, on in (("causal block attention", cfg.is_causal), ("sliding layers", any(
        t != "full_attention" for t in cfg.layer_types)), ("a draft window", bool(cfg.draft_window_size)),
        ("attention sinks", cfg.attention_sink_bias),
        ("logit soft-capping", cfg.final_logit_softcapping and not second)) if on]
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
    scale = (model.embed_scale() if mlx_lm else 1.0) * float(getattr(cfg, "input_embedding_scale", 1.0))
    if type(draft) is Gemma4DSparkDraftModel:  # (its own embedding, scaled by its own width)
        embed, scale = draft.embed_tokens, draft.embed_scale
    head = DFlashHead(draft, lambda ids: embed(ids) * scale, model.args.vocab_size,
                      model.args.max_position_embeddings)
    # A layer's output is the next layer's input: those are recorded on every forward.
    return head, LayerInputs(layers, [i + 1 for i in ids])
