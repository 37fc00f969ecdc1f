"""Speculative decoding with Gemma 4's assistant drafter (`models/gemma4_assistant.py`),
for every speculating sequence in one batch.

The assistant keeps nothing of its own: no pool, no shadow sequences, no rollback. Each
target forward hands it its hidden rows (`capture`); a sequence's drafts start from the
row that predicted its last token (the last position with K/V, p) and that token, and
each draft is one batched forward of the assistant's layers at position p over the
target's own paged K/V up to p. A rejected draft leaves nothing to undo, and a prefix
hit of the target is never limited (its last position is always computed again).
Drafts are drawn as the request samples, with the noise the target draws each output
position with (`engine/drafter.py`), so the output is exactly that of decoding without
speculation, greedy or seeded.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

from macinfer.engine.cache_plan import Companion
from macinfer.engine.drafter import _DrawRow, weight_bytes
from macinfer.engine.runner.inputs import GroupTables
from macinfer.engine.sampler import draw
from macinfer.engine.sequence import Sequence
from macinfer.models.gemma4_assistant import AssistantHead, load_assistant

log = logging.getLogger("macinfer")


class AssistantDrafter:
    """The scheduler's batched proposer for a Gemma 4 assistant (module docstring)."""

    every_step = True  # it reads every target forward's rows

    def __init__(self, head: AssistantHead, engine: Any):
        self.head, self.engine = head, engine
        self.vocab = engine.model.args.vocab_size
        # Per sequence: its last forward's hidden rows and the position of the first.
        self.rows: dict[Sequence, tuple[int, mx.array]] = {}
        self.forwards = 0

    @property
    def nbytes(self) -> int:
        return weight_bytes(self.head.drafter)

    def companion(self) -> Companion:
        """Its weights in the target's plan; no pool of its own (it reads the target's)."""
        return Companion(self.nbytes, lambda n: 0)

    def allocate(self, target_blocks: int) -> None:
        """Nothing to build: the target's caches are its."""

    def capture(self, scheduled: list[tuple[Sequence, int]], hidden: mx.array) -> None:
        """The target's forward over `scheduled` (computed counts not yet advanced) made
        `hidden` [rows, D], rows in the scheduled order."""
        row = 0
        for seq, n in scheduled:
            self.rows[seq] = (seq.num_computed_tokens, hidden[row : row + n])
            row += n

    def prefix_limit(self, seq: Sequence) -> None:
        return None

    def forget(self, seq: Sequence) -> None:
        self.rows.pop(seq, None)

    def reset(self) -> None:
        self.rows.clear()

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Up to k drafts for each decoding (sequence, k) whose last hidden row is held."""
        picked, hidden = [], []
        for seq, k in wants:
            p = seq.num_computed_tokens - 1  # the last position with K/V: its row predicted the last token
            start, rows = self.rows.get(seq, (0, None))
            if rows is None or seq.num_tokens != p + 2 or not start <= p < start + rows.shape[0]:
                continue
            picked.append((seq, k, p))
            hidden.append(rows[p - start])
        if not picked:
            return {}
        meta, positions = self._metadata([(seq, p) for seq, _, p in picked])
        tokens = mx.array([seq.token_ids[-1] for seq, _, _ in picked], dtype=mx.int32)
        h = mx.stack(hidden)
        rounds = []
        for j in range(max(k for _, k, _ in picked)):  # every row drafts the longest k (cut below)
            h, logits = self.head.step(tokens, h, meta, positions)
            rows = [_DrawRow(seq.params, seq.seed, seq.prompt_token_ids, seq.output_token_ids, j)
                    for seq, _, _ in picked]
            tokens = draw(logits[:, : self.vocab], rows).tokens.astype(mx.int32)
            rounds.append(tokens)
            self.forwards += 1
        drafts = np.array(mx.stack(rounds, axis=1)).tolist()  # one sync a step
        return {seq: drafts[i][:k] for i, (seq, k, _) in enumerate(picked)}

    def _metadata(self, rows: list[tuple[Sequence, int]]) -> tuple[Any, mx.array]:
        """The target's attention metadata for one query row a sequence, reading its K/V up
        to p (nothing is written). Which keys a window keeps is the next token's view, at
        p + 1 (its own K/V not there yet): the last W - 1 keys, as transformers' assistant
        reads the target's sliding cache; the row's RoPE position is p."""
        engine = self.engine
        groups = engine.block_manager.kv_groups
        tables = [GroupTables(g, engine.kv_cache.block_size) for g in groups]
        for i, (seq, p) in enumerate(rows):
            for g, t in enumerate(tables):
                t.add(seq.block_tables[g], np.array([p + 1]), i)
        positions = mx.array([p for _, p in rows], dtype=mx.int32)
        metas = [t.metadata(engine.kv_cache, positions, engine.runner.inputs) for t in tables]
        for g, m in zip(groups, metas):  # keys up to p only: less the key at p + 1 where the group stores it
            stored = np.array([g.kind.stored_keys(p + 2) - g.kind.stored_keys(p + 1) for _, p in rows])
            m.decode_context_lens = m.decode_context_lens - mx.array(stored, dtype=mx.int32)
            m.decode_max_context = int(m.decode_context_lens.max().item())
        metas[0].groups = metas
        return metas[0], positions


def load_assistant_drafter(engine: Any) -> AssistantDrafter:
    """`engine`'s Gemma 4 assistant (`--draft-model` naming one); a ValueError with the
    reason when it cannot draft for this target."""
    from macinfer.loading.loader import resolve

    path = resolve(engine.config.draft_model)
    specs = list(engine.model.layer_specs)  # (the model's own caches: the plan only appends to them)
    head = load_assistant(path, engine.model, specs, list(getattr(engine.model, "layer_caches", None) or
                                                          range(len(specs))))
    drafter = AssistantDrafter(head, engine)
    log.info("Gemma 4 assistant %s: %.1f MiB of weights, reading the target's caches %s, %d tokens a step",
             engine.config.draft_model, drafter.nbytes / 2**20, head.caches, engine.config.num_speculative_tokens)
    return drafter
