"""Recurrent state on the flat ragged batch: the state pool and a step's plan for it.

A recurrent layer (Gated DeltaNet, Mamba, short convolutions, RWKV) keeps a fixed
state per sequence instead of K/V rows: mlx-lm's `ArraysCache` entries. Here each
entry of each such cache is one array `[num_slots, *shape]`; a running sequence
owns a slot, and snapshots of states at block boundaries (the prefix cache of
recurrent layers, `engine/state_group.py`) live in other slots of the same pool.

A step's rows are ragged (decode rows and prompt chunks of several sequences),
but a recurrence must see each sequence's tokens in order. `plan_state` groups
the scheduled sequences into *calls* of equal chunk length, so the model's own
recurrent module runs on a dense `[n, L]` batch with no padding (nothing to mask,
so every family's code computes exactly what it computes alone); decodes are one
call. A sequence's chunk may be cut into segments where its state is wanted
mid-chunk (a snapshot at a block boundary): the segments run in *rounds*, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from macinfer.kv.spec import StateSpec


class StatePool:
    """Every recurrent cache's entries, one `[num_slots, *shape]` array each.

    The states a call wrote stay *resident*: held as the call's own `[n, ...]` arrays,
    not written into the pool, until something else needs those slots. A decode batch
    whose sequences are the same as last step's (most steps) reads them as they are
    and replaces them, as mlx-lm's batch cache does: no gather out of the pool and no
    write back into it. Anything else that reads or writes those slots (another call,
    a slot copy, a snapshot, the disk tier) writes them into the pool first (`flush`)."""

    def __init__(self, specs: list[StateSpec], num_slots: int):
        self.specs, self.num_slots = specs, num_slots
        self.before_write = None  # the disk tier's hook: evicted snapshots copied out first
        self.staging: dict[int, tuple[StateCall, list[mx.array | None]]] | None = None
        self.reset()

    def reset(self) -> None:
        self.arrays = [[mx.zeros((self.num_slots, *s), dtype=d) for s, d in zip(spec.shapes, spec.dtypes)]
                       for spec in self.specs]
        # cache -> (the call, its entries' newest values; None: the pool's are current)
        self.resident: dict[int, tuple[StateCall, list[mx.array | None]]] = {}

    @property
    def bytes_per_slot(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.slot_arrays())

    def slot_arrays(self) -> list[mx.array]:
        """Every cache's entries, flat: the pool's own arrays (not the resident states)."""
        return [a for entries in self.arrays for a in entries]

    # MLX's CPU scatter costs ~5 ns an element (a decode step of 32 sequences of a small
    # Gated DeltaNet model: 31 of 104 ms), a slice update writes in place at memory speed:
    # calls list their slots in runs of consecutive ones, and a running batch's slots are
    # kept packed (`StateGroup`), so a decode call is one run.
    def gather(self, cache: int, call: "StateCall") -> list[mx.array]:
        held = self.resident.get(cache)
        if held is not None and held[0].runs == call.runs:
            return [a[call.slots] if v is None else v for a, v in zip(self.arrays[cache], held[1])]
        self.flush(cache)
        return [a[call.slots] for a in self.arrays[cache]]

    def scatter(self, cache: int, call: "StateCall", values: list[mx.array | None]) -> None:
        """`call`'s new states: kept resident (see the class), not written yet."""
        if self.staging is not None:  # a step built ahead: set aside (a second module's entries merged)
            held = self.staging.get(cache)
            if held is not None:
                values = [h if v is None else v for v, h in zip(values, held[1])]
            self.staging[cache] = (call, values)
            return
        if self.before_write is not None:
            self.before_write()
        held = self.resident.get(cache)
        if held is not None and held[0].runs != call.runs:
            self.flush(cache)
            held = None
        values = [None if v is None else v.astype(a.dtype) for a, v in zip(self.arrays[cache], values)]
        if held is not None:  # entries this call left alone keep their resident values
            values = [h if v is None else v for v, h in zip(values, held[1])]
        self.resident[cache] = (call, values)

    def flush(self, cache: int) -> None:
        """Write `cache`'s resident states into their slots."""
        held = self.resident.pop(cache, None)
        if held is None:
            return
        call, values = held
        for a, v in zip(self.arrays[cache], values):
            if v is None:
                continue
            if len(call.runs) > MAX_RUNS:
                a[call.slots] = v
                continue
            for off, start, n in call.runs:
                a[start : start + n] = v[off : off + n]

    def flush_slots(self, slots: set[int] | None = None) -> None:
        """Write the resident states of every cache that holds one of `slots` (None: all)."""
        for cache, (call, _) in list(self.resident.items()):
            if slots is None or any(start <= s < start + n for _, start, n in call.runs for s in slots):
                self.flush(cache)

    def write(self, cache: int, slot: int, values: list[mx.array | None]) -> None:
        """One sequence's state (`values` of shape [1, ...]) into `slot`."""
        if self.before_write is not None:
            self.before_write()
        self.flush_slots({slot})
        for a, v in zip(self.arrays[cache], values):
            if v is not None:
                a[slot : slot + 1] = v.astype(a.dtype)

    def copy(self, src: int, dst: int) -> None:
        """Slot `src` into slot `dst`, in every cache (a snapshot restored or kept, a state moved)."""
        if self.before_write is not None:
            self.before_write()
        self.flush_slots({src, dst})
        # Read, then write, each evaluated now: a slot read and written back in one graph
        # keeps the write from happening in place (a copy of the whole pool array), and
        # copies left pending into the next step made every later step copy whole pool
        # arrays too (Mamba-2 at 32 sequences: decode steps 65 -> 98-120 ms after the first
        # batch of requests finished, for as long as the engine ran).
        index = mx.array([src], dtype=mx.int32)
        rows = [a[index] for a in self.slot_arrays()]
        mx.eval(rows)
        for a, row in zip(self.slot_arrays(), rows):
            a[dst : dst + 1] = row
        mx.eval(self.state())

    def state(self) -> list[mx.array]:
        """Every array a step may have changed: the pool's and the resident states."""
        return self.slot_arrays() + \
            [v for _, values in self.resident.values() for v in values if v is not None]


