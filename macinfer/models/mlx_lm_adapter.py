"""mlx-lm's own model classes, run on the paged cache and the flat ragged batch.

One mechanism for every architecture mlx-lm implements (MoE, sliding windows,
attention sinks, q/k norms, partial rotary, biases...), not a fork per model:

- The step's T tokens are presented as T rows of length 1 (`[T, 1]`). RoPE in
  mlx-lm takes `offset=cache.offset`; each layer's cache here is a
  `PagedLayerCache` whose `offset` is the rows' positions (`[T]`), so every
  token rotates at its own position.
- `cache.update_and_fetch(k, v)` writes the rows into the paged pools (one
  scatter per layer) and hands them back unchanged.
- The models' `scaled_dot_product_attention(q, k, v, cache, ...)` (imported
  from `mlx_lm.models.base` into each model module) is replaced in those
  modules by a dispatcher: for a `PagedLayerCache` it runs the paged attention
  (decodes against their block tables, prefill chunks causally, a window bound
  for sliding-window layers, sinks passed through); for anything else it is
  mlx-lm's own function, so mlx-lm keeps working in the same process.
- The LM head runs only on the rows that sample a token: the outer model's
  head (tied embeddings, soft-capping, logit scales) is applied to given
  hidden states by swapping its inner model for a stand-in during the call.

Sliding-window layers are found from the model's own `make_cache()` (a
`RotatingKVCache(max_size=W)` marks a window of W). Architectures whose cache
is not plain K/V (recurrent, hybrid, MLA's compressed latents) are refused at
load with the reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv.attention import AttentionMetadata, attend

# mlx-lm families whose cache is not per-layer K/V rows the paged pool can hold.
REFUSED = {
    "deepseek_v2": "multi-head latent attention (MLA) caches compressed latents, not K/V rows",
    "deepseek_v3": "multi-head latent attention (MLA) caches compressed latents, not K/V rows",
    "deepseek_v32": "multi-head latent attention (MLA) caches compressed latents, not K/V rows",
    "kimi_k2": "multi-head latent attention (MLA) caches compressed latents, not K/V rows",
    "minicpm3": "multi-head latent attention (MLA) caches compressed latents, not K/V rows",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class EngineArgs:
    """What the engine needs to size the KV pools and validate requests."""
    model_type: str
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


class PagedLayerCache:
    """Stands in for mlx-lm's per-layer cache during one forward pass."""

    def __init__(self, meta: AttentionMetadata, layer: int, window: int | None):
        self.meta, self.layer, self.window = meta, layer, window

    @property
    def offset(self) -> mx.array:
        return self.meta.positions  # [T]: one RoPE offset per row

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys/values: [T, kv_heads, 1, head_dim]
        rows = self.meta.for_layer(self.layer).kv_rows
        self.meta.kv_cache.write(self.layer, rows, keys[:, :, 0], values[:, :, 0])
        return keys, values

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # rows are single tokens; the paged attention masks by position

    def __bool__(self) -> bool:
        return True


_patched: set[str] = set()


def _patch_sdpa(module_name: str) -> None:
    """Route the model module's SDPA through the paged attention for our caches."""
    if module_name in _patched:
        return
    mod = importlib.import_module(module_name)
    original = getattr(mod, "scaled_dot_product_attention", None)
    if original is None:
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if not isinstance(cache, PagedLayerCache):
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks, **kw)
        out = attend(queries[:, :, 0, :], cache.meta, cache.layer, scale, cache.window, sinks)
        return out[:, :, None, :]

    mod.scaled_dot_product_attention = scaled_dot_product_attention
    _patched.add(module_name)


