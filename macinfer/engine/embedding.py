"""Embeddings through the paged engine: inputs packed into ragged forward passes of
at most the step's token budget, one pass per `step()`, so a server can interleave
them with generation steps (and stop between two when its client leaves)."""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams


class EmbeddingEngine(Protocol):
    """What a job reads of its engine (`LLMEngine`), named here so neither module imports the other."""
    loaded: Any  # its `pooling`
    config: Any  # its `max_num_batched_tokens`
    block_manager: Any
    runner: Any
    model: Any
    kv_cache: Any


class EmbeddingBusyError(RuntimeError):
    """No free KV blocks for the next chunk right now (the caller may retry)."""


class EmbeddingJob:
    """Pooled final hidden states of several inputs. Each `step()` runs one forward
    pass over as many input chunks as the token budget holds (decode-sized inputs
    and prompt chunks together); `close()` gives back every KV block it holds."""

    def __init__(self, engine: EmbeddingEngine, token_lists: list[list[int]]):
        self.engine = engine
        self.pooling = engine.loaded.pooling
        self.seqs = [Sequence(f"embed-{i}", list(t), SamplingParams(temperature=0), 0)
                     for i, t in enumerate(token_lists)]
        self.hidden: list[list[mx.array]] = [[] for _ in self.seqs]
        self.results: list[np.ndarray | None] = [None] * len(self.seqs)
        self.next = 0  # first input not yet finished

    @property
    def done(self) -> bool:
        return self.next >= len(self.seqs)

    def step(self) -> bool:
        """One forward pass; True when every input is embedded."""
        bm, budget = self.engine.block_manager, self.engine.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        used = 0
        for seq in self.seqs[self.next:]:
            if used >= budget:
                break
            n = min(budget - used, seq.num_prompt_tokens - seq.num_computed_tokens)
            if not bm.can_allocate(seq, seq.num_computed_tokens + n):
                break
            bm.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append((seq, n))
            used += n
        if not scheduled:
            raise EmbeddingBusyError("no free KV blocks for this input right now; retry shortly")
        scheduled.sort(key=lambda it: it[1] != 1)  # single tokens are decode rows, which come first
        ids, meta, _, _ = self.engine.runner.prepare(scheduled)
        hidden = self.engine.model(ids, meta)
        mx.eval(hidden, self.engine.kv_cache.state())
        row = 0
        for seq, n in scheduled:
            i = int(seq.request_id.removeprefix("embed-"))
            self.hidden[i].append(hidden[row : row + n])
            row += n
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_prompt_tokens:
                self.results[i] = np.array(self.pooling(mx.concatenate(self.hidden[i], axis=0)))
                self.hidden[i] = []
                bm.free(seq)
        while self.next < len(self.seqs) and self.results[self.next] is not None:
            self.next += 1
        return self.done

    def close(self) -> None:
        for seq in self.seqs:
            if seq.block_table:
                self.engine.block_manager.free(seq)
        self.hidden = [[] for _ in self.seqs]
