"""Gemma 4's assistant drafter (`gemma4_assistant`, `gemma4_unified_assistant`: the MTP
"assistant" checkpoints published beside Gemma 4), run with mlx-vlm's own classes.

The assistant has no K/V of its own: each of its layers attends, with its own queries,
over the K/V of the target's last layer of the same type (full attention or sliding
window). Its input is [target embedding of the last token x embed_scale, the target's
final (normed) hidden state that predicted it], projected down (`pre_projection`); its
output is projected back up (`post_projection`) to feed the next draft, at the same
position (the last position with K/V), and scored by its tied embedding (or its
centroid-routed `masked_embedding`). Here each layer's attention runs over the target's
paged pool through the same dispatcher mlx-lm's layers use (`paged_layers.paged_call`),
so the drafts of every speculating sequence are one batched forward per draft.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import mlx.core as mx

from macinfer.kv.attention import AttentionMetadata
from macinfer.kv.spec import SlidingWindow
from macinfer.models.paged_layers import Forward, _patch_sdpa, set_active

ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # layer type -> a sliding window's


def is_assistant(path: str) -> bool:
    """Whether `path` holds a Gemma 4 assistant drafter checkpoint."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type") in ASSISTANT_TYPES
    except (OSError, ValueError):
        return False


class AssistantHead:
    """The assistant bound to a target on the paged engine: `step` is one draft for a batch
    of rows, reading the target's caches `caches` (layer type -> the target's cache index)."""

    def __init__(self, drafter: Any, embed: Any, embed_scale: float, caches: dict[str, int]):
        self.drafter, self.embed, self.embed_scale, self.caches = drafter, embed, embed_scale, caches
        weight = drafter.model.embed_tokens
        masked = drafter.masked_embedding
        self.head = (lambda h: masked(h, weight.weight)) if masked is not None else \
            weight.as_linear if drafter.config.tie_word_embeddings else drafter.lm_head

    def step(self, tokens: mx.array, hidden: mx.array, meta: AttentionMetadata,
             positions: mx.array) -> tuple[mx.array, mx.array]:
        """One draft: `tokens` [T] (each row's last token), `hidden` [T, target hidden] (the
        state that predicted it, or the previous draft's projected output), rows at
        `positions` [T] attending over the target's K/V in `meta`. Returns (the next hidden
        [T, target hidden], logits [T, vocab])."""
        d = self.drafter
        e = self.embed(tokens) * self.embed_scale
        x = mx.concatenate([e, hidden.astype(e.dtype)], axis=-1)
        h = d.pre_projection(x[:, None, :])
        f = Forward(meta=meta, positions=positions)
        # Stand-ins for the target's K/V: the dispatcher reads the cache they name from the pool.
        for index in set(self.caches.values()):
            marker = mx.zeros((1,))
            f.fetched[id(marker)], f.handed[index] = index, (marker, marker)
        set_active(f)
        try:
            for layer in d.model.layers:
                kv = f.handed[self.caches[layer.layer_type]]
                h, _, _ = layer(h, mask=None, cache=None, per_layer_input=None, shared_kv=kv, offset=positions)
        finally:
            set_active(None)
        if f.problems:
            raise RuntimeError(f"Gemma 4 assistant: {f.problems[0]}")
        h = d.model.norm(h)
        return d.post_projection(h)[:, 0], self.head(h)[:, 0]


def load_assistant(path: str, target: Any, layer_specs: list, layer_caches: list[int]) -> AssistantHead:
    """The assistant at `path` bound to `target` (the engine's model); a ValueError with the
    reason when it cannot draft for it."""
    from mlx_vlm.speculative.drafters import load_drafter

    try:
        drafter, _ = load_drafter(path, kind="mtp")
    except Exception as e:  # noqa: BLE001 - mlx-vlm's own loading error is the reason
        raise ValueError(f"draft model {path}: mlx-vlm could not load this Gemma 4 assistant ({e})") from None
    cfg, text = drafter.config, drafter.config.text_config
    caches = {}
    for kind, sliding in LAYER_TYPES.items():  # the target's last layer of each type: its cache
        mine = [c for c in layer_caches if isinstance(layer_specs[c].kind, SlidingWindow) == sliding]
        if mine:
            caches[kind] = mine[-1]
    for layer in drafter.model.layers:
        t = layer.layer_type
        if t not in caches:
            raise ValueError(f"draft model {path}: its layer {layer.layer_idx} reads the target's last "
                             f"{t.replace('_', ' ')} layer, which this target does not have")
        spec, attn = layer_specs[caches[t]], layer.self_attn
        if (spec.head_dim, spec.v_head_dim) != (attn.head_dim, attn.head_dim) or attn.n_heads % spec.num_kv_heads:
            raise ValueError(f"draft model {path}: its {t.replace('_', ' ')} layers take K/V of {attn.head_dim} "
                             f"values a head; the target's are {spec.head_dim}, {spec.num_kv_heads} heads")
        if LAYER_TYPES[t] and spec.kind.window != text.sliding_window:
            raise ValueError(f"draft model {path}: its sliding window is {text.sliding_window}, the target's "
                             f"{spec.kind.window}")
    embed = target.embed_module() if hasattr(target, "embed_module") else None
    if embed is None:
        raise ValueError(f"draft model {path}: the target takes no token embeddings a drafter could read")
    width = embed(mx.array([0])).shape[-1]  # the target's hidden size
    if cfg.backbone_hidden_size != width:
        raise ValueError(f"draft model {path}: a Gemma 4 assistant for a model of hidden size "
                         f"{cfg.backbone_hidden_size}; this target's is {width} (use the assistant published "
                         "for this target)")
    if text.vocab_size != target.args.vocab_size:
        raise ValueError(f"draft model {path}: its vocabulary has {text.vocab_size} tokens, the target's "
                         f"{target.args.vocab_size}")
    _patch_sdpa(importlib.import_module("mlx_vlm.models.gemma4.language"))
    return AssistantHead(drafter, embed, target.embed_scale(), caches)
