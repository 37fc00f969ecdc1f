"""The decoding batch above which no step speculates, measured on the device at load.

Checking k drafts is nearly free while a decode step is bound by reading the weights: a
step of B sequences with k + 1 rows each then costs about what B rows cost. As B grows
the step turns compute-bound and the extra rows cost in full, so a rejected draft is pure
loss. The threshold is the largest B (a power of two up to `max_num_seqs`, at most
`AUTO_CAP`) whose verify-shaped step (B x (k + 1) rows) costs at most `VERIFY_COST` times
the plain one (B rows), timed on the model's own forward and head at a one-token context
(the weights' cost; attention over a long context adds to both), and cached per device,
MLX version and model like the kernel choices (`kernels/autotune.py`). With measuring off,
or for a model with recurrent state (whose probe would need state slots), the default.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import mlx.core as mx

from macinfer.kernels import autotune
from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams

log = logging.getLogger("macinfer")

DEFAULT = 4  # without a measurement: what the CPU measured for SmolLM2 (docs/architecture.md)
AUTO_CAP = 8  # the recurrent-state spares are sized before the measurement (`cache_plan.py`)
VERIFY_COST = 1.5  # a verify step may cost this much more than a plain one: ~1 accepted draft pays it


def measure(engine: Any, k: int, sizes: list[int]) -> dict[int, float]:
    """Per batch size B: seconds of a step of B x (k + 1) rows over seconds of B rows."""
    rows = max(sizes) * (k + 1)
    seqs = [Sequence(f"spec-probe-{i}", [1], SamplingParams(temperature=0), 0) for i in range(rows)]
    bm = engine.block_manager
    taken: list[Sequence] = []
    try:
        for s in seqs:
            if not bm.can_allocate(s, 1):
                break
            bm.allocate(s, 1)
            taken.append(s)

        def step(n: int):
            def run() -> mx.array:
                ids, meta, _, _ = engine.runner.prepare([(s, 1) for s in taken[:n]])
                return engine.model.logits(engine.model(ids, meta))
            return run

        ratios = {}
        for b in sizes:
            if b * (k + 1) > len(taken):
                break
            ratios[b] = autotune.median_seconds(step(b * (k + 1)), 5) / autotune.median_seconds(step(b), 5)
        return ratios
    finally:
        for s in taken:
            bm.free(s)


def threshold(ratios: dict[int, float]) -> int:
    """The largest batch up to which every verify step costs at most VERIFY_COST a plain one;
    1 when none does (a single stream asked to speculate still may: prompt lookup's best
    tasks gain 2-3x at a 1.4x verify cost)."""
    best = 1
    for b, r in sorted(ratios.items()):  # the first batch past the cost ends it (timings are noisy)
        if r > VERIFY_COST:
            break
        best = b
    return best


def planned(cfg: Any, has_state: bool) -> int:
    """The most sequences that may speculate at once, as the memory plan sizes for it
    (recurrent-state spares) before anything is measured."""
    if cfg.speculative_max_batch is not None:
        return cfg.speculative_max_batch
    return min(DEFAULT if has_state else AUTO_CAP, cfg.max_num_seqs)


def choose_speculative_batch(engine: Any, k: int) -> int:
    """The measured threshold for `engine` drafting `k` tokens (cached), or DEFAULT."""
    cfg = engine.config
    cap = min(AUTO_CAP, cfg.max_num_seqs)
    if engine.block_manager.state is not None or engine.dist is not None:
        return min(DEFAULT, cap)
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b <= cap]
    model_id = hashlib.sha256(json.dumps(engine.loaded.config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    shape = {"model": model_id, "k": k, "sizes": sizes, "verify_cost": VERIFY_COST}

    def run() -> dict:
        ratios = measure(engine, k, sizes)
        return {"ratios": {str(b): round(r, 3) for b, r in ratios.items()}, "max_batch": threshold(ratios)}

    found = autotune.verdict("speculative_max_batch", shape, run, engine.backend.tuning)
    if found is None:
        return min(DEFAULT, cap)
    log.info("speculation: up to %d decoding sequences (verify step / plain step by batch: %s%s)",
             found["max_batch"], ", ".join(f"{b}: {r:.2f}x" for b, r in found["ratios"].items()),
             "; cached" if found.get("cached") else "")
    return found["max_batch"]