def _patch_softcapped_attention(module_name: str) -> None:
    """Gemma 2's attention computes soft-capped scores itself instead of calling
    SDPA: for a paged cache, run its projections and RoPE, then the paged
    attention with the cap."""
    mod = importlib.import_module(module_name)
    cls = getattr(mod, "Attention", None)
    if module_name in _patched or cls is None or not hasattr(cls, "__call__"):
        return
    original = cls.__call__

    def __call__(self, x, mask=None, cache=None):
        if not isinstance(cache, PagedLayerCache):
            return original(self, x, mask, cache)
        T, L, _ = x.shape
        q = self.q_proj(x).reshape(T, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(T, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(T, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        cache.update_and_fetch(k, v)
        out = attend(q[:, :, 0, :], cache.meta, cache.layer, self.scale, cache.window,
                     softcap=self.attn_logit_softcapping)
        return self.o_proj(out.reshape(T, L, -1))

    cls.__call__ = __call__
    _patched.add(module_name)


# model modules whose attention does not go through SDPA, and how to route it
_ATTENTION_PATCHES = {"mlx_lm.models.gemma2": _patch_softcapped_attention}


class _GivenHidden:
    """The inner model's stand-in while the outer model's head runs on given states."""

    def __init__(self, inner: nn.Module, hidden: mx.array):
        self._inner, self._hidden = inner, hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # e.g. embed_tokens for tied heads


class MlxLmModel(nn.Module):
    """An mlx-lm model behind macinfer's model interface:
    `model(input_ids [T], meta) -> hidden [T, D]` and `model.logits(hidden) -> [N, vocab]`."""

    def __init__(self, lm: nn.Module, config: dict[str, Any]):
        super().__init__()
        self.lm = lm
        inner = getattr(lm, "model", None)
        if not isinstance(inner, nn.Module) or not hasattr(inner, "layers"):
            raise UnsupportedModelError(f"{config['model_type']}: no `model.layers` stack to run on the paged cache")
        self.windows = self._windows(lm, len(inner.layers))
        _ATTENTION_PATCHES.get(type(lm).__module__, _patch_sdpa)(type(lm).__module__)
        for layer in inner.layers:  # a model may define attention in a shared module
            _patch_sdpa(type(layer).__module__)
        n_heads = config["num_attention_heads"]
        self.args = EngineArgs(
            model_type=config["model_type"],
            num_hidden_layers=len(inner.layers),
            num_key_value_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 4096),
        )

    @staticmethod
    def _windows(lm: nn.Module, n_layers: int) -> list[int | None]:
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        if not hasattr(lm, "make_cache"):
            return [None] * n_layers
        windows: list[int | None] = []
        for c in lm.make_cache():
            if type(c) is KVCache:
                windows.append(None)
            elif type(c) is RotatingKVCache:
                windows.append(c.max_size)
            else:
                raise UnsupportedModelError(
                    f"its layers keep {type(c).__name__} state (recurrent or hybrid layers), which the paged "
                    "K/V cache cannot hold or restore after preemption"
                )
        return windows

    @property
    def layers(self) -> list[nn.Module]:
        return self.lm.model.layers

    def __call__(self, input_ids: mx.array, meta: AttentionMetadata) -> mx.array:
        caches = [PagedLayerCache(meta, i, w) for i, w in enumerate(self.windows)]
        hidden = self.lm.model(input_ids[:, None], cache=caches)
        return hidden[:, 0, :]

    def logits(self, hidden: mx.array) -> mx.array:
        # An instance attribute shadows the `model` child for this call only.
        object.__setattr__(self.lm, "model", _GivenHidden(self.lm.model, hidden[:, None, :]))
        try:
            out = self.lm(mx.zeros((hidden.shape[0], 1), dtype=mx.int32))
        finally:
            object.__delattr__(self.lm, "model")
        return out[:, 0, :]

    def kv_dtype(self) -> mx.Dtype:
        """What K/V come out of the projections in: the activations' dtype."""
        embed = self.lm.model.embed_tokens if hasattr(self.lm.model, "embed_tokens") else None
        if embed is not None:
            return embed(mx.array([0])).dtype
        return mx.float32

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.lm.sanitize(weights) if hasattr(self.lm, "sanitize") else weights

    def fuse_projections(self) -> None:
        pass

    def load_weights(self, weights, strict: bool = True):  # mlx-lm's parameter names
        return self.lm.load_weights(weights, strict=strict)


def build(config: dict[str, Any]) -> MlxLmModel:
    """mlx-lm's class for `config` (its own model_type remapping), uninitialised."""
    model_type = config.get("model_type")
    if model_type in REFUSED:
        raise UnsupportedModelError(f"{model_type} is not supported: {REFUSED[model_type]}")
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from None
    return MlxLmModel(model_class(args_class.from_dict(config)), config)
