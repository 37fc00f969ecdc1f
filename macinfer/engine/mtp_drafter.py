"""Speculative decoding with the target's own MTP head (`models/mtp.py`), for every
speculating sequence in one batch.

The head at position i reads the target's hidden state there (H_i, which predicted token
i + 1) and token i + 1, and predicts token i + 2. So each target sequence has a shadow
whose token i is the target's token i + 1, on a paged pool of the head's own, and the
target's forward hands the drafter its hidden rows (`capture`, every step, prompt chunks
and verify rows alike). A step's proposal first computes each shadow up to the target's
computed tokens from those rows (its catch-up), drawing the first draft at the last; draft
j then feeds draft j - 1 with the head's own output in place of the target's hidden state.
Those positions are never counted as computed: the next catch-up writes them again from
the target's rows, so a rejected draft needs no rollback and an accepted one is recomputed
from the state the target really had.

A shadow's K/V exist only where the target computed: a prefix-cache hit of the target
skips positions the head never saw. So the head keeps a prefix cache of its own, keyed by
its shadow's tokens (the target's first token in the salt), and the target's hit is held
to the head's (`prefix_limit`): both hit together, or the target recomputes what the
head lacks. Drafts are drawn as `engine/drafter.py` draws a draft model's, with the
target's noise per output position, so the output is exactly that of decoding without
speculation, greedy or seeded.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

import mlx.core as mx

from macinfer.engine.drafter import DraftModel
from macinfer.engine.sequence import Sequence, SequenceStatus
from macinfer.models.mtp import hidden_rows, load_mtp
from macinfer.sampling_params import SamplingParams

log = logging.getLogger("macinfer")


class MTPDrafter(DraftModel):
    """The scheduler's batched proposer for an MTP head (module docstring)."""

    every_step = True  # the head reads every target row: it catches up each step, drafting or not

    def __init__(self, head: Any, cache_key: str, target_cfg: Any, max_model_len: int, backend: Any,
                 features: Callable[[mx.array], mx.array] | None = None):
        super().__init__(head, cache_key, target_cfg, max_model_len, backend,
                         prefix_caching=target_cfg.enable_prefix_caching)
        # A forward's hidden rows as the head reads them (an MTP head: the final hidden
        # state itself; EAGLE-3: its projection of three recorded layers' inputs).
        self.features = features
        self.targets: dict[Sequence, Sequence] = {}  # shadow -> its target sequence
        # Target hidden rows not yet read by the head: per sequence, (first position, rows).
        self.pending: dict[Sequence, list[tuple[int, mx.array]]] = {}

    # -- the shadows ----------------------------------------------------------------
    def _new_shadow(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow: its token i is the target's token i + 1."""
        return Sequence(seq.request_id, seq.prompt_token_ids[1:], SamplingParams(), 0, cache_salt=_salt(seq))

    def _shadow(self, seq: Sequence) -> Sequence:
        sh = self.shadows.get(seq)
        if sh is None:
            sh = self._new_shadow(seq)
            sh.status = SequenceStatus.RUNNING
            self.block_manager.free(sh)  # empty tables, one per group
            self.shadows[seq], self.targets[sh] = sh, seq
        if len(sh.output_token_ids) != len(seq.output_token_ids):  # outputs only grow (preemption forgets)
            sh.output_token_ids.extend(seq.output_token_ids[len(sh.output_token_ids):])
        return sh

    def forget(self, seq: Sequence) -> None:
        sh = self.shadows.get(seq)
        if sh is not None:
            self.targets.pop(sh, None)
        self.pending.pop(seq, None)
        super().forget(seq)

    def prefix_limit(self, seq: Sequence) -> int:
        """The longest prefix-cache hit the target may take for `seq`: what the head holds
        of it (its shadow's hit, now attached). Called once, as the target is admitted."""
        self.forget(seq)  # a preempted sequence starts over
        sh = self._shadow(seq)
        sh.num_computed_tokens = self.block_manager.match_prefix(sh)
        return sh.num_computed_tokens

    def capture(self, scheduled: list[tuple[Sequence, int]], hidden: mx.array) -> None:
        """The target's forward over `scheduled` (its sequences' computed counts not yet
        advanced) produced `hidden` [rows, D], rows in the scheduled order."""
        if self.features is not None and any(seq in self.shadows for seq, _ in scheduled):
            hidden = self.features(hidden)
        row = 0
        for seq, n in scheduled:
            if seq not in self.shadows:  # not drafted for (a shadow dropped after a failure)
                row += n
                continue
            start = seq.num_computed_tokens
            kept = []
            for first, rows in self.pending.get(seq, []):
                if first < start:  # a later forward over the same positions replaces them
                    kept.append((first, rows[: start - first] if first + rows.shape[0] > start else rows))
            kept.append((start, hidden[row : row + n]))
            self.pending[seq] = kept
            row += n

    def _rows(self, seq: Sequence, start: int, n: int) -> mx.array | None:
        """The target's hidden rows at positions [start, start + n), or None if some are missing."""
        parts, at = [], start
        for first, rows in self.pending.get(seq, []):
            end = first + rows.shape[0]
            if first <= at < end:
                take = min(end, start + n) - at
                parts.append(rows[at - first : at - first + take])
                at += take
            if at == start + n:
                break
        if at != start + n:
            return None
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    def _consumed(self, seq: Sequence, upto: int) -> None:
        """Drop the pending rows before position `upto` (the head has read them)."""
        kept = []
        for first, rows in self.pending.get(seq, []):
            end = first + rows.shape[0]
            if end > upto:
                kept.append((upto, rows[upto - first :]) if first < upto else (first, rows))
        self.pending[seq] = kept

    # -- a step's proposal ------------------------------------------------------------
    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Every shadow computed up to its target (within the step's token budget), and up
        to k drafts for each (sequence, k) in `wants` whose shadow is level with it."""
        want = dict(wants)
        budget = self.chunk
        catch_up: list[tuple[Sequence, int, mx.array]] = []
        ready: list[Sequence] = []
        seqs = [seq for seq in list(self.shadows) if seq.status == SequenceStatus.RUNNING]
        shadows = sorted(((seq, self._shadow(seq)) for seq in seqs),
                         key=lambda t: t[0].num_computed_tokens - t[1].num_computed_tokens)
        for seq, sh in shadows:
            level = min(sh.num_tokens, seq.num_computed_tokens)  # positions whose hidden row the target made
            todo = level - sh.num_computed_tokens
            n = min(todo, budget)
            if n <= 0:
                continue
            k = want.get(seq, 0) if n == todo and level == sh.num_tokens else 0
            if seq.num_tokens + k > self.max_len:
                k = 0
            rows = self._rows(seq, sh.num_computed_tokens, n)
            if rows is None:  # never expected: every computed position is captured
                log.warning("MTP head: request %s lacks the target's hidden rows at %d; it drafts no more",
                            seq.request_id, sh.num_computed_tokens)
                self.forget(seq)
                continue
            room = sh.num_computed_tokens + n + max(k - 1, 0)
            if not self.block_manager.can_allocate(sh, room):
                continue
            self.block_manager.allocate(sh, room)
            budget -= n
            catch_up.append((sh, n, rows))
            if k:
                ready.append(sh)
        if not catch_up:
            return {}
        catch_up.sort(key=lambda item: item[1] != 1)  # the runner takes decode rows first
        # Round 0 computes the shadows from the target's rows; round j feeds draft j - 1 with
        # the head's output, at a position the next catch-up writes again (one lazy graph).
        sampling = [sh for sh, n, _ in catch_up if sh.num_computed_tokens + n == sh.num_tokens]
        given = mx.concatenate([rows for _, _, rows in catch_up], axis=0) if len(catch_up) > 1 else catch_up[0][2]
        with hidden_rows(self.model, given):
            tokens, out = self._forward_rows([(sh, n) for sh, n, _ in catch_up],
                                             [self._row(self.targets[sh], 0) for sh in sampling])
        rounds = [(tokens, {sh: i for i, sh in enumerate(sampling)})]
        for sh, n, _ in catch_up:
            seq = self.targets[sh]
            sh.num_computed_tokens += n
            self.block_manager.commit(sh, sh.num_computed_tokens)
            self._consumed(seq, sh.num_computed_tokens)
        ks = {sh: want[self.targets[sh]] for sh in ready}
        for j in range(1, max(ks.values(), default=0)):
            fed = [sh for sh in ready if ks[sh] > j]
            if not fed:
                break
            prev, where = rounds[-1]
            pick = mx.array([where[sh] for sh in fed])
            with hidden_rows(self.model, out[pick]):  # the head's own output for the target's
                tokens, out = self._forward_rows(
                    [(sh, 1) for sh in fed], [self._row(self.targets[sh], j) for sh in fed],
                    (prev[pick], [sh.num_computed_tokens + j - 1 for sh in fed]))
            rounds.append((tokens, {sh: i for i, sh in enumerate(fed)}))
        if not ready:  # a catch-up alone: its writes run behind the step's forward, no sync here
            mx.async_eval(*self.kv_cache.state())
            return {}
        mx.eval(*(t for t, _ in rounds), *self.kv_cache.state())
        values = [(t.tolist(), where) for t, where in rounds]
        return {self.targets[sh]: [v[where[sh]] for v, where in values[: ks[sh]]] for sh in ready}


def _salt(seq: Sequence) -> str:
    """A shadow's prefix-cache salt: its target's (request salt, adapter), the target's
    first token (a shadow's tokens start at the second), and its images' content."""
    parts = [seq.cache_salt or "", str(seq.prompt_token_ids[0])]
    if seq.images is not None:
        parts.append(hashlib.blake2b(b"".join(s.digest for s in seq.images.spans), digest_size=16).hexdigest())
    return "\x00mtp:".join(parts)


def load_mtp_drafter(engine: Any, source: str | None = None) -> MTPDrafter:
    """`engine`'s MTP drafter (`EngineConfig.speculative_method == "mtp"`, or `source`: an
    mlx-vlm split MTP drafter folder named by `--draft-model`); a ValueError with the reason
    when there is no MTP head macinfer runs."""
    from macinfer.gguf.load import read_block

    head = load_mtp(engine.loaded, finish=_as_the_loader_does, read_block=read_block, source=source)
    drafter = MTPDrafter(head, (source or engine.loaded.source) + ":mtp", engine.config, engine.max_model_len,
                         engine.backend)
    log.info("MTP head: %.1f MiB of weights, %d tokens a step", drafter.nbytes / 2**20,
             engine.config.num_speculative_tokens)
    return drafter


def _as_the_loader_does(module: Any) -> None:
    """Quantized layers expanded to float32 where the loader expands the target's (CPU)."""
    from macinfer.loading.loader import _dequantize_modules, should_dequantize

    if should_dequantize(module):
        _dequantize_modules(module)


def load_eagle3_drafter(engine: Any) -> MTPDrafter:
    """`engine`'s EAGLE-3 head (`--draft-model` naming an EAGLE-3 checkpoint): it reads the
    inputs of three of the target's layers, recorded on every forward."""
    from macinfer.loading.loader import resolve
    from macinfer.models.eagle3 import load_eagle3

    path = resolve(engine.config.draft_model)
    head, recorded = load_eagle3(path, engine.loaded)
    stack = head.lm.model
    drafter = MTPDrafter(head, path + ":eagle3", engine.config, engine.max_model_len, engine.backend,
                         features=lambda _: stack.features(recorded.take()))
    log.info("EAGLE-3 head %s: %.1f MiB of weights, reading layers %s, %d tokens a step",
             engine.config.draft_model, drafter.nbytes / 2**20, recorded.ids, engine.config.num_speculative_tokens)
    return drafter
