"""mlx-lm's recurrent layers on the state pool: the stand-in cache and the regrouping.

A hybrid or recurrent model's `make_cache()` gives its recurrent layers an
`ArraysCache` (conv window, SSM / linear-attention state). During our forward each
is a `PagedStateCache`. The module that receives it (Gated DeltaNet, a Mamba mixer,
a short convolution, RWKV's time and channel mixing: found by `trace_receivers`
at load, the innermost module called with it) is wrapped: inside our forward, its
`[T, 1, D]` flat rows are regrouped into the step plan's dense `[n, L, D]` calls
(`kv/state.py`), each run with a real `ArraysCache` holding the sequences' states
gathered from their slots, and the new states are scattered back. Everything
outside those modules (norms, MLPs, MoE, attention) runs on the flat rows as for
any model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from macinfer.lora import layers as lora
from macinfer.kv.state import StateCall, StatePlan
from macinfer.models.paged_layers import PagedLayerCache, _active


class PagedStateCache:
    """Stands in for one of mlx-lm's `ArraysCache`s during one forward pass. Outside its
    receiving module it is only passed along: the tracer (`forward.tracing`) lets the
    module read and write it as an empty cache to see who does, and any read or write
    in the probe after wrapping (`forward.state_touched`) refuses the model."""

    def __init__(self, forward: Any, index: int, size: int):
        self.forward, self.index, self.size = forward, index, size
        self.cache: list[mx.array | None] = [None] * size
        self.lengths = self.left_padding = None

    def __getitem__(self, i: int) -> mx.array | None:
        self.forward.state_touched.add(self.index)
        return self.cache[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.forward.state_touched.add(self.index)
        self.cache[i] = value

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # calls are dense (no padding): nothing to mask

    # mlx-vlm's ArraysCache API (its modules hand the cache the update), no history kept.
    def update_window(self, index: int, source: mx.array, width: int, *, lengths: Any = None) -> mx.array:
        self[index] = state = source[:, source.shape[1] - int(width):]
        return state

    def update_recurrent(self, index: int, length: int, update: Any) -> tuple[mx.array, mx.array]:
        output, state = update(self[index], None)[:2]
        self[index] = state
        return output, state

    def advance(self, n: int) -> None:
        pass

    def __bool__(self) -> bool:
        return True


class CacheListStandIn(list):
    """Stands in for mlx-lm's `CacheList` (e.g. Falcon-H1: a state and K/V per layer)."""

    @property
    def caches(self) -> list:
        return list(self)


def _stand_ins(args: tuple, kwargs: dict) -> tuple[list[PagedStateCache], bool]:
    """The state stand-ins passed directly, and whether K/V stand-ins are passed too."""
    states, kv = [], False
    for a in (*args, *kwargs.values()):
        if isinstance(a, PagedStateCache):
            states.append(a)
        elif isinstance(a, PagedLayerCache) or (isinstance(a, CacheListStandIn)
                                                and any(isinstance(c, PagedLayerCache) for c in a)):
            kv = True
    return states, kv


class _Frame:
    def __init__(self, states: list[int]):
        self.states, self.inner = set(states), set()


def trace_receivers(model: Any, run: Any) -> tuple[dict[int, set[type]], list[str]]:
    """Run `run()` (a probe forward) with every module class of `model` traced: the
    innermost module class each state cache is passed to, and what cannot be regrouped."""
    classes = {type(m) for m in model.modules()}
    saved = {cls: cls.__dict__.get("__call__") for cls in classes}
    stack: list[_Frame] = []
    receivers: dict[int, set[type]] = {}
    problems: list[str] = []

    def traced(original):
        def __call__(self, *args, **kwargs):
            states, kv = _stand_ins(args, kwargs)
            frame = _Frame([s.index for s in states])
            stack.append(frame)
            try:
                return original(self, *args, **kwargs)
            finally:
                stack.pop()
                for s in frame.states - frame.inner:  # the innermost module given this state
                    if kv:
                        problems.append(f"state cache {s} and K/V are used by one module ({type(self).__name__}), "
                                        "which the paged path cannot regroup")
                    receivers.setdefault(s, set()).add(type(self))
                if stack:
                    stack[-1].inner |= frame.states | frame.inner
        return __call__

    for cls in classes:
        cls.__call__ = traced(cls.__call__)
    try:
        run()
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.__call__
            else:
                cls.__call__ = original
    return receivers, problems


