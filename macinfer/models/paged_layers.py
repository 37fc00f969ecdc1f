"""mlx-lm's layers on the paged cache: the stand-in cache and the attention routes.

`PagedLayerCache` stands in for each of mlx-lm's caches during one of our forward
passes (`Forward`); `patch_modules` replaces the `scaled_dot_product_attention`
that mlx-lm's model modules import by a dispatcher that runs the paged attention
inside such a forward (and mlx-lm's own function outside one), and gives the few
families whose attention does not go through it (Gemma 2's soft-capped scores,
Llama 4's chunk mask and attention temperature) a short route to the same place.
Each call is recorded on the forward, so the adapter's probe can check that every
cache is written once and attended through the paged path with its own K/V.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv.attention import AttentionMetadata, attend
from macinfer.kv.mla import expanded_spans, split_latent_attention
from macinfer.models.bitlinear import patch_bitlinear
from macinfer.models.paged_indexer import patch_indexer
from macinfer.models.portable_kernels import patch_kernels


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
            meta = f.meta.for_layer(self.index)
            meta.kv_cache.write(self.index, meta.kv_rows(keys.shape[1]), keys[:, :, 0],
                                None if values is keys else values[:, :, 0])
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
            meta = f.meta.for_layer(self.index)
            meta.kv_cache.write(self.index, meta.kv_rows(1), k[:, :, 0], None)
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


def _project(attn: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """An mlx-lm attention's q, k, v as [T, heads, L, head_dim] (its own layout)."""
    T, L, _ = x.shape
    return tuple(proj(x).reshape(T, L, n, -1).transpose(0, 2, 1, 3) for proj, n in (
        (attn.q_proj, attn.n_heads), (attn.k_proj, attn.n_kv_heads), (attn.v_proj, attn.n_kv_heads)))


def _patch_softcapped_attention(mod: Any) -> None:
    """Gemma 2's attention computes soft-capped scores itself instead of calling
    SDPA: inside our forward, run its projections and RoPE, then the paged
    attention with the cap."""
    cls = getattr(mod, "Attention", None)
    if mod.__name__ + ":softcap" in _patched or cls is None:
        return
    original = cls.__call__

    def __call__(self, x, mask=None, cache=None):
        if not isinstance(cache, PagedLayerCache):
            return original(self, x, mask, cache)
        T, L, _ = x.shape
        q, k, v = _project(self, x)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = paged_call(q, k, v, cache, self.scale, mask, softcap=self.attn_logit_softcapping)
        return self.o_proj(out[:, :, 0, :].reshape(T, L, -1))

    cls.__call__ = __call__
    _patched.add(mod.__name__ + ":softcap")


def _patch_llama4(mod: Any) -> None:
    """Llama 4 builds its chunk mask and its no-RoPE layers' attention temperature from
    `cache.offset` as one number; inside our forward the chunks are the cache kind's
    (ChunkedLocal) and the temperature is taken per row from its position."""
    if mod.__name__ + ":llama4" in _patched:
        return
    model_call, attn_call = mod.LlamaModel.__call__, mod.Attention.__call__

    def model(self, inputs, cache=None):
        if not cache or not isinstance(cache[0], PagedLayerCache):
            return model_call(self, inputs, cache)
        h = self.embed_tokens(inputs)
        for layer, c in zip(self.layers, cache):
            h = layer(h, None, cache=c)
        return self.norm(h)

    def attention(self, x, mask=None, cache=None):
        if not isinstance(cache, PagedLayerCache):
            return attn_call(self, x, mask, cache)
        T, L, _ = x.shape
        q, k, v = _project(self, x)
        if self.use_rope:
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        if self.use_qk_norm:
            q, k = mx.fast.rms_norm(q, weight=None, eps=1e-6), mx.fast.rms_norm(k, weight=None, eps=1e-6)
        if self.attn_temperature_tuning and not self.use_rope:
            pos = cache.offset.astype(mx.float32)
            scales = mx.log(mx.floor((pos + 1) / self.floor_scale) + 1.0) * self.attn_scale + 1.0
            q = (q * scales[:, None, None, None]).astype(q.dtype)
        k, v = cache.update_and_fetch(k, v)
        out = paged_call(q, k, v, cache, self.scale, None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(T, L, -1))

    mod.LlamaModel.__call__, mod.Attention.__call__ = model, attention
    _patched.add(mod.__name__ + ":llama4")


