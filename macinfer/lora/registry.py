"""The adapters an engine serves: each loaded once, at a slot of every layer it adapts
(`layers.BatchedLoRA`), addressed by name, counted while requests use it (an adapter
unloaded in use keeps its slot until they finish), the idle ones evicted least recently
used past `max_loras`. Where the engine fused projections (the hand-written Llama's q/k/v
and gate/up), an adapter's factors apply to their slice of the fused layer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from macinfer.lora.adapter import LoraAdapter, LoraError
from macinfer.lora.layers import BatchedLoRA, BatchedSwitchLoRA, dense_weight, dims, experts, slot_experts, unslot_experts


@dataclass
class _Target:
    path: str  # the layer the factors apply to (mlx-lm's names; a fused layer's own)
    offset: int  # where its outputs start in that layer's (a slice of a fused layer)
    size: int


class LoraRegistry:
    def __init__(self, model: nn.Module, max_loras: int = 8):
        self.root = getattr(model, "lm", model)  # the module tree under mlx-lm's names
        self.max_loras = max_loras
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: dict[str, int] = {}
        self.users: dict[str, int] = {}
        self.last_used: dict[str, float] = {}
        self.retired: set[str] = set()  # unloaded, its slot held until its requests finish
        # The model's own adapters (Phi-4 multimodal's vision LoRA, `vision/modality_lora.py`):
        # never evicted, never a served name; the engine picks them for a request itself.
        self.own: set[str] = set()
        self._targets: dict[str, dict[str, _Target]] = {}  # adapter -> its module -> target
        self._wrapped: dict[str, BatchedLoRA] = {}
        self._slots_stacked = 1  # slots every adapted layer's stacks hold (a row's slot must be one)

    # -- names ---------------------------------------------------------------------
    def names(self) -> list[str]:
        return [n for n in self.adapters if n not in self.retired and n not in self.own]

    def __contains__(self, name: str) -> bool:
        return name in self.adapters and name not in self.retired and name not in self.own

    def add(self, adapter: LoraAdapter, own: bool = False) -> None:
        """Serve `adapter` under its name (replacing an idle one of that name); `own`: the
        model's own (kept loaded, not a served name). Raises LoraError when it does not fit
        the model or no slot is free."""
        if adapter.name in self.own or (own and adapter.name in self.adapters):
            raise LoraError(f"LoRA adapter name {adapter.name!r} is taken by the model's own adapter")
        if adapter.name in self.adapters:
            self.remove(adapter.name)
            if adapter.name in self.adapters:
                raise LoraError(f"LoRA adapter {adapter.name!r} is in use; unload it and wait, or use another name")
        targets = {module: self._target(adapter, self._own_name(module), part)
                   for module, part in adapter.parts.items()}
        if len(self.adapters) >= self.max_loras:
            idle = sorted((t, n) for n, t in self.last_used.items() if not self.users.get(n) and n not in self.own)
            if not idle:
                raise LoraError(f"{self.max_loras} LoRA adapters are loaded and in use (--max-loras)")
            self._free(idle[0][1])
        used = set(self.slots.values())
        slot = next(s for s in range(1, len(used) + 2) if s not in used)
        self.adapters[adapter.name], self.slots[adapter.name] = adapter, slot
        self.users[adapter.name], self.last_used[adapter.name] = 0, time.monotonic()
        self._targets[adapter.name] = targets
        if own:
            self.own.add(adapter.name)
        self._rebuild({t.path for t in targets.values()})

    def remove(self, name: str) -> None:
        """Stop serving `name`; its slot is freed now, or when its last request ends."""
        if name not in self.adapters or name in self.own:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded")
        if self.users.get(name):
            self.retired.add(name)
        else:
            self._free(name)

    # -- requests --------------------------------------------------------------------
    def acquire(self, name: str) -> tuple[int, str]:
        """(slot, content digest) for a new request under `name`."""
        if name not in self and name not in self.own:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded")
        self.users[name] += 1
        self.last_used[name] = time.monotonic()
        return self.slots[name], self.adapters[name].digest

    def release(self, slot: int) -> None:
        name = next((n for n, s in self.slots.items() if s == slot), None)
        if name is None:
            return
        self.users[name] -= 1
        if name in self.retired and not self.users[name]:
            self._free(name)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())

    # -- layers ------------------------------------------------------------------------
    def _free(self, name: str) -> None:
        targets = self._targets.pop(name)
        for table in (self.adapters, self.slots, self.users, self.last_used):
            table.pop(name, None)
        self.retired.discard(name)
        self._rebuild({t.path for t in targets.values()})

    def _resolve(self, path: str) -> tuple[object, str | int, nn.Module | None]:
        """(parent, key, module) of `path` in the model, module None where absent."""
        node: object = self.root
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else getattr(node, key, None)
            if node is None:
                return None, keys[-1], None
        last: str | int = int(keys[-1]) if isinstance(node, list) else keys[-1]
        child = node[last] if isinstance(node, list) and 0 <= int(last) < len(node) else \
            getattr(node, str(last), None) if not isinstance(node, list) else None
        return node, last, child if isinstance(child, nn.Module) else None

    def _own_name(self, module: str) -> str:
        """The module's name in the engine's model. A vision checkpoint's language model is
        named under `language_model.` where mlx-lm wraps it, and alone where the engine runs it
        alone: an adapter trained either way (mlx-vlm's names, or the text model's) finds it."""
        inner = module[len("language_model."):] if module.startswith("language_model.") else None
        for name in (module, inner, None if inner else f"language_model.{module}"):
            if name and (self._resolve(name)[2] is not None or self._resolve(name.rsplit(".", 1)[0])[2] is not None):
                return name
        return module

    def _target(self, adapter: LoraAdapter, module: str, part) -> _Target:
        n_in, n_out = part.a.shape[-2], part.b.shape[-1]
        parent, key, layer = self._resolve(module)
        where = f"LoRA adapter {adapter.name!r}: {module}"
        if layer is not None:
            base = layer.base if isinstance(layer, (BatchedLoRA, BatchedSwitchLoRA)) else layer
            if (experts(base) is not None) != (part.a.ndim == 3) or \
                    (part.a.ndim == 3 and part.a.shape[0] != experts(base)):
                raise LoraError(f"{where}: the adapter's factors ({tuple(part.a.shape)}) do not fit the model's "
                                f"{type(base).__name__} (an adapter for another base model?)")
            shape = dims(base)
            if shape is None:
                raise LoraError(f"{where} is a {type(base).__name__}, not a linear layer (embedding adapters are not "
                                "applied per request)")
            if shape != (n_in, n_out):
                raise LoraError(f"{where}: the adapter's factors are {n_in} -> {n_out}, the model's layer "
                                f"{shape[0]} -> {shape[1]} (an adapter for another base model?)")
            return _Target(module, 0, n_out)
        fused = getattr(parent, "fused_parts", None) or {}
        for fused_name, parts in fused.items():
            offset = 0
            for part, size in parts:
                if part == key:
                    fused_layer = getattr(parent, fused_name)
                    base = fused_layer.base if isinstance(fused_layer, BatchedLoRA) else fused_layer
                    if dims(base)[0] != n_in or size != n_out:
                        raise LoraError(f"{where}: the adapter's factors are {n_in} -> {n_out}, the model's layer "
                                        f"{dims(base)[0]} -> {size} (an adapter for another base model?)")
                    return _Target(module.rsplit(".", 1)[0] + "." + fused_name, offset, size)
                offset += size
        raise LoraError(f"{where}: the model has no such layer (an adapter for another base model?)")

    def _users(self, path: str) -> list:
        return [(self.slots[n], self.adapters[n].parts[m], t) for n, ts in self._targets.items()
                for m, t in ts.items() if t.path == path]

    def _rebuild(self, paths: set[str]) -> None:
        """Stack the factors of every adapter on each of `paths` by slot. When the slot count
        changes, every adapted layer is restacked: a row of a new slot passes layers its own
        adapter does not adapt too (zeros there), and must find its slot in their stacks."""
        n_slots = max(self.slots.values(), default=0) + 1
        if n_slots != self._slots_stacked:
            paths = set(paths) | {t.path for ts in self._targets.values() for t in ts.values()}
            self._slots_stacked = n_slots
        for path in paths:
            users = self._users(path)
            parent, key, layer = self._resolve(path)
            if isinstance(layer, BatchedSwitchLoRA) or (layer is not None and experts(layer) is not None):
                self._rebuild_experts(path.rsplit(".", 1)[0], parent, n_slots)
                continue
            wrapper = layer if isinstance(layer, BatchedLoRA) else None
            if not users:
                if wrapper is not None:  # no adapter left here: the plain layer again
                    self._set(parent, key, wrapper.base)
                    self._wrapped.pop(path, None)
                continue
            if wrapper is None:
                wrapper = BatchedLoRA(layer)
                self._set(parent, key, wrapper)
                self._wrapped[path] = wrapper
            n_in, n_out = dims(wrapper.base)
            ranks: dict[int, int] = {}
            for slot, part, _ in users:
                ranks[slot] = ranks.get(slot, 0) + part.a.shape[1]
            width = max(ranks.values())
            a_rows, b_rows = [], []
            for slot in range(n_slots):
                mine = [(part, t) for s, part, t in users if s == slot]
                a = mx.zeros((n_in, width))
                b = mx.zeros((width, n_out))
                at = 0
                for part, t in mine:
                    r = part.a.shape[1]
                    a[:, at: at + r] = part.a
                    b[at: at + r, t.offset: t.offset + t.size] = part.b
                    at += r
                a_rows.append(a)
                b_rows.append(b)
            wrapper.a, wrapper.b = mx.stack(a_rows), mx.stack(b_rows)
            wrapper.g = self._dora_scale(wrapper.base, users, n_slots, n_out)
            mx.eval(wrapper.a, wrapper.b, *([wrapper.g] if wrapper.g is not None else []))

    def _rebuild_experts(self, parent_path: str, parent: nn.Module, n_slots: int) -> None:
        """Every expert layer of an MoE block (`layers.BatchedSwitchLoRA`), each slot's
        experts' factors at slot * experts + expert; the block plain again when none is left."""
        children = {k: v for k, v in parent.children().items()
                    if isinstance(v, BatchedSwitchLoRA) or (isinstance(v, nn.Module) and experts(v) is not None)}
        users = {k: self._users(f"{parent_path}.{k}") for k in children}
        if not any(users.values()):
            for k, v in children.items():
                if isinstance(v, BatchedSwitchLoRA):
                    setattr(parent, k, v.base)
            unslot_experts(parent)
            return
        for k, layer in children.items():
            wrapper = layer if isinstance(layer, BatchedSwitchLoRA) else BatchedSwitchLoRA(layer, experts(layer))
            setattr(parent, k, wrapper)
            n_exp, (n_in, n_out) = wrapper.experts, dims(wrapper.base)
            if not users[k]:
                wrapper.a = wrapper.b = None
                continue
            width = max(part.a.shape[-1] for _, part, _ in users[k])
            a, b = mx.zeros((n_slots * n_exp, n_in, width)), mx.zeros((n_slots * n_exp, width, n_out))
            for slot, part, _ in users[k]:
                r = part.a.shape[-1]
                a[slot * n_exp: (slot + 1) * n_exp, :, :r] = part.a
                b[slot * n_exp: (slot + 1) * n_exp, :r, :] = part.b
            wrapper.a, wrapper.b = a, b
            mx.eval(a, b)
        slot_experts(parent, wrapper.experts)

    @staticmethod
    def _dora_scale(base: nn.Module, users: list, n_slots: int, n_out: int) -> mx.array | None:
        if all(part.magnitude is None for _, part, _ in users):
            return None
        weight = dense_weight(base)
        g = mx.ones((n_slots, n_out))
        for slot, part, t in users:
            if part.magnitude is None:
                continue
            w = weight[t.offset: t.offset + t.size]
            adapted = w + part.b.T @ part.a.T
            g[slot, t.offset: t.offset + t.size] = part.magnitude / mx.linalg.norm(adapted, axis=1)
        return g

    @staticmethod
    def _set(parent: object, key: str | int, module: nn.Module) -> None:
        if isinstance(parent, list):
            parent[int(key)] = module
        else:
            setattr(parent, str(key), module)
