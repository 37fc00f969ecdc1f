"""Speculative decoding with a DFlash drafter (`models/dflash.py`): k drafts a sequence in
one forward, for every speculating sequence in one batch.

Each target sequence has a shadow on the drafter's pool holding the same tokens; its K/V
at position i are the drafter's context at i (from the target layers' outputs there,
captured from every target forward, as an MTP head's rows are: `MTPDrafter.capture`).
A step first writes each shadow's context up to the target's computed tokens (its
catch-up), then runs the block [last token, mask x k] of each drafting sequence at the
positions after it: the block's rows are decode rows of one table that all read to the
block's end (both ways within the block), their K/V written at positions the next
catch-up writes again with context, so nothing needs a rollback. The prefix cache and
the target's hit held to the drafter's are the MTP head's (`engine/mtp_drafter.py`);
drafts are drawn with the target's noise per output position, so the output is exactly
that of decoding without speculation, greedy or seeded.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

from macinfer.engine.mtp_drafter import MTPDrafter
from macinfer.engine.sampler import draw
from macinfer.engine.sequence import Sequence, SequenceStatus
from macinfer.sampling_params import SamplingParams

log = logging.getLogger("macinfer")


class DFlashDrafter(MTPDrafter):
    """The scheduler's batched proposer for a DFlash drafter (module docstring)."""

    def __init__(self, head: Any, recorded: Any, logits: Any, cache_key: str, engine: Any):
        super().__init__(head, cache_key, engine.config, engine.max_model_len, engine.backend,
                         features=lambda _: head.context(mx.concatenate(recorded.take(), axis=-1)))
        self.target_logits = logits  # the target's head: the drafts are its reading of the block's rows

    def _new_shadow(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow: the same tokens (the context at position i is the target's at i)."""
        return Sequence(seq.request_id, seq.prompt_token_ids, SamplingParams(), 0,
                        cache_salt=(seq.cache_salt or "") + "\x00dflash")

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Every shadow's context written up to its target (within the step's token budget),
        and k drafts for each (sequence, k) in `wants` whose shadow is then level with it."""
        want, budget = dict(wants), self.chunk
        catch: list[tuple[Sequence, int, mx.array]] = []
        blocks: list[tuple[Sequence, int]] = []
        seqs = [seq for seq in list(self.shadows) if seq.status == SequenceStatus.RUNNING]
        for seq, sh in sorted(((seq, self._shadow(seq)) for seq in seqs),
                              key=lambda t: t[0].num_computed_tokens - t[1].num_computed_tokens):
            level = seq.num_computed_tokens  # positions whose context the target's forwards made
            todo = level - sh.num_computed_tokens
            n = min(todo, budget)
            k = want.get(seq, 0) if n == todo and seq.num_tokens == level + 1 else 0
            if seq.num_tokens + k > self.max_len:
                k = 0
            if n <= 0 and not k:
                continue
            rows = self._rows(seq, sh.num_computed_tokens, n) if n > 0 else None
            if n > 0 and rows is None:  # never expected: every computed position is captured
                log.warning("DFlash: request %s lacks the target's rows at %d; it drafts no more",
                            seq.request_id, sh.num_computed_tokens)
                self.forget(seq)
                continue
            room = level + 1 + k if k else sh.num_computed_tokens + n
            if not self.block_manager.can_allocate(sh, room):
                continue
            self.block_manager.allocate(sh, room)
            budget -= max(n, 0)
            if n > 0:
                catch.append((sh, n, rows))
            if k:
                blocks.append((sh, k))
        if not catch and not blocks:
            return {}
        ctx = ctx_meta = None
        if catch:
            catch.sort(key=lambda item: item[1] != 1)  # the runner takes decode rows first
            _, ctx_meta, _, _ = self.runner.prepare([(sh, n) for sh, n, _ in catch])
            ctx = mx.concatenate([rows for *_, rows in catch], axis=0) if len(catch) > 1 else catch[0][2]
            for sh, n, _ in catch:
                sh.num_computed_tokens += n
                self.block_manager.commit(sh, sh.num_computed_tokens)
                self._consumed(self.targets[sh], sh.num_computed_tokens)
        block_meta = ids = None
        drafted: list[int] = []  # the rows whose tokens are drafts
        if blocks:
            mask, lead = self.model.mask_id, int(not self.model.from_anchor)
            blocks.sort(key=lambda b: b[1] + lead > 1)  # (a one-row block is a plain decode: those go first)
            for sh, k in blocks:  # the block: the last token, then k masks (DSpark's: k - 1), as draft rows
                sh.spec_token_ids = [mask] * (k - 1 + lead)
            try:
                ids, block_meta, _, _ = self.runner.prepare([(sh, k + lead) for sh, k in blocks])
            finally:
                for sh, _ in blocks:
                    sh.spec_token_ids = []
            lens = np.array(block_meta.decode_context_lens)
            for start, count in block_meta.decode_groups:  # every block row reads to the block's end
                lens[start : start + count] = lens[start + count - 1]
            block_meta.decode_context_lens = mx.array(lens)
            within = np.concatenate([np.arange(k + lead) for _, k in blocks])  # each row's index in its block
            starts = np.cumsum([0] + [k + lead for _, k in blocks])[:-1]
            drafted = [int(start) + lead + j for start, (_, k) in zip(starts, blocks) for j in range(k)]
        hidden = self.model.forward(ctx, ctx_meta, None if ids is None else self.model.embed(ids), block_meta,
                                    np.array(drafted), None if ids is None else within)
        self.forwards += 1
        if not blocks:  # a catch-up alone: its writes run behind the step's forward, no sync here
            mx.async_eval(*self.kv_cache.state())
            return {}
        rows = [self._row(self.targets[sh], j) for sh, k in blocks for j in range(k)]
        logits = self.model.logits(hidden, self.target_logits)[:, : self.vocab]
        if not self.model.sequential:
            tokens = draw(logits, rows).tokens
            mx.eval(tokens, *self.kv_cache.state())
            flat = tokens.tolist()
        else:  # DFlash2, DSpark: position by position, each pick read by the next
            anchors = [sh.token_slice(sh.num_tokens - 1, sh.num_tokens)[0] for sh, _ in blocks]
            flat = self.model.select(hidden, logits, anchors, [k for _, k in blocks],
                                     lambda scores, at: draw(scores, [rows[i] for i in at]).tokens.tolist())
            mx.eval(*self.kv_cache.state())
        out, at = {}, 0
        for sh, k in blocks:
            out[self.targets[sh]] = flat[at : at + k]
            at += k
        return out


def load_dflash_drafter(engine: Any) -> DFlashDrafter:
    """`engine`'s DFlash drafter (`--draft-model` naming a DFlash checkpoint); a ValueError
    with the reason when it cannot draft for this target."""
    from macinfer.loading.loader import resolve
    from macinfer.models.dflash import load_dflash

    path = resolve(engine.config.draft_model)
    head, recorded = load_dflash(path, engine)
    drafter = DFlashDrafter(head, recorded, engine.model.logits, path + ":dflash", engine)
    log.info("DFlash drafter %s: %.1f MiB of weights, reading layers %s, %d tokens a step",
             engine.config.draft_model, drafter.nbytes / 2**20, [i - 1 for i in recorded.ids],
             engine.config.num_speculative_tokens)
    return drafter
