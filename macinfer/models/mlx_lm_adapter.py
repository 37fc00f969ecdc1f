"""mlx-lm's own model classes, run on the paged cache and the flat ragged batch.

One mechanism for every architecture mlx-lm implements (MoE, sliding windows,
chunked local attention, KV sharing, attention sinks, q/k norms, partial rotary,
biases, vision-language wrappers run text-only...), not a fork per model:

- The step's T tokens are presented as T rows of length 1 (`[T, 1]`). RoPE in
  mlx-lm takes `offset=cache.offset`; each of the model's caches here is a
  `PagedLayerCache` whose `offset` is the rows' positions (`[T]`), so every
  token rotates at its own position.
- `cache.update_and_fetch(k, v)` writes the rows into that cache's paged pools
  (one scatter) and hands them back unchanged.
- The models' `scaled_dot_product_attention(q, k, v, cache, ...)` (imported from
  `mlx_lm.models.base` into each model module) is replaced in those modules by a
  dispatcher: for a `PagedLayerCache`, or K/V that one handed out (a layer reading
  another layer's K/V: Gemma 3n/4, AFM), it runs the paged attention over that
  cache's blocks, with the cache's kind (window, chunk) applied; for anything else
  it is mlx-lm's own function, so mlx-lm keeps working in the same process.
- The LM head runs only on the rows that sample a token: the text model's head
  (tied embeddings, soft-capping, logit scales) is applied to given hidden states
  by swapping its inner model for a stand-in during the call.

What each cache is comes from the model itself, at load, by a probe forward that
is never evaluated (MLX is lazy: shapes without compute): the kind from mlx-lm's
own `make_cache()` entry, K/V heads and head sizes from what each layer writes.
The probe also refuses, with the reason, what the paged path could only run
wrong: a cache that is not K/V rows (recurrent state, MLA latents), a cache
written more or less than once, an attention computed by hand or over K/V
changed after the cache (the replaced function never sees the right keys), a
mask the model built itself.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv.attention import AttentionMetadata, attend
from macinfer.kv.spec import ChunkedLocal, FullAttention, LayerKV, SlidingWindow

MLA = "multi-head latent attention (MLA) caches compressed latents, not K/V rows (issue #23)"
# Families mlx-lm runs whose caches look like K/V to the probe but hold something else.
REFUSED = {name: MLA for name in (
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v41", "deepseek_v41_text", "kimi_k2", "kimi_k25",
    "kimi_vl", "minicpm3", "glm4_moe_lite", "glm_moe_dsa", "mistral4", "joyai_llm_flash", "bailing_moe_v3",
    "youtu_llm", "longcat_flash", "longcat_flash_ngram", "kimi_linear", "kimi_k3", "bailing_hybrid")}

# Families whose mlx-lm file applies no sliding window although transformers (and
# llama.cpp) do: the window of layer i, from the config. `layer_types` wins when given.
CONFIG_WINDOWS = {
    "gemma2": lambda cfg, i: cfg.get("sliding_window") if i % 2 == 0 else None,  # even layers slide
    "starcoder2": lambda cfg, i: cfg.get("sliding_window"),
    "phi3": lambda cfg, i: cfg.get("sliding_window"),
}


def config_windows(config: dict[str, Any], n: int) -> list[int | None]:
    """The window transformers gives each of `n` layers: `layer_types` (with
    `sliding_window`), or the family's rule for those whose mlx-lm file applies none.
    The one place a layer's window is read from a config; a cache mlx-lm's
    `make_cache()` already windows keeps its own."""
    w = config.get("sliding_window")
    if not w or config.get("use_sliding_window") is False or w >= (config.get("max_position_embeddings") or 1 << 62):
        return [None] * n
    layer_types = config.get("layer_types")
    if layer_types and len(layer_types) == n:
        return [int(w) if t == "sliding_attention" else None for t in layer_types]
    rule = CONFIG_WINDOWS.get(config.get("model_type"))
    return [None] * n if rule is None else [int(rule(config, i)) if rule(config, i) else None for i in range(n)]


class UnsupportedModelError(ValueError):
    pass


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's text part over its top level (the text model's sizes)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


@dataclass
class EngineArgs:
    """What the engine needs to validate requests (cache shapes: `layer_specs`)."""
    model_type: str
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int


@dataclass
class _Forward:
    """What one forward pass through the adapter saw (the probe checks it)."""
    meta: AttentionMetadata | None  # None: the probe (nothing is written or attended)
    fetched: dict[int, int] = field(default_factory=dict)  # id(K or V handed out) -> cache
    handed: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict)  # cache -> (K, V) handed out
    writes: dict[int, list[tuple]] = field(default_factory=dict)  # cache -> shapes written
    calls: list[int] = field(default_factory=list)  # cache each attention call read
    problems: list[str] = field(default_factory=list)


_state = threading.local()


def _active() -> _Forward | None:
    return getattr(_state, "forward", None)


class PagedLayerCache:
    """Stands in for one of mlx-lm's caches during one forward pass."""

    def __init__(self, forward: _Forward, index: int, positions: mx.array):
        self.forward, self.index, self.positions = forward, index, positions

    @property
    def offset(self) -> mx.array:
        return self.positions  # [T]: one RoPE offset per row

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys/values: [T, kv_heads, 1, head_dim]
        f = self.forward
        f.writes.setdefault(self.index, []).append((tuple(keys.shape), tuple(values.shape), keys.dtype))
        if f.meta is not None:
            meta = f.meta.for_layer(self.index)
            meta.kv_cache.write(self.index, meta.kv_rows(keys.shape[1]), keys[:, :, 0], values[:, :, 0])
        f.fetched[id(keys)] = f.fetched[id(values)] = self.index
        f.handed[self.index] = (keys, values)
        return keys, values

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


