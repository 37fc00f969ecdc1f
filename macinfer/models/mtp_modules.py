"""The MTP head's modules (`models/mtp.py` reads the checkpoint and builds them): the stack
that turns a token and the target's hidden row into the next hidden row by the family's
formula, and the head around it (its cache, its logits through the target's head or a
shared head of its own)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.models.paged_layers import _active


# The eh_proj-style heads whose output is normed by a final norm of their own before the target's head.
FINAL_NORMED = ("nemotron", "longcat", "bailing", "mimo_v2")


class MTPStack(nn.Module):
    """The head's inner model, mlx-lm-shaped: `(ids [T, 1], cache) -> hidden [T, 1, D]`,
    reading the target's hidden rows for the same tokens from `given` (set per call by
    `hidden_rows`; zeros when unset, as in the load-time probe)."""

    def __init__(self, style: str, layers: list[nn.Module], dims: int, eps: float, embed: nn.Module,
                 own_embed: nn.Module | None = None):
        super().__init__()
        self.style = style
        if own_embed is not None:  # the head's own copy (LongCat's `model.mtp.embed_tokens`)
            self.embed_tokens = own_embed
        if style == "qwen":
            self.fc = nn.Linear(2 * dims, dims, bias=False)
            self.pre_fc_norm_embedding = nn.RMSNorm(dims, eps=eps)
            self.pre_fc_norm_hidden = nn.RMSNorm(dims, eps=eps)
            self.norm = nn.RMSNorm(dims, eps=eps)
        elif style == "mimo":
            self.input_proj = nn.Linear(2 * dims, dims, bias=False)
            self.token_layernorm = nn.RMSNorm(dims, eps=eps)
            self.hidden_layernorm = nn.RMSNorm(dims, eps=eps)
            self.final_layernorm = nn.RMSNorm(dims, eps=eps)
        else:
            self.eh_proj = nn.Linear(2 * dims, dims, bias=False)
            self.enorm = nn.RMSNorm(dims, eps=eps)
            self.hnorm = nn.RMSNorm(dims, eps=eps)
            if style in FINAL_NORMED:
                self.final_layernorm = nn.RMSNorm(dims, eps=eps)
        self.layers = layers
        object.__setattr__(self, "_embed", embed)  # the target's: shared, not this module's weights
        object.__setattr__(self, "given", None)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        e = self.embed_tokens(inputs) if "embed_tokens" in self else self._embed(inputs)
        if self.style == "bailing":  # (its first position reads no token: vLLM's reader zeroes it)
            e = mx.where((_positions(inputs, cache) == 0).reshape(*e.shape[:2], 1), 0, e)
        h = self.given if self.given is not None else mx.zeros_like(e)
        h = h.astype(e.dtype)
        if self.style == "qwen":
            x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], -1))
        elif self.style == "mimo":
            x = self.input_proj(mx.concatenate([self.hidden_layernorm(h), self.token_layernorm(e)], -1))
        else:
            x = self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(h)], -1))
        caches = iter(cache if cache is not None else [])
        for layer in self.layers:
            # (Nemotron-H's MoE blocks hold no cache: only its attention blocks take one)
            takes = self.style != "nemotron" or getattr(layer, "block_type", "*") == "*"
            x = layer(x, None, next(caches, None) if takes else None)
        if self.style == "qwen":
            return self.norm(x)
        return self.final_layernorm(x) if self.style == "mimo" or self.style in FINAL_NORMED else x


def _positions(inputs: mx.array, cache: Any) -> mx.array:
    """The rows' positions: the engine's forward's (a row a token), else one sequence's from its cache."""
    forward = _active()
    if forward is not None:
        return forward.positions
    offset = getattr(cache[0], "offset", 0) if cache else 0
    return offset + mx.arange(inputs.shape[1])


class SharedHead(nn.Module):
    def __init__(self, dims: int, eps: float, vocab: int | None):
        super().__init__()
        self.norm = nn.RMSNorm(dims, eps=eps)
        if vocab is not None:
            self.head = nn.Linear(dims, vocab, bias=False)


class MLABlock(nn.Module):
    """LongCat-Flash's MTP block: a DeepSeek-V2-style layer (one latent attention, one dense
    MLP) made of the target's own module classes (mlx-lm's, whose layers are pairs of them)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, dims: int, eps: float):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dims, eps=eps)
        self.self_attn = attn
        self.post_attention_layernorm = nn.RMSNorm(dims, eps=eps)
        self.mlp = mlp

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPHead(nn.Module):
    """The head as mlx-lm's outer model: `model` (the stack), `layers`, logits from hidden."""

    def __init__(self, stack: MTPStack, args: Any, target_logits: Any, shared_head: SharedHead | None,
                 target_caches: Any = None):
        super().__init__()
        self.model = stack
        self.args = args  # the target's text args (MLA dims are read from them)
        if shared_head is not None:
            self.shared_head = shared_head
        object.__setattr__(self, "_target_logits", target_logits)
        # () -> the target's cache for the layer the head's layers copy (a CacheList where the
        # layer keeps several: DeepSeek Sparse Attention's latents and index keys)
        object.__setattr__(self, "_target_caches", target_caches)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        if self.model.style == "nemotron":  # its attention blocks only
            return [KVCache() for layer in self.layers if layer.block_type == "*"]
        if self._target_caches is None:
            return [KVCache() for _ in self.layers]
        return [self._target_caches() for _ in self.layers]

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        h = self.model(inputs, cache)
        if "shared_head" in self:
            h = self.shared_head.norm(h)
            if "head" in self.shared_head:
                return self.shared_head.head(h)
        return self._target_logits(h[:, 0, :])[:, None, :]
