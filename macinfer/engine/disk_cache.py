"""The prefix cache's second tier: evicted blocks and state snapshots go to the disk, and
a prefix that misses in memory continues there (`kv/disk_tier.py` keeps the files).

- **Out.** A cached block taken for reuse (`BlockPool.take`) or a state snapshot evicted
  (`StateGroup`) is queued here by id. Before the pools are next written (the step's first
  K/V write, a restore, a state update: `KVCache.before_write`, `StatePool.before_write`)
  the queued blocks are copied out in one gather per pool array, evaluated, and handed to
  the store's writer thread. The pool is not copied whole and the disk is never waited on.
- **In.** `BlockManager.match_prefix` asks `has_block` / `has_state` while it looks for the
  longest hit, reads the records of the blocks memory lacks (`read`: checksummed; a bad
  one shortens the hit), and the attach writes them into freshly taken blocks.
- **At close** (shutdown, unload) every block and snapshot still in memory is written, so
  the cache survives a restart.

Keys: `{group}-{hash}` for blocks, `s-{hash}` for snapshots. The hash chain starts from the
model's identity and folds in the request's isolation salt, so a record is only ever
found by a request that could have shared the block in memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import mlx.core as mx
import numpy as np

from macinfer.kv.disk_tier import DiskStore

log = logging.getLogger("macinfer.kv")

FORMAT = "macinfer-kv-disk-3"  # 3: int8 KV in a row's widest group (older records are misses)
_FLUSH_CHUNK = 128  # blocks copied out at a time at close (bounds the memory a flush takes)


def _storable(a: mx.array) -> mx.array:
    """NumPy has no bfloat16: such arrays travel as their bits."""
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a


def fingerprint(source: str) -> str:
    """The weights' identity without reading them all: each weight file's name, size,
    first and last 64 KiB, and the config."""
    h = hashlib.blake2b(digest_size=16)
    files = [source] if os.path.isfile(source) else sorted(
        os.path.join(source, f) for f in os.listdir(source)
        if f.endswith((".safetensors", ".gguf", ".npz")) or f == "config.json")
    for path in files:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 16))
            if size > 1 << 17:
                f.seek(-(1 << 16), os.SEEK_END)
                h.update(f.read())
    return h.hexdigest()


def identity(source: str, model: Any, kv_cache: Any, block_size: int, config: dict | None = None,
             layer_specs: Any = None) -> str:
    """What a record's bytes depend on: the weights, the model's config as loaded (RoPE kind
    and parameters, `--rope-scaling` and the length it stretches to included), the cache
    layout (kinds, windows, sharing), its dtypes (a quantized one's group size) and the block size."""
    parts = [FORMAT, fingerprint(source), repr(model.args), repr(config or {}),
             repr(layer_specs), str(kv_cache.dtype), kv_cache.kv_cache_dtype, str(kv_cache.group), str(block_size),
             repr(kv_cache.layers), repr([(g.kind, g.caches) for g in kv_cache.groups])]
    if kv_cache.states is not None:
        parts.append(repr([(s.shapes, s.dtypes) for s in kv_cache.states.specs]))
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=12).hexdigest()