def _paged_call(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                sinks: mx.array | None = None, softcap: float | None = None) -> mx.array | None:
    """The paged attention for an mlx-lm attention call inside our forward (None: not ours)."""
    f = _active()
    if f is None:
        return None
    index = cache.index if isinstance(cache, PagedLayerCache) else f.fetched.get(id(keys))
    if index is None:
        f.problems.append("an attention call reads K/V that did not come from its cache")
        return mx.zeros(queries.shape[:-1] + values.shape[-1:], dtype=queries.dtype)
    handed = f.handed.get(index)
    if handed is None or keys is not handed[0] or values is not handed[1]:
        f.problems.append(f"cache {index}'s K/V are changed after the cache (repeated, tiled or concatenated) "
                          "before attention, which the paged attention cannot follow")
    if mask is not None and not isinstance(mask, str):
        f.problems.append(f"the attention over cache {index} takes a mask the model built itself")
    f.calls.append(index)
    if f.meta is None:  # the probe: shapes only
        return mx.zeros(queries.shape[:-1] + values.shape[-1:], dtype=queries.dtype)
    out = attend(queries[:, :, 0, :], f.meta, index, scale, sinks, softcap)
    return out[:, :, None, :]


_patched: set[str] = set()


def _patch_sdpa(mod: Any) -> None:
    """Route a model module's SDPA through the paged attention inside our forward."""
    original = getattr(mod, "scaled_dot_product_attention", None)
    if mod.__name__ in _patched or original is None:
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        out = _paged_call(queries, keys, values, cache, scale, mask, sinks) if not kw else None
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
        out = _paged_call(q, k, v, cache, self.scale, mask, softcap=self.attn_logit_softcapping)
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
        out = _paged_call(q, k, v, cache, self.scale, None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(T, L, -1))

    mod.LlamaModel.__call__, mod.Attention.__call__ = model, attention
    _patched.add(mod.__name__ + ":llama4")


# model modules whose attention does not (only) go through SDPA, and how to route it
_ATTENTION_PATCHES = {"mlx_lm.models.gemma2": [_patch_softcapped_attention],
                      "mlx_lm.models.llama4": [_patch_sdpa, _patch_llama4]}


