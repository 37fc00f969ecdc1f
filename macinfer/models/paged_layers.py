"""mlx-lm's layers on the paged cache: the stand-in cache and the attention dispatcher.

`PagedLayerCache` stands in for each of mlx-lm's caches during one of our forward
passes (`Forward`); `_patch_sdpa` replaces the `scaled_dot_product_attention` that
mlx-lm's model modules import by a dispatcher (`paged_call`) that runs the paged
attention inside such a forward (and mlx-lm's own function outside one); the few
families whose attention does not go through it get short routes to the same place
(`family_routes.py`, which also applies them all: `patch_modules`). Each call is
recorded on the forward, so the adapter's probe can check that every cache is written
once and attended through the paged path with its own K/V.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from macinfer.kv.attention import AttentionMetadata, attend
from macinfer.kv.mla import expanded_spans, split_latent_attention


class UnsupportedModelError(ValueError):
    pass


@dataclass
class Forward:
    """What one forward pass through the adapter saw (the probe checks it)."""
    meta: AttentionMetadata | None  # None: the probe (nothing is written or attended)
    positions: mx.array | None = None  # [T] each row's position
    fetched: dict[int, int] = field(default_factory=dict)  # id(K or V handed out) -> cache
    handed: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict)  # cache -> (K, V) handed out
    writes: dict[int, list[tuple]] = field(default_factory=dict)  # cache -> shapes written
    calls: list[int] = field(default_factory=list)  # cache each attention call read
    query_heads: dict[int, int] = field(default_factory=dict)  # cache -> query heads attending it
    problems: list[str] = field(default_factory=list)
    # Recurrent state (`paged_state.py`): the step's plan, and what the probe and the tracer see.
    state_plan: Any = None
    tracing: bool = False
    state_shapes: dict[int, dict[int, tuple]] = field(default_factory=dict)  # cache -> entry -> (shape, dtype)
    state_touched: set[int] = field(default_factory=set)
    # Multi-head latent attention (`mla_rope`: the rope key's width; None: not an MLA model):
    # the caches holding latents, and how wide each latent is.
    mla_rope: int | None = None
    latent: dict[int, int] = field(default_factory=dict)
    # For the expanded form of prompt chunks (`kv/mla.py`): each MLA attention's
    # `embed_q` -> its `unembed_out` (from the adapter), the absorbed queries handed to
    # the attention -> (embed_q, the queries before it), and outputs already projected
    # out -> (placeholder handed back, what `unembed_out` returns for it).
    mla_unembed: dict[int, Any] = field(default_factory=dict)
    mla_queries: dict[int, tuple[Any, mx.array]] = field(default_factory=dict)
    premade: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict)
    mla_dims: dict[int, tuple[Any, Any, dict]] = field(default_factory=dict)  # the probe: cache -> embed_q, unembed_out, dims
    # A sparse attention's key selection for the layer's next latent attention (`paged_indexer.py`).
    key_select: Any = None
    v_is_k: set[int] = field(default_factory=set)  # caches written with V the same array as K


_state = threading.local()


def _active() -> Forward | None:
    return getattr(_state, "forward", None)


def set_active(forward: Forward | None) -> None:
    """The forward the adapter is running on this thread (None: none; mlx-lm's own calls)."""
    _state.forward = forward


class PagedLayerCache:
    """Stands in for one of mlx-lm's caches during one forward pass."""

    def __init__(self, forward: Forward, index: int, positions: mx.array):
        self.forward, self.index, self.positions = forward, index, positions

    @property
    def offset(self) -> mx.array:
        return self.positions  # [T]: one RoPE offset per row

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys/values: [T, kv_heads, 1, head_dim]
        f = self.forward
        rope = f.mla_rope
        if rope and keys.shape[1] == 1 and values.shape[-1] == rope and keys.shape[-1] != rope:
            return self._latent(keys, values)
        f.writes.setdefault(self.index, []).append((tuple(keys.shape), tuple(values.shape), keys.dtype))
        if values is keys:  # V is K itself (a sparse attention's index keys): stored once
            f.v_is_k.add(self.index)
        if f.meta is not None:
            f.meta.write(self.index, keys[:, :, 0], None if values is keys else values[:, :, 0])
        f.fetched[id(keys)] = f.fetched[id(values)] = self.index
        f.handed[self.index] = (keys, values)
        self.keys, self.values = keys, values  # (what a model reads back off its cache: DeepSeek V3.2's)
        return keys, values

    def _latent(self, latent: mx.array, k_rope: mx.array) -> tuple[mx.array, mx.array]:
        """MLA (mlx-lm's absorbed form): the compressed latent and the rope key are cached as
        one K "head" (V is the latent, read from K). The rope key is handed back as an
        identity, so the rope scores mlx-lm computes by hand, `(q_rope * scale) @ k_rope^T`,
        come to the attention call as the scaled rope queries themselves (see `paged_call`)."""
        f, T, rope = self.forward, latent.shape[0], k_rope.shape[-1]
        k = mx.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)
        f.writes.setdefault(self.index, []).append((tuple(k.shape), tuple(latent.shape), latent.dtype))
        if f.meta is not None:
            f.meta.write(self.index, k[:, :, 0], None)
        eye = mx.broadcast_to(mx.eye(rope, dtype=k_rope.dtype), (T, 1, rope, rope))
        f.fetched[id(latent)] = self.index
        f.handed[self.index] = (latent, eye)
        f.latent[self.index] = latent.shape[-1]
        self.keys, self.values = latent, eye
        return latent, eye

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What a layer reading this cache's K/V (without writing) gets: this step's rows,
        marked, so the attention over them reads the whole paged cache."""
        if self.index not in self.forward.handed:
            raise UnsupportedModelError(f"a layer reads cache {self.index}'s K/V before it is written")
        return self.forward.handed[self.index]

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # rows are single tokens; the paged attention masks by position and kind

    def maybe_trim_front(self) -> None:
        pass  # chunked caches drop old chunks themselves; the block manager releases blocks here

    def __bool__(self) -> bool:
        return True


def _same(x: mx.array, handed: mx.array) -> bool:
    """`x` is what the cache handed out, or an array of its shape (StableLM casts K to
    float32 after the cache, a new array of the same values): the paged attention reads
    the pool. A change of values in place is caught by the engine's load-time comparison
    with mlx-lm's own forward; a change of shape (heads tiled, K/V concatenated) here."""
    return x is handed or x.shape == handed.shape


