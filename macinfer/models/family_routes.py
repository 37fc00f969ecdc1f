"""Short routes for the mlx-lm families whose attention does not go through SDPA as the
others' does (soft-capped scores, chunk masks from a numeric offset, learned positions,
layers reading another layer's K/V, hand-computed attention, tiled K/V heads): inside our
forward each reaches the same paged attention (`paged_layers.paged_call`); outside it, the
family's own code runs. `patch_modules()` applies them, with the generic SDPA swap, to
every mlx-lm (and mlx-vlm) model module loaded."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.models.bitlinear import patch_bitlinear
from macinfer.models.paged_indexer import patch_indexer
from macinfer.models.paged_layers import (PagedLayerCache, _active, _patch_multilinear, _patch_sdpa, _patched,
                                          paged_call)
from macinfer.models.portable_kernels import patch_kernels


def _project(attn: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """An mlx-lm attention's q, k, v as [T, heads, L, head_dim] (its own layout)."""
    T, L, _ = x.shape
    return tuple(proj(x).reshape(T, L, n, -1).transpose(0, 2, 1, 3) for proj, n in (
        (attn.q_proj, attn.n_heads), (attn.k_proj, attn.n_kv_heads), (attn.v_proj, attn.n_kv_heads)))


def _route_attention(mod: Any, tag: str, paged: Any) -> None:
    """`mod.Attention.__call__` runs `paged(self, x, mask, cache)` inside our forward (its
    cache a `PagedLayerCache`) and the family's own code outside it; once per module."""
    cls = getattr(mod, "Attention", None)
    if f"{mod.__name__}:{tag}" in _patched or cls is None:
        return
    original = cls.__call__

    def __call__(self, x, mask=None, cache=None):
        if not isinstance(cache, PagedLayerCache):
            return original(self, x, mask, cache)
        return paged(self, x, mask, cache)

    cls.__call__ = __call__
    _patched.add(f"{mod.__name__}:{tag}")


def _softcapped(self: nn.Module, x: mx.array, mask: Any, cache: PagedLayerCache) -> mx.array:
    """Gemma 2's attention computes soft-capped scores itself instead of calling SDPA: its
    projections and RoPE, then the paged attention with the cap."""
    T, L, _ = x.shape
    q, k, v = _project(self, x)
    q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = paged_call(q, k, v, cache, self.scale, mask, softcap=self.attn_logit_softcapping)
    return self.o_proj(out[:, :, 0, :].reshape(T, L, -1))


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


def _patch_ngram_window(mod: Any) -> None:
    """LongCat-Flash's n-gram embedding keeps the sequence's last n - 1 token ids as its state,
    a window that grows until full (which a fixed state slot cannot hold). Here the window
    starts full of zeros: its shifted ids are the zeros `_shift_right` fills in anyway, so
    every position embeds as before, and the state keeps one shape."""
    if mod.__name__ + ":window" in _patched:
        return
    original = mod.NgramEmbedding.__call__

    def call(self, input_ids, cache=None):
        if cache is None:
            return original(self, input_ids, cache)
        seq_len, width = input_ids.shape[-1], self.n - 1
        ids = input_ids.astype(mx.int64)
        held = cache[0] if cache[0] is not None else mx.zeros((*ids.shape[:-1], width), dtype=mx.int64)
        context = mx.concatenate([held, ids], axis=-1)
        cache[0] = context[..., -width:]
        x = self.word_embeddings(ids)
        shifted = {i: self._shift_right(context, i - 1) for i in range(2, self.n + 1)}
        for i in range(2, self.n + 1):
            for j in range(self.k):
                index = (i - 2) * self.k + j
                ngram = self._get_ngram_ids(context, shifted, self._vocab_mods[(i, j)], ngram=i)
                x = x + self.post_projs[index](self.embedders[index]((ngram % int(self.m + index * 2 + 1))[..., -seq_len:]))
        return x / (1 + self.k * (self.n - 1))

    mod.NgramEmbedding.__call__ = call
    _patched.add(mod.__name__ + ":window")


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