class DiskCache:
    def __init__(self, store: DiskStore, kv_cache: Any, block_size: int, identity: str = ""):
        self.store, self.kv, self.block_size, self.identity = store, kv_cache, block_size, identity
        self.pending: list[tuple[str, int, int]] = []  # (key, group or -1 for state, block id or slot)
        self.hit_tokens = 0  # prompt tokens whose K/V came back from the disk
        kv_cache.before_write = self.save_pending
        kv_cache.on_reset = self.pending.clear  # a failed step's pools hold nothing to save
        if kv_cache.states is not None:
            kv_cache.states.before_write = self.save_pending

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    # -- keys --------------------------------------------------------------------------
    @staticmethod
    def block_key(group: int, h: bytes) -> str:
        return f"{group}-{h.hex()}"

    @staticmethod
    def state_key(h: bytes) -> str:
        return f"s-{h.hex()}"

    def has_block(self, group: int, h: bytes) -> bool:
        return self.block_key(group, h) in self.store

    def has_state(self, h: bytes) -> bool:
        return self.state_key(h) in self.store

    # -- out ---------------------------------------------------------------------------
    def evicted_block(self, group: int, block_id: int, h: bytes) -> None:
        key = self.block_key(group, h)
        if self.store.enabled and key not in self.store:
            self.pending.append((key, group, block_id))

    def evicted_state(self, slot: int, h: bytes) -> None:
        key = self.state_key(h)
        if self.store.enabled and key not in self.store:
            self.pending.append((key, -1, slot))

    def _block_arrays(self, group: int) -> list[tuple[mx.array, int]]:
        """Every pool array of the group's caches, with its rows per block."""
        out = []
        for i in self.kv.groups[group].caches:
            out.extend(self.kv.pool(i).block_arrays())
        return out

    def save_pending(self) -> None:
        """Copy the queued blocks and snapshots out of the pools (one gather per array)
        and hand them to the writer. Runs before the pools are next written."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        by_group: dict[int, list[tuple[str, int]]] = {}
        for key, group, idx in pending:
            by_group.setdefault(group, []).append((key, idx))
        copies: list[tuple[list[tuple[str, int]], list[mx.array], list[int]]] = []
        for group, items in by_group.items():
            ids = mx.array([idx for _, idx in items], dtype=mx.int32)
            if group < 0:  # state snapshots: every state array's slots
                self.kv.states.flush_slots({idx for _, idx in items})
                arrays = [_storable(a[ids]) for a in self.kv.states.slot_arrays()]
                copies.append((items, arrays, [1] * len(arrays)))
                continue
            arrays, rows = [], []
            for a, r in self._block_arrays(group):
                index = (ids[:, None] * r + mx.arange(r, dtype=mx.int32)[None]).reshape(-1)
                arrays.append(_storable(a[index]))
                rows.append(r)
            copies.append((items, arrays, rows))
        mx.eval([a for _, arrays, _ in copies for a in arrays])
        for items, arrays, rows in copies:
            host = [np.asarray(a) for a in arrays]
            for j, (key, _) in enumerate(items):
                self.store.put(key, [h[j * r:(j + 1) * r] for h, r in zip(host, rows)])

    def flush(self, block_manager: Any, timeout: float = 60.0) -> None:
        """Write every cached block and snapshot memory holds (at shutdown or unload)."""
        if not self.store.enabled:
            return
        for group in block_manager.groups:
            items = group.disk_entries(self)
            for start in range(0, len(items), _FLUSH_CHUNK):
                self.pending.extend(items[start:start + _FLUSH_CHUNK])
                self.save_pending()
                self.store.flush(timeout)
        self.store.flush(timeout)

    # -- in ----------------------------------------------------------------------------
    def read_block(self, group: int, h: bytes) -> list[np.ndarray] | None:
        """The block's arrays, checked against the pools' shapes; None if absent or bad."""
        arrays = self.store.get(self.block_key(group, h))
        if arrays is None:
            return None
        want = self._block_arrays(group)
        if len(arrays) != len(want) or any(x.shape != (r, *a.shape[1:]) or x.dtype.itemsize != a.itemsize
                                           for x, (a, r) in zip(arrays, want)):
            log.warning("KV disk tier: record %s does not fit this model's pools; dropped", self.block_key(group, h))
            self.store._forget(self.block_key(group, h), delete=True)
            return None
        return arrays

    def read_state(self, h: bytes) -> list[np.ndarray] | None:
        arrays = self.store.get(self.state_key(h))
        if arrays is None:
            return None
        want = self.kv.states.slot_arrays()
        if len(arrays) != len(want) or any(x.shape != (1, *a.shape[1:]) or x.dtype.itemsize != a.itemsize
                                           for x, a in zip(arrays, want)):
            log.warning("KV disk tier: record %s does not fit this model's state; dropped", self.state_key(h))
            self.store._forget(self.state_key(h), delete=True)
            return None
        return arrays

    def restore_blocks(self, group: int, blocks: list[tuple[int, list[np.ndarray]]]) -> None:
        """Write records into freshly taken blocks (after the evictions those takes queued)."""
        self.save_pending()
        for a_index, (a, r) in enumerate(self._block_arrays(group)):
            ids = mx.array([bid for bid, _ in blocks], dtype=mx.int32)
            index = (ids[:, None] * r + mx.arange(r, dtype=mx.int32)[None]).reshape(-1)
            values = mx.array(np.concatenate([rec[a_index] for _, rec in blocks]))
            a[index] = values.view(a.dtype) if values.dtype != a.dtype else values

    def restore_state(self, slot: int, record: list[np.ndarray]) -> None:
        self.save_pending()
        self.kv.states.flush_slots({slot})
        arrays = self.kv.states.slot_arrays()
        for a, x in zip(arrays, record):
            v = mx.array(x)
            a[slot:slot + 1] = v.view(a.dtype) if v.dtype != a.dtype else v

    def close(self) -> None:
        """End the store's writer thread (after what is queued is written)."""
        self.store.close()

    def stats(self) -> dict:
        return {**self.store.stats(), "hit_tokens": self.hit_tokens}


def disk_cache_for(engine: Any) -> DiskCache:
    """The prefix cache's disk tier of a loading engine: records under the model's
    identity, so blocks are only ever found by the same weights, arguments and layout."""
    from macinfer.kv.disk_tier import default_dir

    cfg = engine.config
    if not cfg.enable_prefix_caching:
        raise ValueError("--kv-disk-gb keeps the prefix cache on disk: it needs prefix caching on")
    if engine.dist is not None:
        raise ValueError("--kv-disk-gb is not supported with --distributed yet")
    # A GGUF's vision projector is a file of its own: image blocks depend on it too.
    projector = getattr(engine.vision, "projector", None)
    key = identity(engine.loaded.source, engine.model, engine.kv_cache, cfg.block_size,
                   {**engine.loaded.config, **({"mmproj": fingerprint(projector)} if projector else {})},
                   engine.layer_specs)
    store = DiskStore(cfg.kv_disk_dir or default_dir(), key, int(cfg.kv_disk_gb * 2**30))
    return DiskCache(store, engine.kv_cache, cfg.block_size, key)