def paged_call(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                sinks: mx.array | None = None, softcap: float | None = None) -> mx.array | None:
    """The paged attention for an mlx-lm attention call inside our forward (None: not ours)."""
    f = _active()
    if f is None:
        return None
    # The K/V tell which cache is read (a layer may attend over another cache's K/V while
    # passing its own cache: IQuest-Loop-Coder's second loop); else the cache passed.
    index = f.fetched.get(id(keys))
    if index is None and isinstance(cache, PagedLayerCache):
        index = cache.index
    if index is None:
        f.problems.append("an attention call reads K/V that did not come from its cache")
        return mx.zeros(queries.shape[:-1] + values.shape[-1:], dtype=queries.dtype)
    handed = f.handed.get(index)
    f.query_heads.setdefault(index, queries.shape[1])
    if index in f.latent:
        return _latent_call(f, index, queries, keys, values, scale, mask, handed)
    if handed is None or not (_same(keys, handed[0]) and _same(values, handed[1])):
        f.problems.append(f"cache {index}'s K/V are reshaped after the cache (heads repeated or tiled, "
                          "rows concatenated) before attention, which the paged attention cannot follow")
    if mask is not None and not isinstance(mask, str):
        f.problems.append(f"the attention over cache {index} takes a mask the model built itself")
    f.calls.append(index)
    if f.meta is None:  # the probe: shapes only
        return mx.zeros(queries.shape[:-1] + values.shape[-1:], dtype=queries.dtype)
    out = attend(queries[:, :, 0, :], f.meta, index, scale, sinks, softcap)
    return out[:, :, None, :]