def _moondream3(self: nn.Module, x: mx.array, mask: Any, cache: PagedLayerCache) -> mx.array:
    """Moondream 3's attention (mlx-vlm's) scales queries and values by temperatures of the
    position, rotates a batch's rows one by one and calls MLX's SDPA itself: here the
    temperatures and RoPE take each row's position (`cache.offset`), then the paged attention."""
    T, L, _ = x.shape
    qkv = self.qkv(x)
    tau_q, tau_v = self.tau(qkv, cache.offset[:, None] + mx.arange(L))
    q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    q, k, v = (p.reshape(T, L, n, self.head_dim).transpose(0, 2, 1, 3) for p, n in zip(
        mx.split(qkv, [q_dim, q_dim + kv_dim], axis=-1), (self.n_heads, self.n_kv_heads, self.n_kv_heads)))
    q, v = q * tau_q, v * tau_v
    q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = paged_call(q, k, v, cache, self.scale, mask)
    return self.proj(out[:, :, 0, :].reshape(T, L, -1))


def _patch_limite(mod: Any) -> None:
    """Limite (mlx-vlm's) numbers its RoPE positions and builds its window mask from
    `cache.offset` as one number: inside our forward the positions are each row's and the
    window is the cache kind's (`mlx_lm_classes.CONFIG_WINDOWS`), so the mask is left to the
    paged attention its SDPA call reaches."""
    if mod.__name__ + ":limite" in _patched:
        return
    model_call, window_mask = mod.LimiteModel.__call__, mod._causal_window_mask

    def model(self, inputs, cache=None, positions=None):
        if positions is None and cache and isinstance(cache[0], PagedLayerCache):
            positions = cache[0].offset[:, None] + mx.arange(inputs.shape[1])
        return model_call(self, inputs, cache, positions)

    def mask(q_len, offset, window, dtype):
        return None if isinstance(offset, mx.array) else window_mask(q_len, offset, window, dtype)

    mod.LimiteModel.__call__, mod._causal_window_mask = model, mask
    _patch_sdpa(mod)
    _patched.add(mod.__name__ + ":limite")


# model modules whose attention does not (only) go through SDPA, and how to route it
_ATTENTION_PATCHES = {"mlx_lm.models.gemma2": [lambda mod: _route_attention(mod, "softcap", _softcapped)],
                      "mlx_lm.models.llama4": [_patch_sdpa, _patch_llama4],
                      "mlx_lm.models.gpt_bigcode": [_patch_sdpa, _patch_gpt_bigcode],
                      "mlx_lm.models.afm7": [_patch_sdpa, _patch_afm7],
                      "mlx_lm.models.olmo": [_patch_olmo],
                      "mlx_lm.models.longcat_flash_ngram": [_patch_sdpa, _patch_ngram_window],
                      "mlx_lm.models.plamo": [_patch_sdpa, _patch_plamo],
                      "mlx_lm.models.plamo2": [_patch_sdpa, _patch_plamo2],
                      "mlx_lm.models.mla": [_patch_multilinear],
                      "mlx_lm.models.deepseek_v32": [_patch_sdpa, patch_indexer],
                      "mlx_lm.models.bitlinear_layers": [patch_bitlinear],  # (not attention: a portable path)
                      "mlx_vlm.models.moondream3.language": [lambda mod: _route_attention(mod, "tau", _moondream3)],
                      "mlx_vlm.models.limite.language": [_patch_limite]}


def patch_modules() -> None:
    """Every mlx-lm (and mlx-vlm) model module loaded so far (a model's own and those it
    borrows from); outside our forward the replaced function is the module's own."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and mod is not None:
            for patch in _ATTENTION_PATCHES.get(name, [_patch_sdpa]):
                patch(mod)
            patch_kernels(mod)  # mlx-lm's fused Metal kernels: portable forms where Metal is absent
        elif name in _ATTENTION_PATCHES and mod is not None:
            for patch in _ATTENTION_PATCHES[name]:
                patch(mod)
        elif name.startswith("mlx_vlm.models.") and mod is not None and name != "mlx_vlm.models.base":
            # Only modules that call mlx-vlm's own SDPA (its towers keep functions of their own).
            base = sys.modules.get("mlx_vlm.models.base")
            if base is not None and getattr(mod, "scaled_dot_product_attention", None) is getattr(
                    base, "scaled_dot_product_attention", None):
                _patch_sdpa(mod)
