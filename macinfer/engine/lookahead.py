"""The next decode step built ahead: step n+1's forward queued while step n computes.

vLLM v1's async scheduling, in the shape of an MLX graph. The tokens step n draws are a
lazy array, so step n+1's forward can take them as its input ids and be queued
(`mx.async_eval`) before they are read back: the host reads back, detokenizes, schedules
and builds the next graph while the device computes, instead of the device waiting for
the host between steps (on Metal a step is a few milliseconds of host work against tens
of device time; `macinfer bench profile` shows both).

It is an early copy of work the next step would do, never a commitment. The next step
takes a sequence's row from it only when the scheduler gives that sequence one plain
decode token at the position and with the input token the lookahead assumed; every other
scheduled sequence (a new prompt, drafts, a forced token) is computed as usual, beside
it. A prompt's last chunk draws a token too, so its first decode is built ahead as well.

Its K/V writes are the ones the next step makes anyway (the same token at the same
position), or, for a sequence that ended or was preempted meanwhile, land in blocks that
nothing reads before writing them again: a block gets a prefix-cache hash only once all
its tokens are computed, which the lookahead's token is not yet. Recurrent layers' new
states are set aside (`StateGroup.staged`) and committed only for the rows the next step
takes, with the state snapshots that step would have taken (`commit_states`); a row not
taken leaves its sequence's state as it was. Several ranks (their steps are collectives
in lockstep) and steps that may speculate do not look ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from macinfer.engine.sequence import Sequence


@dataclass
class Lookahead:
    logits: mx.array  # [rows, vocab]: each sequence's next-token logits, one step ahead
    rows: dict[Sequence, int]  # sequence -> its row
    positions: list[int]  # per row: the position it computed
    draw_rows: list[int]  # per row: the row of step n's draw it took as its input token
    token_values: list[int] | None = None  # those tokens, once step n's draw is read back
    # Recurrent models: each cache's staged (call, new states), and each sequence's row in them.
    staged: dict | None = None
    state_rows: dict[Sequence, int] | None = None

    def take(self, scheduled: list[tuple[Sequence, int]]
             ) -> tuple[mx.array | None, list[Sequence], list[tuple[Sequence, int]]]:
        """(logits of the scheduled sequences it computed, those sequences, the scheduled rest)."""
        rows, seqs, rest = [], [], []
        for seq, n in scheduled:
            row = self.rows.get(seq)
            if (row is not None and self.token_values is not None and n == 1 and not seq.spec_token_ids
                    and seq.num_computed_tokens == self.positions[row] and seq.num_tokens == self.positions[row] + 1
                    and seq.token_slice(seq.num_tokens - 1, seq.num_tokens)[0] == self.token_values[row]):
                rows.append(row)
                seqs.append(seq)
            else:
                rest.append((seq, n))
        if not rows:
            return None, [], scheduled
        if rows == list(range(len(self.positions))):
            return self.logits, seqs, rest
        return self.logits[mx.array(rows)], seqs, rest

    def commit_states(self, seqs: list[Sequence], group, step) -> None:
        """The taken sequences' staged recurrent states, committed by their group
        (`StateGroup.commit_staged`) in this step's transaction `step`."""
        if self.staged and seqs:
            group.commit_staged(self.staged, self.state_rows, seqs, step)


def candidates(scheduled: list[tuple[Sequence, int]], samplers: list, reserve: Callable[[Sequence, int], bool]
               ) -> tuple[list[tuple[Sequence, int]], list[int]]:
    """The scheduled sequences the next step may take one token ahead for, as (sequence,
    position of that token), and each one's row in this step's draw (`samplers`: what each
    sampler row is for). A decode, or a prompt's last chunk, with no drafts, that will not
    stop on its length, and for whose next token `reserve(seq, tokens)` took room."""
    index = {s: i for i, s in enumerate(samplers) if isinstance(s, Sequence)}
    items, rows = [], []
    for seq, n in scheduled:
        i = index.get(seq)
        nxt = seq.num_computed_tokens + n  # the position of the token this step draws
        if (i is None or seq.spec_token_ids or nxt != seq.num_tokens
                or (seq.params.max_tokens is not None and seq.num_output_tokens + 1 >= seq.params.max_tokens)
                or not reserve(seq, nxt + 1)):
            continue
        items.append((seq, nxt))
        rows.append(i)
    return items, rows
