"""What each of an mlx-lm model's caches is, found at load from the model itself: the kind
from mlx-lm's own `make_cache()` entry (`template`), K/V heads and head sizes from what
each layer writes in a probe forward that is built and never evaluated (MLX is lazy), and
the refusals, with the reason, of what the paged path could only run wrong (`CacheProbe`,
mixed into `MlxLmModel`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from macinfer.kv.spec import ChunkedLocal, FullAttention, LayerKV, SlidingWindow, StateSpec
from macinfer.models.paged_layers import Forward, UnsupportedModelError
from macinfer.models.paged_state import patch_receiver, trace_receivers

_CACHE_MODULES = ("mlx_lm.models.cache", "mlx_vlm.models.cache")  # mlx-vlm keeps classes of its own


def _cache_class(cache: Any) -> str | None:
    """mlx-lm's (or mlx-vlm's same-named) cache class of `cache`, by name; None for another."""
    return type(cache).__name__ if type(cache).__module__ in _CACHE_MODULES else None


def _cache_kind(cache: Any, index: int, model_type: str) -> FullAttention | SlidingWindow | ChunkedLocal:
    kind = _cache_class(cache)
    if kind in ("KVCache", "ConcatenateKVCache"):
        return FullAttention()
    if kind == "RotatingKVCache":
        if cache.keep:
            raise UnsupportedModelError(f"cache {index} is a RotatingKVCache keeping {cache.keep} first tokens "
                                        "(attention sinks by position), which the paged cache does not keep")
        return SlidingWindow(cache.max_size)
    if kind == "ChunkedKVCache":
        return ChunkedLocal(cache.chunk_size)
    raise UnsupportedModelError(f"cache {index} is a {type(cache).__name__}, which the paged cache cannot hold")


def template(cache: Any, kinds: list, states: list[int], model_type: str) -> Any:
    """What stands in for one of mlx-lm's caches: ("kv", K/V cache index), ("state",
    state cache index), or a list of those for a `CacheList`. Fills `kinds` (each K/V
    cache's kind) and `states` (each state cache's entry count)."""
    if _cache_class(cache) == "CacheList":
        return [template(x, kinds, states, model_type) for x in cache.caches]
    if _cache_class(cache) == "ArraysCache":
        states.append(len(cache.cache))
        return ("state", len(states) - 1)
    kinds.append(_cache_kind(cache, len(kinds), model_type))
    return ("kv", len(kinds) - 1)


class CacheProbe:
    """The probe forward and its checks; the model's `_run`, `_kinds`, `_state_sizes`,
    `num_layers`, `_num_state_only`, `lm`, `logits` and `modules_final` are `MlxLmModel`'s."""

    def _probe(self) -> tuple[list[LayerKV], list[int], int]:
        """One forward of two tokens, built but never evaluated: each cache's K/V shapes,
        the vocabulary, and the checks that the paged path computes what mlx-lm would."""
        name = type(self.lm).__module__.rsplit(".", 1)[-1]
        ids = mx.array([1, 2], dtype=mx.int32)
        if self._state_sizes:
            self._wrap_recurrent_modules(name, ids)
        f = Forward(meta=None)
        try:
            hidden = self._run(ids, f)
            if not isinstance(hidden, mx.array) or hidden.ndim != 3 or hidden.shape[:2] != (2, 1):
                raise UnsupportedModelError(f"{name}: its inner model does not return hidden states [T, 1, D]")
            vocab = self.logits(hidden[:, 0, :]).shape[-1]
        except UnsupportedModelError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the model's code raises is the reason
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UnsupportedModelError(f"{name}: its forward fails on this backend with paged caches ({msg})") from None
        if f.problems:
            raise UnsupportedModelError(f"{name}: {f.problems[0]}")
        if f.latent and set(f.mla_dims) == set(f.latent) and not f.premade:
            # Every MLA attention's output went straight to its `unembed_out`: prompt chunks
            # may take the expanded form (`kv/mla.py`); one layer's projections to time it.
            object.__setattr__(self, "_mla_dims", f.mla_dims[min(f.mla_dims)][2])
            self.modules_final()
        if f.state_touched:  # the wrapped modules run on real caches: anything else would read nothing
            raise UnsupportedModelError(
                f"{name}: state cache {min(f.state_touched)} is read or written outside the module it is passed "
                "to, which the paged path cannot regroup by sequence")
        n = len(self._kinds)
        for i in range(n):
            w = f.writes.get(i, [])
            if len(w) != 1:
                raise UnsupportedModelError(f"{name}: cache {i} is written {len(w)} times in one forward (once "
                                            "expected): K/V the paged cache would keep wrong")
        attending = self.num_layers - self._num_state_only
        # Fewer calls than layers only where layers have no cache at all (Nemotron-H's MLP and MoE
        # layers). More are served as they come, each from the cache whose K/V it reads: several
        # attentions a layer (LongCat's, each over its own cache; IQuest-Loop-Coder's second loop,
        # over the first loop's cache and over its own window).
        if len(f.calls) < min(attending, n) or set(f.calls) != set(range(n)):
            raise UnsupportedModelError(
                f"{name}: {attending} attending layers but {len(f.calls)} attention calls through mlx-lm's "
                "scaled_dot_product_attention over the caches (attention computed by hand or over K/V "
                "that bypass the cache is not something the paged cache can serve)")
        specs = []
        for i, kind in enumerate(self._kinds):
            (k, v, _), = f.writes[i]
            if len(k) != 4 or k[0] != 2 or k[2] != 1 or v[:3] != k[:3]:
                raise UnsupportedModelError(f"{name}: cache {i} is written K {k} / V {v}, not [T, heads, 1, d]")
            specs.append(LayerKV(kind, num_kv_heads=k[1], head_dim=k[3], v_head_dim=v[3],
                                 v_in_k=i in f.latent or i in f.v_is_k))
        states = self._state_specs_from(f, name)
        if states:  # a state is fixed bytes a sequence: the same after 3 tokens as after 2
            f3 = Forward(meta=None)
            self._run(mx.array([1, 2, 3], dtype=mx.int32), f3)
            for i, (a, b) in enumerate(zip(states, self._state_specs_from(f3, name))):
                if a != b:
                    raise UnsupportedModelError(
                        f"{name}: state cache {i} changes shape with the tokens seen ({a.describe()} after 2, "
                        f"{b.describe()} after 3: a window still filling up), which a fixed state slot cannot hold")
        object.__setattr__(self, "query_heads", dict(f.query_heads))  # for timing attention paths at load
        return specs, f.calls, vocab  # calls: the cache each layer attended, in layer order

    def _state_specs_from(self, f: Forward, name: str) -> list[StateSpec]:
        state_specs = []
        for i, size in enumerate(self._state_sizes):
            entries = f.state_shapes.get(i, {})
            if sorted(entries) != list(range(size)):
                raise UnsupportedModelError(f"{name}: state cache {i} has {size} entries but its layers write "
                                            f"{sorted(entries)} in a forward")
            shapes = [entries[e] for e in range(size)]
            if any(s[0][0] != 1 for s in shapes):
                raise UnsupportedModelError(f"{name}: state cache {i} is not one state a sequence")
            state_specs.append(StateSpec(tuple(s[0][1:] for s in shapes), tuple(s[1] for s in shapes)))
        return state_specs

    def _wrap_recurrent_modules(self, name: str, ids: mx.array) -> None:
        """Find the module each recurrent state is passed to (a traced probe forward) and
        wrap its class to run on the step's dense calls (`paged_state.py`)."""
        f = Forward(meta=None, tracing=True)
        try:
            receivers, problems = trace_receivers(self.lm, lambda: self._run(ids, f))
        except UnsupportedModelError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the model's code raises is the reason
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UnsupportedModelError(f"{name}: its forward fails on this backend with paged caches ({msg})") from None
        if problems:
            raise UnsupportedModelError(f"{name}: {problems[0]}")
        for i in range(len(self._state_sizes)):
            if i not in receivers:
                raise UnsupportedModelError(
                    f"{name}: state cache {i} is used inside a module that is not given it (e.g. a convolution "
                    "over K/V inside attention), which the paged path cannot regroup by sequence")
        for classes in receivers.values():
            for cls in classes:
                patch_receiver(cls)