MAX_RUNS = 8  # more runs of consecutive slots than this: one scatter


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(offset, first slot, length) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            off, start, n = runs[-1]
            runs[-1] = (off, start, n + 1)
        else:
            runs.append((i, s, 1))
    return runs


@dataclass
class StateCall:
    """One run of a recurrent module: `n` sequences' next `length` tokens each."""
    rows: mx.array | None  # [n * length] rows of the step's flat batch, sequence-major (None: a lookahead's commit)
    n: int
    length: int
    slots: mx.array  # [n] each sequence's slot (read before, written after), increasing
    fresh: bool  # no state yet (first tokens): the module starts from its own initial state
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # `slot_runs` of the slots
    saves: list[tuple[int, int]] = field(default_factory=list)  # (index into n, snapshot slot)


@dataclass
class StatePlan:
    """A step's recurrent calls, round by round, and how to put their rows back in order."""
    rounds: list[list[StateCall]]
    inverse: mx.array | None  # row order of the concatenated calls' outputs (None: already in order)


@dataclass
class SeqChunk:
    """One scheduled sequence as the state plan sees it."""
    row: int  # first row in the flat batch
    n: int  # rows (tokens) this step
    slot: int
    fresh: bool
    cuts: list[tuple[int, int]] = field(default_factory=list)  # (tokens into the chunk, snapshot slot)


def plan_state(chunks: list[SeqChunk]) -> StatePlan:
    segments = []
    for c in chunks:
        ends = sorted({e for e, _ in c.cuts if 0 < e < c.n} | {c.n})
        segs, a = [], 0
        for e in ends:
            segs.append((a, e, [d for off, d in c.cuts if off == e]))
            a = e
        segments.append(segs)
    rounds, order = [], []
    r = 0
    while True:
        live = [(i, segs[r]) for i, segs in enumerate(segments) if len(segs) > r]
        if not live:
            break
        by_key: dict[tuple[int, bool], list] = {}
        for i, seg in live:
            by_key.setdefault((seg[1] - seg[0], chunks[i].fresh and r == 0), []).append((i, seg))
        calls = []
        for (length, fresh), members in by_key.items():
            members.sort(key=lambda m: chunks[m[0]].slot)
            rows = np.concatenate([np.arange(chunks[i].row + a, chunks[i].row + b) for i, (a, b, _) in members])
            order.append(rows)
            slots = [chunks[i].slot for i, _ in members]
            saves = [(j, d) for j, (_, (_, _, dests)) in enumerate(members) for d in dests]
            calls.append(StateCall(rows=mx.array(rows, dtype=mx.int32), n=len(members), length=length,
                                   slots=mx.array(slots, dtype=mx.int32), fresh=fresh, runs=slot_runs(slots),
                                   saves=saves))
        rounds.append(calls)
        r += 1
    flat = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    inverse = None if np.array_equal(flat, np.arange(len(flat))) else mx.array(np.argsort(flat), dtype=mx.int32)
    return StatePlan(rounds, inverse)


def probe_plan(num_rows: int) -> StatePlan:
    """The load-time probe's rows as one fresh sequence (no pool: nothing is written)."""
    call = StateCall(rows=mx.arange(num_rows, dtype=mx.int32), n=1, length=num_rows,
                     slots=mx.zeros((1,), dtype=mx.int32), fresh=True, runs=[(0, 0, 1)])
    return StatePlan([[call]], None)