def _patch_gpt_bigcode(mod: Any) -> None:
    """GPT-BigCode (StarCoder 1, SantaCoder) adds learned position embeddings it numbers
    from `cache.offset` as one number: inside our forward, from each row's position."""
    if mod.__name__ + ":positions" in _patched:
        return
    original = mod.GPTBigCodeModel.__call__

    def model(self, inputs, cache=None):
        if not cache or not isinstance(cache[0], PagedLayerCache):
            return original(self, inputs, cache)
        h = self.wte(inputs) + self.wpe(cache[0].offset[:, None])
        for layer, c in zip(self.h, cache):
            h = layer(h, None, cache=c)
        return self.ln_f(h)

    mod.GPTBigCodeModel.__call__ = model
    _patched.add(mod.__name__ + ":positions")


def _patch_olmo(mod: Any) -> None:
    """OLMo 1 computes its attention by hand and adds the mask to the scores, which mlx-lm's
    mask helper gives as the string "causal" for any prompt longer than one token (mlx-lm's
    own forward fails there). Its attention goes through SDPA instead: the paged attention
    inside our forward, MLX's fused one (with the causal mask it meant) outside; and its
    tied-weights form returns the logits alone."""
    if mod.__name__ + ":sdpa" in _patched:
        return

    def attend(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = (t.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3) for t in mx.split(self.att_proj(x), 3, -1))
        if cache is not None:
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        out = paged_call(q, k, v, cache, self.scale, mask) if isinstance(cache, PagedLayerCache) else \
            mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.attn_out(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    mod.TransformerBlock.attend = attend
    # With tied weights it returns (logits, cache): the logits, as the untied form does.
    transformer = mod.Transformer.__call__
    mod.Transformer.__call__ = lambda self, inputs, cache=None: (lambda out: out[0] if isinstance(out, tuple) else out)(
        transformer(self, inputs, cache))
    _patched.add(mod.__name__ + ":sdpa")


def _patch_plamo(mod: Any) -> None:
    """PLaMo 1 tiles its K/V heads after the cache (query head h reads K/V head h mod KV),
    where the paged attention groups query heads (h reads h // (H / KV)): inside our forward
    the query heads are put in the grouped order and the outputs back in theirs."""
    if mod.__name__ + ":tiled" in _patched:
        return
    original = mod.Attention.__call__

    def attention(self, hidden_states, attention_mask=None, cache=None):
        if not isinstance(cache, PagedLayerCache):
            return original(self, hidden_states, attention_mask, cache)
        T, L, _ = hidden_states.shape
        q = self.q_proj(hidden_states).reshape(T, L, self.q_num_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(hidden_states).reshape(T, L, self.k_num_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(hidden_states).reshape(T, L, self.v_num_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rotary_emb(q, offset=cache.offset), self.rotary_emb(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        kv, r = self.k_num_heads, self.q_num_heads // self.k_num_heads
        grouped = [i * kv + g for g in range(kv) for i in range(r)]  # grouped slot -> its tiled head
        back = sorted(range(len(grouped)), key=grouped.__getitem__)
        out = paged_call(q[:, mx.array(grouped)], k, v, cache, self.scale, None)[:, mx.array(back)]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(T, L, -1))

    mod.Attention.__call__ = attention
    _patched.add(mod.__name__ + ":tiled")


def _patch_afm7(mod: Any) -> None:
    """AFM's KV-reuse layers attend over the last layer's K/V and rotate their queries from
    the K/V's length (`S - L`): inside our forward, each row rotates at its own position."""
    if mod.__name__ + ":reuse" in _patched:
        return
    original = mod.KVReuseAttention.__call__

    def attention(self, x, keys, values, mask=None):
        f = _active()
        if f is None or id(keys) not in f.fetched:
            return original(self, x, keys, values, mask)
        T, L, _ = x.shape
        q = self.q_proj(x).reshape(T, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        q = self.q_norm(self.rope(q, offset=f.positions))
        out = paged_call(q, keys, values, None, self.scale, None)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(T, L, -1))

    mod.KVReuseAttention.__call__ = attention
    _patched.add(mod.__name__ + ":reuse")


def _patch_plamo2(mod: Any) -> None:
    """PLaMo 2's attention calls MLX's fused SDPA directly: inside our forward, its
    projections, q/k norms and RoPE, then the paged attention."""
    if mod.__name__ + ":sdpa" in _patched:
        return
    original = mod.Attention.__call__

    def attention(self, hidden_states, mask=None, cache=None):
        if not isinstance(cache, PagedLayerCache):
            return original(self, hidden_states, mask, cache)
        T, L, _ = hidden_states.shape
        q, k, v = mx.split(self.qkv_proj(hidden_states), [self.q_proj_dim, self.q_proj_dim + self.k_proj_dim], axis=-1)
        q = q.reshape(T, L, self.q_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
        k = k.reshape(T, L, self.k_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
        v = v.reshape(T, L, self.v_num_heads, self.v_dim).transpose(0, 2, 1, 3)
        q = mx.fast.rms_norm(q, weight=None, eps=1e-6) * self.q_weight[:, None]
        k = mx.fast.rms_norm(k, weight=None, eps=1e-6) * self.k_weight[:, None]
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = paged_call(q, k, v, cache, self.scale, None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(T, L, -1))

    mod.Attention.__call__ = attention
    _patched.add(mod.__name__ + ":sdpa")


# model modules whose attention does not (only) go through SDPA, and how to route it
_ATTENTION_PATCHES = {"mlx_lm.models.gemma2": [_patch_softcapped_attention],
                      "mlx_lm.models.llama4": [_patch_sdpa, _patch_llama4],
                      "mlx_lm.models.gpt_bigcode": [_patch_sdpa, _patch_gpt_bigcode],
                      "mlx_lm.models.afm7": [_patch_sdpa, _patch_afm7],
                      "mlx_lm.models.olmo": [_patch_olmo],
                      "mlx_lm.models.plamo": [_patch_sdpa, _patch_plamo],
                      "mlx_lm.models.plamo2": [_patch_sdpa, _patch_plamo2],
                      "mlx_lm.models.mla": [_patch_multilinear],
                      "mlx_lm.models.deepseek_v32": [_patch_sdpa, patch_indexer],
                      "mlx_lm.models.bitlinear_layers": [patch_bitlinear]}  # (not attention: a portable path)


def patch_modules() -> None:
    """Every mlx-lm (and mlx-vlm) model module loaded so far (a model's own and those it
    borrows from); outside our forward the replaced function is the module's own."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and mod is not None:
            for patch in _ATTENTION_PATCHES.get(name, [_patch_sdpa]):
                patch(mod)
            patch_kernels(mod)  # mlx-lm's fused Metal kernels: portable forms where Metal is absent
        elif name.startswith("mlx_vlm.models.") and mod is not None and name != "mlx_vlm.models.base":
            # Only modules that call mlx-vlm's own SDPA (its towers keep functions of their own).
            base = sys.modules.get("mlx_vlm.models.base")
            if base is not None and getattr(mod, "scaled_dot_product_attention", None) is getattr(
                    base, "scaled_dot_product_attention", None):
                _patch_sdpa(mod)