def _patch_modules() -> None:
    """Every mlx-lm model module loaded so far (a model's own and those it borrows from)."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and mod is not None:
            for patch in _ATTENTION_PATCHES.get(name, [_patch_sdpa]):
                patch(mod)


def _resolve(node: Any, path: str) -> Any:
    for name in filter(None, path.split(".")):
        node = getattr(node, name, None)
    return node


class _GivenHidden:
    """The inner model's stand-in while the outer model's head runs on given states."""

    def __init__(self, inner: nn.Module, hidden: mx.array):
        self._inner, self._hidden = inner, hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # e.g. embed_tokens for tied heads


def _cache_kind(cache: Any, index: int, model_type: str) -> FullAttention | SlidingWindow | ChunkedLocal:
    from mlx_lm.models import cache as c

    kind = type(cache)
    if kind in (c.KVCache, c.ConcatenateKVCache):
        return FullAttention()
    if kind is c.RotatingKVCache:
        if cache.keep:
            raise UnsupportedModelError(f"cache {index} is a RotatingKVCache keeping {cache.keep} first tokens "
                                        "(attention sinks by position), which the paged cache does not keep")
        return SlidingWindow(cache.max_size)
    if kind is c.ChunkedKVCache:
        return ChunkedLocal(cache.chunk_size)
    if kind in (c.ArraysCache, c.CacheList) or "Mamba" in kind.__name__ or "Arrays" in kind.__name__:
        raise UnsupportedModelError(
            f"cache {index} is a {kind.__name__}: per-sequence recurrent state (a hybrid or recurrent "
            "architecture), which the paged cache does not hold yet (issue #22)")
    raise UnsupportedModelError(f"cache {index} is a {kind.__name__}, which the paged cache cannot hold")


class MlxLmModel(nn.Module):
    """An mlx-lm model behind macinfer's model interface:
    `model(input_ids [T], meta) -> hidden [T, D]` and `model.logits(hidden) -> [N, vocab]`."""

    def __init__(self, lm: nn.Module, config: dict[str, Any]):
        super().__init__()
        self.lm = lm
        model_type = config["model_type"]
        # A vision-language wrapper runs its language model (text-only requests).
        text = lm
        while isinstance(getattr(text, "language_model", None), nn.Module):
            text = text.language_model
        path, node = [], lm
        while node is not text:
            path.append("language_model")
            node = node.language_model
        # Plain attributes, not module children (an nn.Module keeps lists in its tree).
        object.__setattr__(self, "_text_path", path)
        # The module that returns hidden states: called by the text model, swapped for
        # given states when its head runs.
        inner = next((p for p in ("model", "transformer", "backbone", "model.language_model")
                      if isinstance(_resolve(text, p), nn.Module) and hasattr(_resolve(text, p), "__call__")), None)
        if inner is None:
            raise UnsupportedModelError(f"{model_type}: no inner model (model, transformer, backbone) to run")
        object.__setattr__(self, "_inner_path", inner.split("."))
        params = inspect.signature(_resolve(text, inner).__call__).parameters
        self._inner_takes_mask = "mask" in params and params["mask"].default is inspect.Parameter.empty
        from mlx_lm.models.cache import make_prompt_cache

        # The innermost make_cache (a wrapper may not pass its text model's on).
        chain = [lm] + [_resolve(lm, ".".join(path[: i + 1])) for i in range(len(path))]
        owner = next((m for m in reversed(chain) if hasattr(m, "make_cache")), lm)
        object.__setattr__(self, "_cache_owner_path", path[: chain.index(owner)])
        try:
            caches = make_prompt_cache(owner)
        except Exception as e:  # noqa: BLE001 - a model whose caches cannot be built is refused, with why
            raise UnsupportedModelError(f"{model_type}: its caches cannot be built ({e})") from None
        kinds = [_cache_kind(c, i, model_type) for i, c in enumerate(caches)]
        tcfg = text_config(config)
        for i, w in enumerate(config_windows(tcfg, len(kinds))):
            if type(kinds[i]) is FullAttention and w:
                kinds[i] = SlidingWindow(w)
        object.__setattr__(self, "_kinds", kinds)
        _patch_modules()
        self.num_layers = len(lm.layers) if hasattr(lm, "layers") else len(caches)
        specs, vocab = self._probe()
        object.__setattr__(self, "layer_specs", specs)
        self.args = EngineArgs(
            model_type=model_type,
            num_hidden_layers=self.num_layers,
            vocab_size=vocab,
            max_position_embeddings=tcfg.get("max_position_embeddings") or tcfg.get("max_seq_len")
            or tcfg.get("n_positions") or tcfg.get("seq_length") or 4096,
        )

    # -- the module tree ------------------------------------------------------
    @property
    def _text(self) -> nn.Module:
        node = self.lm
        for name in self._text_path:
            node = getattr(node, name)
        return node

    @property
    def layers(self) -> list[nn.Module]:
        return self.lm.layers

    def _run(self, input_ids: mx.array, forward: _Forward) -> mx.array:
        caches = [PagedLayerCache(forward, i, forward.meta.positions if forward.meta is not None
                                  else mx.arange(input_ids.shape[0], dtype=mx.int32))
                  for i in range(len(self._kinds))]
        _state.forward = forward
        try:
            inner = _resolve(self._text, ".".join(self._inner_path))
            if self._inner_takes_mask:  # e.g. phixtral's decoder: (x, mask, cache)
                return inner(input_ids[:, None], mask=None, cache=caches)
            return inner(input_ids[:, None], cache=caches)
        finally:
            _state.forward = None

    def _probe(self) -> tuple[list[LayerKV], int]:
        """One forward of two tokens, built but never evaluated: each cache's K/V shapes,
        the vocabulary, and the checks that the paged path computes what mlx-lm would."""
        name = type(self.lm).__module__.rsplit(".", 1)[-1]
        f = _Forward(meta=None)
        ids = mx.array([1, 2], dtype=mx.int32)
        try:
            hidden = self._run(ids, f)
            if not isinstance(hidden, mx.array) or hidden.ndim != 3 or hidden.shape[:2] != (2, 1):
                raise UnsupportedModelError(f"{name}: its inner model does not return hidden states [T, 1, D]")
            vocab = self.logits(hidden[:, 0, :]).shape[-1]
        except UnsupportedModelError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the model's code raises is the reason
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UnsupportedModelError(f"{name}: its forward fails on paged caches ({msg})") from None
        if f.problems:
            raise UnsupportedModelError(f"{name}: {f.problems[0]}")
        n = len(self._kinds)
        for i in range(n):
            w = f.writes.get(i, [])
            if len(w) != 1:
                raise UnsupportedModelError(f"{name}: cache {i} is written {len(w)} times in one forward (once "
                                            "expected): K/V the paged cache would keep wrong")
        if len(f.calls) != self.num_layers or set(f.calls) != set(range(n)):
            raise UnsupportedModelError(
                f"{name}: {self.num_layers} layers but {len(f.calls)} attention calls through mlx-lm's "
                "scaled_dot_product_attention over the caches (attention computed by hand or over K/V "
                "that bypass the cache is not something the paged cache can serve)")
        specs = []
        for i, kind in enumerate(self._kinds):
            (k, v, _), = f.writes[i]
            if len(k) != 4 or k[0] != 2 or k[2] != 1 or v[:3] != k[:3]:
                raise UnsupportedModelError(f"{name}: cache {i} is written K {k} / V {v}, not [T, heads, 1, d]")
            specs.append(LayerKV(kind, num_kv_heads=k[1], head_dim=k[3], v_head_dim=v[3]))
        return specs, vocab

    # -- the interface -----------------------------------------------------------
    def __call__(self, input_ids: mx.array, meta: AttentionMetadata) -> mx.array:
        return self._run(input_ids, _Forward(meta=meta))[:, 0, :]

    def logits(self, hidden: mx.array) -> mx.array:
        # An instance attribute shadows the inner model child for this call only.
        text = self._text
        parent = _resolve(text, ".".join(self._inner_path[:-1]))
        name = self._inner_path[-1]
        object.__setattr__(parent, name, _GivenHidden(getattr(parent, name), hidden[:, None, :]))
        try:
            out = text(mx.zeros((hidden.shape[0], 1), dtype=mx.int32))
        finally:
            object.__delattr__(parent, name)
        return out[:, 0, :]

    def kv_dtype(self) -> mx.Dtype:
        """What K/V come out of the projections in (the loaded weights' activations)."""
        f = _Forward(meta=None)
        self._run(mx.array([1, 2], dtype=mx.int32), f)
        return f.writes[0][0][2]

    def reference_logits(self, tokens: list[int], chunks: list[int]) -> mx.array:
        """mlx-lm's own forward (its caches, its attention): logits at every position of
        `tokens`, fed in `chunks`. The engine compares its paged forward with it at load."""
        from mlx_lm.models.cache import make_prompt_cache

        cache, outs, pos = make_prompt_cache(_resolve(self.lm, ".".join(self._cache_owner_path))), [], 0
        for n in chunks:
            outs.append(self.lm(mx.array([tokens[pos : pos + n]]), cache=cache)[0])
            pos += n
        return mx.concatenate(outs, axis=0).astype(mx.float32)

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
        raise UnsupportedModelError(REFUSED[model_type])
    if "kv_lora_rank" in text_config(config):
        raise UnsupportedModelError(MLA)
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
    except (ValueError, ImportError, SystemExit) as e:  # olmo's module exits when ai2-olmo is missing
        raise UnsupportedModelError(str(e) if isinstance(e, ValueError) else
                                    f"mlx-lm's module for it cannot be imported here ({type(e).__name__})") from None
    try:
        lm = model_class(args_class.from_dict(config))
    except Exception as e:  # noqa: BLE001 - a config mlx-lm's class cannot take
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UnsupportedModelError(f"mlx-lm's {model_class.__module__} cannot build this config ({msg})") from None
    return MlxLmModel(lm, config)


def mlx_lm_model_types() -> list[str]:
    """Every model_type mlx-lm implements: its model files and its remapped aliases."""
    import os

    from mlx_lm import models
    from mlx_lm.utils import MODEL_REMAPPING

    files = {f[:-3] for f in os.listdir(os.path.dirname(models.__file__))
             if f.endswith(".py") and not f.startswith("_")}
    files -= {"base", "cache", "activations", "rope_utils", "switch_layers", "pipeline", "bitlinear_layers", "mla",
              "ssm", "gated_delta"}
    return sorted(files | set(MODEL_REMAPPING))


def import_model_module(model_type: str) -> Any:
    from mlx_lm.utils import MODEL_REMAPPING

    return importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
