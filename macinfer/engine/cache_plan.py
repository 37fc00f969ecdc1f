"""The memory plan at load: each cache group's pool and the recurrent-state pool, bought
from one budget (`--kv-cache-gb`, or a share of what the machine can give after weights).

- Unbounded groups (full attention) get N blocks; a bounded one (window, chunk) gets
  `min(N, cap) + 1`, cap being every running sequence's live blocks plus a step's.
- Recurrent state (hybrid models): two slots a running sequence (its state and its mark),
  a spare per speculating sequence, and one snapshot per `interval` tokens of cached K/V,
  bought with the blocks; with no K/V at all, what the budget leaves buys snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from macinfer.engine.spec_batch import planned
from macinfer.kernels.backend import Backend
from macinfer.kv.cache import KVCache, layer_bytes_per_block, plan_blocks
from macinfer.kv.spec import CacheGroup, FirstTokens, LayerKV, StateSpec, group_caches, split_first_tokens
from macinfer.kv.state import StatePool

DEFAULT_TOKENS_PER_SEQ = 512  # default KV budget: max_num_seqs x this, or one full context


@dataclass
class CachePlan:
    layer_specs: list[LayerKV]
    state_specs: list[StateSpec]
    groups: list[CacheGroup]
    num_blocks: int  # of the unbounded groups
    interval: int  # tokens between recurrent-state snapshots
    num_verify: int  # state spares for speculating sequences
    kv_cache: KVCache


def snapshot_interval(cfg: Any, groups: list[CacheGroup], slot_bytes: int) -> int:
    """Tokens between recurrent-state snapshots: the configured interval, or where one
    snapshot costs about the K/V of the tokens it spans (256 to 4096)."""
    bs, want = cfg.block_size, cfg.state_snapshot_interval
    if want is not None:
        if want < bs or want % bs:
            raise ValueError(f"state_snapshot_interval must be a multiple of the block size ({bs})")
        return want
    kv_per_token = sum(g.bytes_per_block for g in groups) / bs
    tokens = slot_bytes / kv_per_token if kv_per_token else 1024
    return int(min(max(-(-tokens // bs) * bs, 256), 4096)) // bs * bs or bs


@dataclass(frozen=True)
class Companion:
    """What a drafter with a pool of its own brings to its target's plan: its weights, and
    its K/V pool's bytes when the target's unbounded groups hold n blocks. One budget
    (`--kv-cache-gb`, or the share of free memory) buys both pools."""
    weights: int
    kv_bytes: Callable[[int], int]


def _kv_layout(model: Any, cfg: Any, kv_dtype: mx.Dtype
               ) -> tuple[list[LayerKV], list[CacheGroup], list[int], dict[int, int]]:
    """`model`'s caches and groups under `cfg` (bytes per block set), each group's cap
    (bounded kinds), and each full-attention cache's store of its first tokens."""
    bs = cfg.block_size
    if cfg.kv_cache_dtype != "auto" and any(getattr(type(m), "_paged_indexer", False) for _, m in model.named_modules()):
        raise ValueError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: this model's sparse attention indexer reads its "
                         "index keys at full precision; serve it with --kv-cache-dtype auto")
    layer_specs = list(model.layer_specs)
    groups, _ = group_caches(layer_specs, getattr(model, "layer_caches", None))
    first_of: dict[int, int] = {}
    if cfg.kv_quant_start:
        layer_specs, groups, first_of = split_first_tokens(layer_specs, groups, cfg.kv_quant_start)
        if not first_of:  # never a flag that silently does nothing
            raise ValueError("--kv-quant-start keeps the first tokens of full-attention caches, and this model has "
                             "none (its layers read sliding windows, local chunks, a prompt and a window after it, or "
                             "recurrent state); leave it out")
    for g in groups:
        dtype = "auto" if isinstance(g.kind, FirstTokens) else cfg.kv_cache_dtype
        g.bytes_per_block = sum(layer_bytes_per_block(layer_specs[i], kv_dtype, bs, dtype, cfg.kv_group_size)
                                for i in g.caches)
    step_blocks = -(-cfg.max_num_batched_tokens // bs)
    # A bounded group's pool never needs more than every running sequence's live blocks plus a step's.
    caps = [cfg.max_num_seqs * (g.kind.live_blocks(bs) or 0) + step_blocks for g in groups]
    return layer_specs, groups, caps, first_of


def kv_pool_bytes(model: Any, cfg: Any, kv_dtype: mx.Dtype, extra_blocks: int = 0) -> Callable[[int], int]:
    """The bytes of `model`'s K/V pools under `cfg` when its unbounded groups hold n +
    `extra_blocks` blocks, as `plan_caches` would buy them (nothing is allocated)."""
    _, groups, caps, _ = _kv_layout(model, cfg, kv_dtype)
    return lambda n: sum(g.bytes_per_block * g.blocks_for(n + extra_blocks, cap) for g, cap in zip(groups, caps))


def plan_caches(model: Any, cfg: Any, kv_dtype: mx.Dtype, max_model_len: int, backend: Backend,
                companion: Companion | None = None) -> CachePlan:
    """The pools for `model` under `cfg` (an `EngineConfig`); a ValueError a user can act on
    when the budget cannot hold them. `companion`: a drafter whose weights and pool share
    the budget (its pool is sized to this plan's blocks by the caller)."""
    bs = cfg.block_size
    layer_specs, groups, caps, first_of = _kv_layout(model, cfg, kv_dtype)
    # More blocks than every sequence at full length could use is waste.
    max_blocks = cfg.max_num_seqs * -(-max_model_len // bs)

    state_specs = list(model.state_specs()) if hasattr(model, "state_specs") else []
    slot_bytes = sum(s.nbytes for s in state_specs)
    interval = snapshot_interval(cfg, groups, slot_bytes)
    num_verify = planned(cfg, bool(state_specs)) if cfg.num_speculative_tokens else 0  # states kept across a verify
    fixed_state = (2 * cfg.max_num_seqs + num_verify) * slot_bytes
    per_block = slot_bytes * bs / interval if slot_bytes else 0.0

    drafted = companion.kv_bytes if companion is not None else (lambda n: 0)

    def pool_bytes(n: int) -> int:
        return sum(g.bytes_per_block * g.blocks_for(n, cap) for g, cap in zip(groups, caps)) + \
            fixed_state + int(n * per_block) + drafted(n)

    available = backend.available_memory()
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters())) + (companion.weights if companion else 0)
    limit = cfg.memory_limit_bytes
    if limit is not None:  # a share of a server's budget: weights and KV within it
        available = min(available, limit)
        if weights >= limit:
            raise ValueError(f"the weights take {weights / 2**30:.2f} GiB, more than the {limit / 2**30:.2f} GiB "
                             "the memory budget leaves this model (--max-memory-gb)")
    if cfg.kv_cache_gb is not None:
        budget = int(cfg.kv_cache_gb * 2**30)
        if budget > available:
            raise ValueError(f"--kv-cache-gb {cfg.kv_cache_gb:g} is more memory than this {backend.kind} device can "
                             f"give ({available / 2**30:.1f} GiB available now); lower it")
        if limit is not None and weights + budget > limit:
            raise ValueError(f"--kv-cache-gb {cfg.kv_cache_gb:g} and the weights ({weights / 2**30:.2f} GiB) are "
                             f"more than the {limit / 2**30:.2f} GiB the memory budget leaves this model "
                             "(--max-memory-gb)")
    else:
        # What the configuration needs (one full context, or max_num_seqs typical
        # conversations), but never more than a share of the free memory.
        wanted = max(max_model_len, cfg.max_num_seqs * DEFAULT_TOKENS_PER_SEQ)
        budget = min(int(cfg.kv_cache_fraction * max(available - weights, 0)), pool_bytes(-(-wanted // bs)))
    num_blocks = plan_blocks(groups, budget - fixed_state, caps, max_blocks, per_block, drafted)
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
    if budget < pool_bytes(1) and not groups:
        raise ValueError(f"KV cache budget {budget / 2**30:.3f} GiB is below the recurrent state of "
                         f"{cfg.max_num_seqs} sequences ({pool_bytes(1) / 2**20:.1f} MiB); raise --kv-cache-gb "
                         "or lower --max-num-seqs")
    if groups and num_blocks < 1:
        with_draft = "" if companion is None else (
            f", with the drafter's pool for it: {drafted(1) / 2**20:.2f} MiB of it, a block per running sequence")
        raise ValueError(f"KV cache budget {budget / 2**30:.3f} GiB is below one block "
                         f"({pool_bytes(1) / 2**20:.2f} MiB{with_draft}); raise --kv-cache-gb"
                         + (" or lower --max-num-seqs" if companion is not None else ""))
    for g, cap in zip(groups, caps):
        g.num_blocks = g.blocks_for(num_blocks, cap)
    states = None
    if state_specs:
        if groups:
            snapshots = -(-num_blocks * bs // interval)
        else:  # no K/V: the budget left after the running states buys snapshots
            snapshots = min(max(budget - fixed_state, 0) // slot_bytes, max_blocks * bs // interval)
        states = StatePool(state_specs, 2 * cfg.max_num_seqs + num_verify + snapshots)
    kv_cache = KVCache(layer_specs, groups, bs, kv_dtype, cfg.kv_cache_dtype, states, cfg.kv_group_size, first_of)
    backend.set_limits(sum(v.nbytes for _, v in tree_flatten(model.parameters())), kv_cache.nbytes)
    return CachePlan(layer_specs, state_specs, groups, num_blocks, interval, num_verify, kv_cache)
