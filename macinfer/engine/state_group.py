"""Recurrent state as a cache group: slots, snapshots for prefix hits, a transaction per step.

A sequence running a model with recurrent layers holds one slot of the state pool
(`kv/state.py`) from admission to finish or preemption; a preempted sequence's
state is dropped with its blocks and recomputed from its tokens (a snapshot, below,
usually shortens that).

Prefix caching cannot resume a recurrence from K/V blocks: it needs the state at
the hit's end. So states are snapshotted at block boundaries, keyed by the same
chained block hash as the K/V blocks before them (vLLM's "align" mode):

- every `interval` tokens of a sequence (a long shared prompt is found by a
  request that arrives while it still runs), and at the prompt's last block
  boundary (the same prompt sent again: a regenerate, a shared system prompt);
- the sequence's latest block boundary, kept in a *mark* slot while it runs (one
  copy each time a step crosses a boundary) and published when it finishes or is
  preempted. An agent loop's next turn (the previous prompt + answer + a tool
  result) resumes from there: at most one block short of what the turn shares.

A hit is the longest prefix whose K/V every attention group holds and whose end
has a snapshot. Snapshots are evicted least recently used; their count is planned
with the K/V blocks in the memory budget (`LLMEngine`).

`StateGroup` answers the block manager as a K/V group does (`GroupBlocks`: longest hit,
attach, can_allocate, allocate, publish, free, drop_cache, stats, the disk tier), so the
block manager iterates uniform groups (vLLM v1's `MambaManager` beside its single-type
managers). What a step does to states is one `StateStep` (begin -> keep/restore -> stage
-> commit), begun once per engine step: building the next step ahead inside a step
prepares inputs again but cannot reset it.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import mlx.core as mx

from macinfer.engine.sequence import Sequence
from macinfer.kv.state import StateCall, StatePool, slot_runs


@dataclass
class StateStep:
    """One engine step's transaction on the state group. `keep` copies a speculating
    sequence's state aside before its verify forward, `restore` puts it back when a draft
    is rejected; `stage` (through `StateGroup.cuts`) reserves the snapshot slots the step's
    graph writes; `commit` publishes them once that graph is built (later steps may hit
    them: their restoring copies come after its writes in MLX's graph)."""
    group: "StateGroup"
    kept: dict[int, int] = field(default_factory=dict)  # id(seq) -> its spare slot
    staged: list[tuple[bytes, int]] = field(default_factory=list)  # (hash, slot) written by the graph

    def keep(self, seq: Sequence) -> None:
        spares = self.group.verify_slots
        if len(self.kept) >= len(spares):
            raise RuntimeError(f"more speculating sequences in one step than verify slots ({len(spares)})")
        spare = spares[len(self.kept)]
        self.kept[id(seq)] = spare
        self.group.pool.copy(seq.state_slot, spare)

    def restore(self, seq: Sequence) -> None:
        spare = self.kept.get(id(seq))
        if spare is None:
            raise RuntimeError(f"request {seq.request_id}: its state was not kept before this step's verify")
        self.group.pool.copy(spare, seq.state_slot)

    def stage(self, h: bytes) -> int | None:
        """A slot for the snapshot named `h` this step's graph writes (None: none free)."""
        slot = self.group._take()
        if slot is not None:
            self.staged.append((h, slot))
        return slot

    def is_staged(self, h: bytes) -> bool:
        return any(h == q for q, _ in self.staged)

    def commit(self) -> None:
        """The graph writing the staged snapshots is built: publish them."""
        g = self.group
        for h, slot in self.staged:
            if h in g.snapshots:
                g.free_snapshots.append(slot)
            else:
                g.snapshots[h] = slot
        self.staged.clear()


class StateGroup:
    """The recurrent-state cache group (see the module docstring)."""

    index = -1  # the disk tier's name for it (K/V groups: their index)

    def __init__(self, pool: StatePool, num_running: int, block_size: int, interval: int,
                 enable_prefix_caching: bool = True, num_verify: int = 0):
        assert interval % block_size == 0
        self.pool, self.block_size, self.interval = pool, block_size, interval
        self.enable_prefix_caching = enable_prefix_caching
        self.num_running = num_running
        self.free_running = list(range(num_running - 1, -1, -1))  # popped lowest first
        self.owners: dict[int, Sequence] = {}  # running slot -> its sequence
        # Spares for speculating sequences' states before their verify step.
        self.verify_slots = list(range(num_running, num_running + num_verify))
        self.free_snapshots = list(range(pool.num_slots - 1, num_running + num_verify - 1, -1))
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # hash of the blocks before it -> slot
        self.marks: dict[int, int] = {}  # id(seq) -> its mark slot
        self.step: StateStep | None = None  # the engine step's transaction
        self.on_evict = None  # (slot, hash) of a snapshot about to be reused: the disk tier

    # -- the step's transaction ----------------------------------------------------
    def begin(self) -> StateStep:
        """A new engine step's transaction; the last one's staged snapshots must be committed."""
        if self.step is not None and self.step.staged:
            raise RuntimeError("a state step began before the last one committed its snapshots")
        self.step = StateStep(self)
        return self.step

    # -- a step built ahead (`engine/lookahead.py`) ------------------------------------
    @contextmanager
    def staged(self) -> Iterator[dict]:
        """While the next step's graph is built ahead: its new states are set aside (the
        dict filled: cache -> (call, values)), not written, until `commit_staged`."""
        staged: dict = {}
        self.pool.staging = staged
        try:
            yield staged
        finally:
            self.pool.staging = None

    def arrays(self) -> list[mx.array]:
        """The pool's arrays (evaluated with a step built ahead: its writes done in place)."""
        return self.pool.slot_arrays()

    def commit_staged(self, staged: dict, rows: dict[Sequence, int], seqs: list[Sequence], step: StateStep) -> None:
        """The new states of `seqs` (their `rows` in the staged call, in slot order), into
        their slots now (a finished request's slot may have moved one), with the snapshots
        their step takes, staged in `step` (a decode token's state is kept at the block
        boundary it completes, as `inputs.build_inputs` does); others stay as they were."""
        order = sorted(seqs, key=lambda s: s.state_slot)
        js = [rows[s] for s in order]
        taken = [s.state_slot for s in order]
        call = StateCall(rows=None, n=len(order), length=1, slots=mx.array(taken, dtype=mx.int32),
                         fresh=False, runs=slot_runs(taken))
        index = None if js == list(range(len(rows))) else mx.array(js, dtype=mx.int32)
        for cache, (_, values) in staged.items():
            self.pool.scatter(cache, call, [v if v is None or index is None else v[index] for v in values])
        for seq, j in zip(order, js):
            for _, dst in self.cuts(seq, seq.num_computed_tokens, 1, step):
                for cache, (_, values) in staged.items():
                    self.pool.write(cache, dst, [None if v is None else v[j : j + 1] for v in values])
        step.commit()

    # -- the group interface (as `GroupBlocks`) ----------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """A running slot for `seq` (every slot may be held: embedding jobs beside
        max_num_seqs requests)."""
        return seq.state_slot is not None or bool(self.free_running)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        if seq.state_slot is None:
            if not self.free_running:
                raise RuntimeError("no free state slot (more running sequences than max_num_seqs)")
            seq.state_slot = self.free_running.pop()
            self.owners[seq.state_slot] = seq

    def publish(self, seq: Sequence, start: int, end: int) -> None:
        """Nothing at schedule time: a step's snapshots are staged and committed by its
        transaction, a running sequence's mark when it is freed."""

    def _take(self) -> int | None:
        """A free snapshot slot, evicting the least recently used snapshot if need be."""
        if self.free_snapshots:
            return self.free_snapshots.pop()
        if self.snapshots:
            h, slot = self.snapshots.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(slot, h)
            return slot
        return None

    def free(self, seq: Sequence) -> None:
        """`seq` finished or was preempted: its slot is free, its mark becomes a snapshot."""
        if seq.state_slot is not None:
            self._free_running_slot(seq.state_slot)
            seq.state_slot = None
        mark, p = self.marks.pop(id(seq), None), seq.state_mark
        seq.state_mark = 0
        if mark is None:
            return
        h = seq.block_hashes[p // self.block_size - 1] if 0 < p <= len(seq.block_hashes) * self.block_size else None
        if h is None or h in self.snapshots:
            self.free_snapshots.append(mark)
        else:
            self.snapshots[h] = mark

    def _free_running_slot(self, slot: int) -> None:
        """Keep running slots packed low: the highest one moves into the hole (one state
        copy), so a decode batch's slots stay one run (see `StatePool`)."""
        del self.owners[slot]
        top = max(self.owners, default=-1)
        if top > slot:
            moved = self.owners.pop(top)
            self.pool.copy(top, slot)
            moved.state_slot, self.owners[slot] = slot, moved
            slot = top
        self.free_running.append(slot)
        self.free_running.sort(reverse=True)

    def longest_hit(self, hashes: list[bytes], limit: int, disk=None) -> int:
        """The most leading blocks (at most `limit`) whose end has a state snapshot, in
        memory or in the disk tier."""
        for m in range(limit, 0, -1):
            if hashes[m - 1] in self.snapshots or (disk is not None and disk.has_state(hashes[m - 1])):
                return m
        return 0

    def read_disk(self, hashes: list[bytes], hits: int, reads: dict, disk) -> int | None:
        """Read the hit's end snapshot from the disk into `reads` if memory lacks it; None
        when it read back, else the block count the hit must stay under."""
        h = hashes[hits - 1]
        if h in self.snapshots or (self.index, hits - 1) in reads:
            return None
        record = disk.read_state(h)
        if record is None:
            return hits - 1
        reads[self.index, hits - 1] = record
        return None

    def attach(self, seq: Sequence, hashes: list[bytes], hits: int, reads: dict | None = None,
               disk=None) -> int:
        """Start `seq`'s state from the snapshot at the hit's end (in memory, or read from
        the disk into `reads`). Returns the blocks the disk served: all `hits`, or none."""
        self.allocate(seq, 0)
        if hits and hashes[hits - 1] in self.snapshots:
            slot = self.snapshots[hashes[hits - 1]]
            self.snapshots.move_to_end(hashes[hits - 1])
            self.pool.copy(slot, seq.state_slot)
        elif hits:
            disk.restore_state(seq.state_slot, reads[self.index, hits - 1])
            return hits
        return 0

    def attach_disk(self, disk) -> None:
        self.on_evict = disk.evicted_state

    def disk_entries(self, disk) -> list[tuple[str, int, int]]:
        """What the disk tier writes at close: every snapshot it lacks."""
        return [(disk.state_key(h), self.index, slot) for h, slot in self.snapshots.items()
                if disk.state_key(h) not in disk.store]

    # -- snapshots during a step -------------------------------------------------
    def cuts(self, seq: Sequence, start: int, n: int, step: StateStep) -> list[tuple[int, Any]]:
        """Where in `seq`'s next `n` tokens (from `start`) its state is to be kept, and
        into which slot (staged in `step`): interval snapshots, and its mark at the last
        block boundary."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        bs, out = self.block_size, []
        last = (start + n) // bs * bs
        if last <= start or last > len(seq.block_hashes) * bs:
            return []
        wanted = list(range(-(-(start + 1) // self.interval) * self.interval, last + 1, self.interval))
        # The prompt's last boundary a re-sent or extended prompt can hit (one token is always computed).
        prompt_end = (seq.num_prompt_tokens - 1) // bs * bs
        if start < prompt_end <= last and prompt_end not in wanted:
            wanted.append(prompt_end)
        for p in wanted:
            h = seq.block_hashes[p // bs - 1]
            if h not in self.snapshots and not step.is_staged(h):
                slot = step.stage(h)
                if slot is not None:
                    out.append((p - start, slot))
        mark = self.marks.get(id(seq))
        if mark is None:
            mark = self._take()
            if mark is None:
                return out
            self.marks[id(seq)] = mark
        out.append((last - start, mark))
        seq.state_mark = last
        return out

    def drop_cache(self) -> None:
        """Forget every snapshot (after a failed step the pool is reset)."""
        for _, slot in self.snapshots.items():
            self.free_snapshots.append(slot)
        if self.step is not None:
            for _, slot in self.step.staged:
                self.free_snapshots.append(slot)
            self.step.staged.clear()
        self.free_snapshots.extend(self.marks.values())  # running sequences' marks are gone too
        self.snapshots.clear()
        self.marks.clear()

    def stats(self) -> dict:
        return {"kind": "recurrent state", "slots_running": self.num_running - len(self.free_running),
                "snapshots": len(self.snapshots), "snapshot_interval": self.interval,
                "bytes_per_slot": self.pool.bytes_per_slot, "slots_total": self.pool.num_slots,
                "caches": len(self.pool.specs), "bytes": self.pool.nbytes}
