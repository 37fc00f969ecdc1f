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
  dispatcher (`paged_layers.py`): for a `PagedLayerCache`, or K/V that one handed out (a layer reading
  another layer's K/V: Gemma 3n/4, AFM), it runs the paged attention over that
  cache's blocks, with the cache's kind (window, chunk) applied; for anything else
  it is mlx-lm's own function, so mlx-lm keeps working in the same process.
- The LM head runs only on the rows that sample a token: the text model's head
  (tied embeddings, soft-capping, logit scales) is applied to given hidden states
  by swapping its inner model for a stand-in during the call.

What each cache is comes from the model itself, at load, by a probe forward that
is never evaluated (`cache_probe.py`) (MLX is lazy: shapes without compute): the kind from mlx-lm's
own `make_cache()` entry, K/V heads and head sizes from what each layer writes.
The probe also refuses, with the reason, what the paged path could only run
wrong: a cache that is not K/V rows (recurrent state, MLA latents), a cache
written more or less than once, an attention computed by hand or over K/V
changed after the cache (the replaced function never sees the right keys), a
mask the model built itself.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv.attention import AttentionMetadata
from macinfer.kv.spec import FullAttention, PromptAndWindow, SlidingWindow, StateSpec
from macinfer.lora.layers import rows as lora_rows
from macinfer.kv.state import probe_plan
from macinfer.models.mlx_lm_classes import REFUSED, config_prompt_window, config_windows, instantiate, text_config
from macinfer.models.family_routes import patch_modules
from macinfer.models.paged_layers import Forward, PagedLayerCache, UnsupportedModelError, set_active
from macinfer.models.cache_probe import CacheProbe, template
from macinfer.models.paged_state import CacheListStandIn, PagedStateCache


@dataclass
class EngineArgs:
    """What the engine needs to validate requests (cache shapes: `layer_specs`)."""
    model_type: str
    num_hidden_layers: int
    vocab_size: int  # the logits' width
    max_position_embeddings: int
    # Token ids a prompt may hold, where the embedding has rows past the output head's (Molmo
    # 2's image tokens): None when it is `vocab_size`.
    input_vocab_size: int | None = None


def _resolve(node: Any, path: str) -> Any:
    for name in filter(None, path.split(".")):
        node = getattr(node, name, None)
    return node


class _GivenHidden:
    """A module's stand-in for one call that hands back given arrays: the inner model while the
    outer model's head runs on given states, or the token embedding while images are spliced."""

    def __init__(self, inner: nn.Module, hidden: mx.array):
        self._inner, self._hidden = inner, hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # e.g. embed_tokens for tied heads


def _logits_of(out: Any) -> mx.array:
    """Logits from a model's output (mlx-vlm's language models return a LanguageModelOutput)."""
    return getattr(out, "logits", out)


class MlxLmModel(CacheProbe, nn.Module):
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
        # What images are spliced into (mlx-lm's keyword; mlx-vlm's language models': inputs_embeds)
        self._embeddings_keyword = next((k for k in ("input_embeddings", "inputs_embeds") if k in params), None)
        self.image_pad_id: int | None = None  # set with the image path (`engine/images.py`)
        self.token_embed_scale = 1.0  # likewise
        from mlx_lm.models.cache import make_prompt_cache

        # The innermost make_cache (a wrapper may not pass its text model's on).
        chain = [lm] + [_resolve(lm, ".".join(path[: i + 1])) for i in range(len(path))]
        owner = next((m for m in reversed(chain) if hasattr(m, "make_cache")), lm)
        object.__setattr__(self, "_cache_owner_path", path[: chain.index(owner)])
        try:
            caches = make_prompt_cache(owner)
        except Exception as e:  # noqa: BLE001 - a model whose caches cannot be built is refused, with why
            raise UnsupportedModelError(f"{model_type}: its caches cannot be built ({e})") from None
        kinds, state_sizes = [], []
        templates = [template(c, kinds, state_sizes, model_type) for c in caches]
        tcfg = text_config(config)
        recent = config_prompt_window(tcfg)
        for t, w in zip(templates, config_windows(tcfg, len(templates))):
            if isinstance(t, tuple) and t[0] == "kv" and type(kinds[t[1]]) is FullAttention and (w or recent):
                kinds[t[1]] = PromptAndWindow(recent) if recent else SlidingWindow(w)
        object.__setattr__(self, "_kinds", kinds)
        object.__setattr__(self, "_templates", templates)
        object.__setattr__(self, "_state_sizes", state_sizes)
        patch_modules()
        object.__setattr__(self, "mla_projections", None)
        self.modules_final()
        self.num_layers = len(lm.layers) if hasattr(lm, "layers") else len(caches)
        # Layers whose only cache is recurrent state make no attention call.
        self._num_state_only = sum(isinstance(t, tuple) and t[0] == "state" for t in templates)
        # Multi-head latent attention: the rope key's width marks the caches that hold latents.
        margs = getattr(text, "args", None) or getattr(lm, "args", None)
        mla = {k: getattr(margs, k, None) or tcfg.get(k) for k in ("kv_lora_rank", "qk_rope_head_dim")}
        self._mla_rope = mla["qk_rope_head_dim"] if mla["kv_lora_rank"] else None
        specs, layer_caches, vocab = self._probe()
        object.__setattr__(self, "layer_specs", specs)
        object.__setattr__(self, "layer_caches", layer_caches)
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

    @property
    def text_model(self) -> nn.Module:
        """mlx-lm's language model (inside a vision-language wrapper): what `shard()` is on."""
        return self._text

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """The inner model's list of decoder layers (the list itself: pipeline stages edit it)."""
        return _resolve(self._text, ".".join(self._inner_path)).layers

    def reprobe(self) -> None:
        """The caches' shapes again, after the module tree changed (a tensor-parallel shard)."""
        specs, layer_caches, _ = self._probe()
        object.__setattr__(self, "layer_specs", specs)
        object.__setattr__(self, "layer_caches", layer_caches)
        self.modules_final()

    def _run(self, input_ids: mx.array, forward: Forward) -> mx.array:
        forward.positions = forward.meta.positions if forward.meta is not None \
            else mx.arange(input_ids.shape[0], dtype=mx.int32)
        forward.mla_rope, forward.mla_unembed = self._mla_rope, self._mla_unembed
        if forward.state_plan is None and self._state_sizes:  # the probe: the rows are one sequence
            forward.state_plan = probe_plan(input_ids.shape[0])

        def stand_in(t):
            if isinstance(t, list):
                return CacheListStandIn(stand_in(x) for x in t)
            if t[0] == "state":
                return PagedStateCache(forward, t[1], self._state_sizes[t[1]])
            return PagedLayerCache(forward, t[1], forward.positions)

        caches = [stand_in(t) for t in self._templates]
        set_active(forward)
        try:
            inner = _resolve(self._text, ".".join(self._inner_path))
            if self._inner_takes_mask:  # e.g. phixtral's decoder: (x, mask, cache)
                return inner(input_ids[:, None], mask=None, cache=caches)
            meta = forward.meta
            if meta is not None and meta.image_rows is not None:  # image features in place of their tokens
                embed = self.embed_module()
                h = embed(input_ids)
                if self.token_embed_scale != 1.0:  # what the decoder does to token rows, not to given ones
                    h = h * self.token_embed_scale
                h[meta.image_rows] = meta.image_features.astype(h.dtype)
                if self.image_pad_id is not None:  # ids read beside the embeddings (per-layer inputs)
                    input_ids = mx.array(input_ids)
                    input_ids[meta.image_rows] = self.image_pad_id
                if self._embeddings_keyword:
                    return inner(input_ids[:, None], cache=caches, **{self._embeddings_keyword: h[:, None, :]})
                # A model that takes no embeddings (mlx-lm's Cohere2, Nemotron-H): its embedding
                # hands back these rows for this call (an instance attribute shadows the child).
                name = next(n for n in ("embed_tokens", "embeddings", "word_embeddings")
                            if getattr(inner, n, None) is embed)
                object.__setattr__(inner, name, _GivenHidden(embed, h[:, None, :]))
                try:
                    return inner(input_ids[:, None], cache=caches)
                finally:
                    object.__delattr__(inner, name)
            return inner(input_ids[:, None], cache=caches)
        finally:
            set_active(None)

    # -- the interface -----------------------------------------------------------
    def embed_module(self) -> nn.Module | None:
        """The token embedding images are spliced beside (None: this model cannot take
        embeddings in place of tokens)."""
        inner = _resolve(self._text, ".".join(self._inner_path))
        # (its own, or its decoder's under a wrapper that passes embeddings on: Gemma 3n's)
        embed = getattr(inner, "embed_tokens", None) or getattr(getattr(inner, "language_model", None),
                                                                 "embed_tokens", None)
        for name in ("embeddings", "word_embeddings"):  # (Nemotron-H's, Bailing's names for it)
            if embed is None and isinstance(getattr(inner, name, None), nn.Embedding):
                embed = getattr(inner, name)
        return embed if isinstance(embed, nn.Module) and not self._inner_takes_mask else None

    def embed_scale(self) -> float:
        """What the decoder multiplies its token embeddings by (Gemma's sqrt(hidden); else 1)."""
        return float(getattr(_resolve(self._text, ".".join(self._inner_path)), "embed_scale", 1.0))

    def __call__(self, input_ids: mx.array, meta: AttentionMetadata) -> mx.array:
        with lora_rows(meta.lora_slots):
            return self._run(input_ids, Forward(meta=meta, state_plan=meta.state))[:, 0, :]

    def logits(self, hidden: mx.array) -> mx.array:
        # An instance attribute shadows the inner model child for this call only.
        text = self._text
        parent = _resolve(text, ".".join(self._inner_path[:-1]))
        name = self._inner_path[-1]
        object.__setattr__(parent, name, _GivenHidden(getattr(parent, name), hidden[:, None, :]))
        try:
            out = _logits_of(text(mx.zeros((hidden.shape[0], 1), dtype=mx.int32)))
        finally:
            object.__delattr__(parent, name)
        return out[:, 0, :]

    def kv_dtype(self) -> mx.Dtype:
        """What K/V come out of the projections in (the loaded weights' activations)."""
        if getattr(self, "_fixed", None):
            return self._fixed[0]
        f = Forward(meta=None)
        hidden = self._run(mx.array([1, 2], dtype=mx.int32), f)
        return f.writes[min(f.writes)][0][2] if f.writes else hidden.dtype

    def fix_cache_shapes(self) -> None:
        """Keep the caches' dtype and state shapes as they are now: a pipeline stage runs only
        some layers, but every rank keeps the same cache plan (`distributed/sharding.py`)."""
        object.__setattr__(self, "_fixed", (self.kv_dtype(), self.state_specs()))

    def state_specs(self) -> list[StateSpec]:
        """Each recurrent cache's per-sequence state, with the loaded weights' dtypes."""
        if getattr(self, "_fixed", None):
            return self._fixed[1]
        if not self._state_sizes:
            return []
        f = Forward(meta=None)
        self._run(mx.array([1, 2], dtype=mx.int32), f)
        return self._state_specs_from(f, self.args.model_type)

    def reference_logits(self, tokens: list[int], chunks: list[int]) -> mx.array:
        """mlx-lm's own forward (its caches, its attention): logits at every position of
        `tokens`, fed in `chunks`. The engine compares its paged forward with it at load."""
        from mlx_lm.models.cache import make_prompt_cache

        cache, outs, pos = make_prompt_cache(_resolve(self.lm, ".".join(self._cache_owner_path))), [], 0
        for n in chunks:
            outs.append(_logits_of(self.lm(mx.array([tokens[pos : pos + n]]), cache=cache))[0])
            mx.eval(outs[-1])  # chunk by chunk: a pipeline stage's sends must go in order
            pos += n
        return mx.concatenate(outs, axis=0).astype(mx.float32)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.lm.sanitize(weights) if hasattr(self.lm, "sanitize") else weights

    def fuse_projections(self) -> None:
        pass

    def modules_final(self) -> None:
        """After the loader swaps modules (quantized or dequantized projections): each MLA
        attention's `embed_q` -> its `unembed_out`, and one layer's pair with the probe's
        dims for timing the expanded form (`kv/mla.py`)."""
        pairs = [(m.embed_q, m.unembed_out) for m in self.lm.modules() if hasattr(m, "embed_q")
                 and hasattr(m, "unembed_out")]
        object.__setattr__(self, "_mla_unembed", {id(e): u for e, u in pairs})
        dims = getattr(self, "_mla_dims", None)
        object.__setattr__(self, "mla_projections", (*pairs[0], dims) if pairs and dims else None)

    def load_weights(self, weights, strict: bool = True):  # mlx-lm's parameter names
        return self.lm.load_weights(weights, strict=strict)

    def weight_names(self) -> list[str]:
        """The names `load_weights` takes (mlx-lm's)."""
        from mlx.utils import tree_flatten

        return [k for k, _ in tree_flatten(self.lm.parameters())]


def build(config: dict[str, Any]) -> MlxLmModel:
    """mlx-lm's class for `config` (its own model_type remapping), uninitialised."""
    model_type = config.get("model_type")
    if model_type in REFUSED:
        raise UnsupportedModelError(REFUSED[model_type])
    return MlxLmModel(instantiate(config), config)
