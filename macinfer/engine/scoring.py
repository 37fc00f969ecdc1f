"""Logits at every position of given token lists: the engine's parity and quality probe."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams


def score(engine: Any, token_lists: list[list[int]], chunks: list[int]) -> list[np.ndarray]:
    """Logits at every position of each token list (float32 numpy, [len, vocab]).

    The sequences run together, each fed in the given chunk sizes (a chunk of 1
    takes the decode path), through the same paged cache and attention as
    serving. For parity and quality checks; it bypasses the scheduler, so call
    it on an idle engine.
    """
    if any(len(t) < sum(chunks) for t in token_lists):
        raise ValueError("every token list needs at least sum(chunks) tokens")
    seqs = [Sequence(f"score-{i}", t, SamplingParams(temperature=0), 0) for i, t in enumerate(token_lists)]
    per_seq: list[list[np.ndarray]] = [[] for _ in seqs]
    try:
        for n in chunks:
            scheduled = []
            for s in seqs:
                engine.block_manager.allocate(s, s.num_computed_tokens + n)
                scheduled.append((s, n))
            scheduled.sort(key=lambda it: it[1] != 1)  # decodes first, as the scheduler does
            ids, meta, _, _ = engine.runner.prepare(scheduled)
            logits = engine.model.logits(engine.model(ids, meta)).astype(mx.float32)
            mx.eval(logits, engine.kv_cache.state())
            row = 0
            for s, k in scheduled:
                per_seq[seqs.index(s)].append(np.array(logits[row : row + k]))
                s.num_computed_tokens += k
                row += k
    finally:
        for s in seqs:
            engine.block_manager.free(s)
    return [np.concatenate(p) for p in per_seq]