def _latent_call(f: Forward, index: int, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                 mask: Any, handed: tuple[mx.array, mx.array]) -> mx.array:
    """mlx-lm's absorbed MLA attention: queries projected into the latent space, keys and
    values the latent, and `mask` the scaled rope queries (the rope scores against the
    identity handed out for the rope key). The paged attention reads K = [latent, rope key]
    with queries [q_latent, q_rope]: the same scores, one read of the cache."""
    rope = handed[1].shape[-1]
    if not (keys is handed[0] and values is handed[0] and isinstance(mask, mx.array)
            and mask.shape == queries.shape[:-1] + (rope,)):
        f.problems.append(f"cache {index} holds MLA latents but its attention is not mlx-lm's absorbed form")
        return mx.zeros(queries.shape, dtype=queries.dtype)
    f.calls.append(index)
    select, f.key_select = f.key_select, None  # DeepSeek Sparse Attention: this layer's selected keys
    q_rope = (mask * (1.0 / scale)).astype(queries.dtype)
    embed_q, q_nope = f.mla_queries.get(id(queries), (None, None))
    unembed = f.mla_unembed.get(id(embed_q))
    if f.meta is None:  # the probe: shapes only, and whether the expanded form can be handed back
        if unembed is None:
            return mx.zeros(queries.shape, dtype=queries.dtype)
        f.mla_dims[index] = (embed_q, unembed, dict(heads=queries.shape[1], r=queries.shape[-1],
                                                    nope=q_nope.shape[-1], rope=rope))
        return _premade(f, queries, unembed(mx.zeros(queries.shape, dtype=queries.dtype)))
    if unembed is not None and select is None and expanded_spans(f.meta, index):
        # Long prompt chunks in the expanded form (K/V per head from the latents): the output
        # is already projected out, handed to the model's `unembed_out` by `_premade`.
        out = split_latent_attention(queries[:, :, 0], q_nope[:, :, 0], q_rope[:, :, 0], f.meta, index, scale,
                                     embed_q, unembed)
        return _premade(f, queries, out[:, :, None, :])
    q = mx.concatenate([queries, q_rope], axis=-1)
    return attend(q[:, :, 0, :], f.meta, index, scale, select=select)[:, :, None, :]


def _premade(f: Forward, queries: mx.array, out: mx.array) -> mx.array:
    """A placeholder of the latent output's shape, which the model's `unembed_out` turns
    into `out` (never evaluated: MLX is lazy)."""
    placeholder = mx.zeros(queries.shape, dtype=queries.dtype)
    f.premade[id(placeholder)] = (placeholder, out)
    return placeholder


def _patch_multilinear(mod: Any) -> None:
    """mlx-lm's per-head projections of MLA (`embed_q`, `unembed_out`): inside our forward,
    the absorbed queries remember what they were projected from, and an output the
    attention already projected out (`_premade`) passes through `unembed_out`."""
    for cls in (mod.MultiLinear, mod.QuantizedMultiLinear):
        if f"{mod.__name__}:{cls.__name__}" in _patched:
            continue
        original = cls.__call__

        def __call__(self, x, transpose=True, _original=original):
            f = _active()
            if f is None:
                return _original(self, x, transpose)
            made = f.premade.pop(id(x), None)
            if made is not None:
                return made[1]
            out = _original(self, x, transpose)
            if transpose and id(self) in f.mla_unembed:
                f.mla_queries[id(out)] = (self, x)
            return out

        cls.__call__ = __call__
        _patched.add(f"{mod.__name__}:{cls.__name__}")


_patched: set[str] = set()


def _patch_sdpa(mod: Any) -> None:
    """Route a model module's SDPA through the paged attention inside our forward."""
    original = getattr(mod, "scaled_dot_product_attention", None)
    if mod.__name__ in _patched or original is None:
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        out = paged_call(queries, keys, values, cache, scale, mask, sinks) if not kw else None
        if out is None:
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks, **kw)
        return out

    mod.scaled_dot_product_attention = scaled_dot_product_attention
    _patched.add(mod.__name__)