_patched: set[type] = set()


def _regroup(a: Any, call: StateCall, T: int, positions: mx.array) -> Any:
    if a is positions:  # a RoPE offset (Bailing's linear attention): each sequence's first position
        return a[call.rows].reshape(call.n, call.length)[:, 0]
    if isinstance(a, mx.array) and a.ndim >= 2 and a.shape[0] == T and a.shape[1] == 1:
        if call.n == 1 and call.length == T:
            return a.reshape(1, T, *a.shape[2:])
        return a[call.rows].reshape(call.n, call.length, *a.shape[2:])
    return a


def _flat(a: Any, call: StateCall) -> Any:
    if isinstance(a, mx.array) and a.ndim >= 2 and a.shape[:2] == (call.n, call.length):
        return a.reshape(call.n * call.length, 1, *a.shape[2:])
    return None


def _combine(outs: list[tuple[Any, StateCall]], plan: StatePlan) -> Any:
    first = outs[0][0]
    if isinstance(first, tuple):
        return tuple(_combine([(o[i], c) for o, c in outs], plan) for i in range(len(first)))
    flat = [_flat(o, c) for o, c in outs]
    if any(f is None for f in flat):
        return first  # not per-token (None, a scalar): the first call's
    y = flat[0] if len(flat) == 1 else mx.concatenate(flat, axis=0)
    return y if plan.inverse is None else y[plan.inverse]


def _arrays_cache_class(cls: type) -> type:
    if cls.__module__.startswith("mlx_vlm."):
        from mlx_vlm.models.cache import ArraysCache
    else:
        from mlx_lm.models.cache import ArraysCache
    return ArraysCache


def patch_receiver(cls: type) -> None:
    """Wrap a recurrent module class: inside our forward, run on the step plan's calls."""
    if cls in _patched:
        return
    original = cls.__call__

    def __call__(self, *args, **kwargs):
        f = _active()
        states, _ = _stand_ins(args, kwargs)
        if f is None or not states or f.tracing:
            return original(self, *args, **kwargs)
        # the receiving module's own package's cache class (mlx-vlm's has an API of its own)
        ArraysCache = _arrays_cache_class(cls)  # noqa: N806
        stand_in = states[0]
        plan = f.state_plan
        pool = None if f.meta is None else f.meta.kv_cache.states
        T = f.positions.shape[0]
        outs = []
        for calls in plan.rounds:
            for call in calls:
                cache = ArraysCache(stand_in.size)
                if not call.fresh and pool is not None:
                    cache.cache = pool.gather(stand_in.index, call)
                before = list(cache.cache)

                def swap(a):
                    return cache if a is stand_in else _regroup(a, call, T, f.positions)

                # (its projections see this call's rows: their LoRA slots follow them)
                slots = lora.current()
                with lora.rows(None if slots is None or call.rows is None else slots[call.rows]):
                    y = original(self, *[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
                outs.append((y, call))
                # Only what this module wrote: RWKV's channel mixing keeps one entry, its time
                # mixing two, each in its own wrapped call (a snapshot taken by each).
                new = [None if v is b else v for v, b in zip(cache.cache, before)]
                if pool is None:  # the probe: what one sequence's state is
                    for e, v in enumerate(new):
                        if v is not None:
                            f.state_shapes.setdefault(stand_in.index, {})[e] = (tuple(v.shape), v.dtype)
                    continue
                pool.scatter(stand_in.index, call, new)
                for j, dst in call.saves:
                    pool.write(stand_in.index, dst, [None if v is None else v[j : j + 1] for v in new])
        return _combine(outs, plan)

    cls.__call__ = __call__
    _patched.add(cls)
