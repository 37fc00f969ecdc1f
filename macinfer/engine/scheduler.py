"""Continuous-batching scheduler with chunked prefill and recompute preemption.

Every step picks, under a token budget, how many new tokens each sequence
computes: 1 for a decode, up to the rest of the prompt for a prefill (split
across steps when the budget runs out). Running sequences go first, oldest
first; waiting ones are admitted while the budget, `max_num_seqs` and free
KV blocks allow. When a running sequence cannot get a block, the newest
running sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed (prompt + tokens so far) later.
With speculative decoding on, a decode may carry draft tokens after its real
one (`seq.spec_token_ids`) while few sequences decode.
With `depth` 2 (a pipeline over several ranks) a step may be scheduled while the
previous one is still in flight: its sequences (`in_flight`) are skipped and never
preempted, and a step takes at most half the sequences, so two steps alternate.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable
from dataclasses import dataclass, field

from macinfer.engine.block_manager import BlockManager
from macinfer.engine.sequence import Sequence, SequenceStatus
from macinfer.engine.speculative import SpeculativeConfig, cut_for_grammar, draft_limit, propose

log = logging.getLogger("macinfer")


@dataclass
class SchedulerOutput:
    # (sequence, number of new tokens to compute this step), decodes first
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_with_decodes: int | None = None,
        speculative: SpeculativeConfig | None = None,
        max_model_len: int | None = None,
        depth: int = 1,
    ):
        self.block_manager = block_manager
        self.on_lora_done: Callable[[int], None] | None = None  # a finished sequence's adapter slot
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Prefill tokens a step may carry while sequences are decoding: a long prompt's
        # chunk makes the whole step slow, and every decoding stream waits for it.
        self.max_prefill_with_decodes = max_prefill_with_decodes
        self.speculative = speculative
        self.max_model_len = max_model_len
        self._speculate = False
        # A batched proposer (`engine/drafter.py`: a draft model); None: prompt lookup.
        self.drafter = None
        self._proposals: dict[Sequence, list[int]] = {}
        self.depth = depth
        self.in_flight: set[Sequence] = set()  # scheduled in a step whose tokens are not back yet
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it is recomputed when readmitted."""
        if seq in self.running:
            self.running.remove(seq)
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.drafter is not None:
            self.drafter.forget(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.max_num_batched_tokens
        num_decoding = sum(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        capped = num_decoding > 0 and self.max_prefill_with_decodes is not None
        self._speculate = self.speculative is not None and 0 < num_decoding <= self.speculative.max_batch
        if self.drafter is not None and (self._speculate or self.drafter.every_step):
            # Every drafting sequence's proposal, in one batch (an MTP head catches up even when none drafts).
            wants = [(s, k) for s in self.running if (k := self._draft_room(s))] if self._speculate else []
            found = self._lookup_first(wants)
            try:
                self._proposals = self.drafter.propose([(s, k) for s, k in wants if s not in found])
            except Exception:  # e.g. out of memory in the drafter's forward: decode on without drafts
                log.exception("the drafter failed; the running requests decode without drafts")
                self.drafter.reset()
                self._proposals = {}
            self._proposals.update(found)
        self._prefill_left = self.max_prefill_with_decodes if capped else self._budget
        # Two steps in flight take turns with about half the sequences each.
        active = min(self.max_num_seqs, len(self.running) + len(self.waiting))
        self._seats = -(-active // self.depth) if self.depth > 1 else 1 << 30

        # 1. Running sequences, oldest first; preempt the newest on a block shortage.
        #    Under the cap, running prefills wait for step 2, where they compete with
        #    the waiting prompts.
        partial: list[Sequence] = []
        kept: list[Sequence] = [s for s in self.running if s in self.in_flight]
        queue = deque(sorted((s for s in self.running if s not in self.in_flight), key=lambda s: s.arrival))
        while queue and self._budget > 0 and len(out.scheduled) < self._seats:
            seq = queue.popleft()
            if capped and seq.num_tokens - seq.num_computed_tokens > 1:
                partial.append(seq)
                kept.append(seq)
                continue
            if self._continue(seq, queue, out):
                kept.append(seq)
        kept.extend(queue)  # running but out of budget this step
        self.running = kept

        # 2. Prompts: admit waiting sequences (not in a step that had to preempt). Under
        #    the cap, every prompt in progress or waiting competes for it shortest
        #    remaining first, so a short request is not stuck behind a long prompt.
        if capped:
            candidates = partial + list(self.waiting)
            candidates.sort(key=lambda s: s.num_tokens - s.num_computed_tokens)
        else:
            candidates = list(self.waiting)
        admitting = True
        for seq in candidates:
            if min(self._budget, self._prefill_left) <= 0 or len(out.scheduled) >= self._seats:
                break
            if seq.status == SequenceStatus.RUNNING:
                self._continue(seq, deque(), out)
            elif admitting and not out.preempted:
                admitting = self._admit(seq, out)

        # Decodes first, then speculating sequences (their rows are decode rows too), then prompts.
        out.scheduled.sort(key=lambda item: 0 if item[1] == 1 else 1 if item[0].spec_token_ids else 2)
        return out

    def _continue(self, seq: Sequence, queue: deque, out: SchedulerOutput) -> bool:
        """Schedule a running sequence's next tokens, preempting the newest of `queue`
        (or `seq` itself) on a block shortage. False if `seq` was preempted."""
        bm = self.block_manager
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = min(remaining, self._budget) if remaining == 1 else min(remaining, self._budget, self._prefill_left)
        if n == 0:  # a prefill with no prefill budget left this step
            return True
        n = _image_cut(seq, n)
        seq.spec_token_ids = self._draft(seq) if remaining == 1 else []
        if seq.spec_token_ids:
            total = seq.num_computed_tokens + n + len(seq.spec_token_ids)
            # Drafts take no block another running sequence may need this step.
            if not bm.can_allocate(seq, total, reserve=len(self.running)):
                seq.spec_token_ids = []
        n += len(seq.spec_token_ids)
        while not bm.can_allocate(seq, seq.num_computed_tokens + n):
            victim = queue.pop() if queue else seq  # victims from `queue` are dropped from the kept list
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                if seq in self.running:  # step 2: it was kept already
                    self.running.remove(seq)
                return False
        bm.allocate(seq, seq.num_computed_tokens + n)
        bm.commit(seq, seq.num_computed_tokens + n - len(seq.spec_token_ids))  # drafts may be rejected
        out.scheduled.append((seq, n))
        self._budget -= n
        if remaining > 1:
            self._prefill_left -= n
        return True

    def _lookup_first(self, wants: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Prompt lookup's drafts for the sequences it finds a continuation for, when it goes
        before the drafter (`SpeculativeConfig.lookup_first`); the drafter drafts the rest."""
        spec = self.speculative
        if spec is None or not spec.lookup_first:
            return {}
        found = {s: propose(s, k, spec.min_n, spec.max_n) for s, k in wants}
        return {s: d for s, d in found.items() if d}

    def _draft_room(self, seq: Sequence) -> int:
        """Draft tokens a running sequence may take this step (0: none): a decode not in
        flight, under no thinking budget, not backing off, with room left."""
        if (seq in self.in_flight or seq.num_tokens - seq.num_computed_tokens != 1 or seq.forced_token_ids
                or (seq.params.thinking_budget is not None and seq.thinking != "closed") or seq.spec_skip > 0):
            return 0
        return draft_limit(seq, self.speculative.num_tokens, self.max_model_len or 1 << 62)

    def _draft(self, seq: Sequence) -> list[int]:
        """Draft tokens for a decoding sequence, within the step's token budget."""
        spec = self.speculative
        if not self._speculate:
            return []
        if seq.forced_token_ids or (seq.params.thinking_budget is not None and seq.thinking != "closed"):
            return []  # a thinking budget may replace the next token: nothing to verify drafts against
        if seq.spec_skip > 0:  # backing off after rejected drafts
            seq.spec_skip -= 1
            return []
        k = min(draft_limit(seq, spec.num_tokens, self.max_model_len or 1 << 62), self._budget - 1)
        if k <= 0:
            return []
        if self.drafter is not None:
            return cut_for_grammar(seq, self._proposals.get(seq, [])[:k])
        return propose(seq, k, spec.min_n, spec.max_n)

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Start a waiting sequence's prompt. False when it cannot be admitted now
        (no sequence slot or blocks), which ends admission for this step."""
        if len(self.running) >= self.max_num_seqs:
            return False
        bm = self.block_manager
        cached = bm.match_prefix(seq, self.drafter.prefix_limit(seq) if self.drafter is not None else None)
        seq.num_computed_tokens = cached
        n = _image_cut(seq, min(seq.num_tokens - seq.num_computed_tokens, self._budget, self._prefill_left))
        if not bm.can_allocate(seq, seq.num_computed_tokens + n):
            bm.free(seq)  # give the prefix hits back; they stay cached
            if self.drafter is not None:
                self.drafter.forget(seq)
            seq.num_computed_tokens = 0
            return False
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached
        self.waiting.remove(seq)
        bm.allocate(seq, seq.num_computed_tokens + n)
        bm.commit(seq, seq.num_computed_tokens + n)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append((seq, n))
        self._budget -= n
        self._prefill_left -= n
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if self.drafter is not None:
            self.drafter.forget(seq)
        if seq.lora_slot and self.on_lora_done is not None:
            self.on_lora_done(seq.lora_slot)
            seq.lora_slot = 0
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


def _image_cut(seq: Sequence, n: int) -> int:
    """A prompt chunk of `n` tokens, cut so that it ends outside any image whose tokens
    attend both ways (`vision/inputs.py`): it may then exceed the step's budget by the rest
    of an image it starts inside."""
    if seq.images is None or n <= 0 or seq.num_computed_tokens + n >= seq.num_prompt_tokens:
        return n
    return seq.images.chunk_end(seq.num_computed_tokens, seq.num_computed_tokens + n) - seq.num_computed_tokens
