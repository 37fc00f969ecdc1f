"""The load-time check that a model run through mlx-lm's classes computes on the paged
cache what mlx-lm's own forward computes (`LLMEngine` runs it once, at load)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
from mlx.utils import tree_flatten

from macinfer.engine.block_manager import BlockManager
from macinfer.engine.cache_plan import plan_caches
from macinfer.engine.runner import ModelRunner
from macinfer.engine.scoring import score
from macinfer.engine.state_group import StateGroup


def check_against_mlx_lm(engine: Any) -> None:
    """A model run through mlx-lm's classes must compute what mlx-lm computes. The
    load-time probe catches what it can see (caches, attention calls); this catches
    the rest (a layer that reads its cache's length or positions some other way):
    8 tokens through the paged engine (a 5-token chunk, then decodes) against
    mlx-lm's own forward, refused when any logit is off by more than 5% of the
    largest (low-precision weights differ by far less; a wrong position by about
    the logits themselves). A quantized KV cache's own error is no layout error: the
    probe then runs on small full-precision pools of the same layout."""
    reference = getattr(engine.model, "reference_logits", None)
    if reference is None:
        return
    vocab = engine.model.args.vocab_size
    tokens, chunks = [1 + (i * 7919) % (vocab - 1) for i in range(8)], [5, 1, 1, 1]
    ours = score(_float_probe(engine) if engine.kv_cache.quantized else engine, [tokens], chunks)[0]
    want = np.array(reference(tokens, chunks))
    err, scale = float(np.abs(ours - want).max()), float(np.abs(want).max())
    if not err <= 0.05 * max(scale, 1e-3):
        from macinfer.models import UnsupportedArchitectureError

        source = "mlx-vlm" if type(getattr(engine.model, "lm", None)).__module__.startswith("mlx_vlm") else "mlx-lm"
        raise UnsupportedArchitectureError(
            f"unsupported architecture {engine.model.args.model_type!r}: its layers on the paged cache "
            f"compute other logits than {source}'s own forward (off by {err:.3g}, largest logit {scale:.3g}), "
            "so it would run wrong")
    engine.block_manager.drop_cache()


def _float_probe(engine: Any) -> SimpleNamespace:
    """What `score` reads of an engine, on pools of two blocks a group in the model's own
    dtype (the quantized pools untouched)."""
    cfg = dataclasses.replace(engine.config, kv_cache_dtype="auto", kv_group_size=None, kv_quant_start=0, num_kv_blocks=2,
                              kv_cache_gb=None,
                              max_num_seqs=1, num_speculative_tokens=0, memory_limit_bytes=None)
    plan = plan_caches(engine.model, cfg, engine.model.kv_dtype(), cfg.block_size * 2, engine.backend)
    weights = sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))
    engine.backend.set_limits(weights, engine.kv_cache.nbytes)  # (the plan set them for its own small pools)
    slots = None if plan.kv_cache.states is None else StateGroup(plan.kv_cache.states, 1, cfg.block_size,
                                                                 plan.interval, False, 0)
    bm = BlockManager(plan.groups, cfg.block_size, False, state=slots)
    return SimpleNamespace(block_manager=bm, kv_cache=plan.kv_cache, model=engine.model,
                           runner=ModelRunner(engine.model, plan.kv_cache, bm, explicit_ops=engine.paths.explicit_ops,
                                              prefill_tile=engine.paths.prefill_tile))
