"""Recurrent-state slots and their prefix cache (the state "group" of a hybrid model).

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
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from macinfer.engine.sequence import Sequence
from macinfer.kv.state import StatePool


class StateSlots:
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
        self.verifying: dict[int, int] = {}  # id(seq) -> its spare, this step
        self.free_snapshots = list(range(pool.num_slots - 1, num_running + num_verify - 1, -1))
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # hash of the blocks before it -> slot
        self.marks: dict[int, int] = {}  # id(seq) -> its mark slot
        self.pending: list[tuple[bytes, int]] = []  # snapshots written by the step being built
        self.on_evict = None  # (slot, hash) of a snapshot about to be reused: the disk tier

    # -- slots -----------------------------------------------------------------
    def assign(self, seq: Sequence) -> None:
        if seq.state_slot is None:
            if not self.free_running:
                raise RuntimeError("no free state slot (more running sequences than max_num_seqs)")
            seq.state_slot = self.free_running.pop()
            self.owners[seq.state_slot] = seq

    def keep_before_verify(self, seq: Sequence) -> None:
        """Copy a speculating sequence's state aside before its verify step."""
        spare = self.verify_slots[len(self.verifying) % len(self.verify_slots)]
        self.verifying[id(seq)] = spare
        self.pool.copy(seq.state_slot, spare)

    def restore_before_verify(self, seq: Sequence) -> None:
        self.pool.copy(self.verifying[id(seq)], seq.state_slot)

    def end_step(self) -> None:
        self.verifying.clear()

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

    def release(self, seq: Sequence) -> None:
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

    # -- prefix hits -------------------------------------------------------------
    def longest_hit(self, hashes: list[bytes], limit: int, on_disk=None) -> int:
        """The most leading blocks (at most `limit`) whose end has a state snapshot, in
        memory or (`on_disk(hash)`) in the disk tier."""
        for m in range(limit, 0, -1):
            if hashes[m - 1] in self.snapshots or (on_disk is not None and on_disk(hashes[m - 1])):
                return m
        return 0

    def attach(self, seq: Sequence, hashes: list[bytes], hits: int, record=None, disk=None) -> None:
        """Start `seq`'s state from the snapshot at the hit's end (`record`: read from the disk)."""
        self.assign(seq)
        if hits and hashes[hits - 1] in self.snapshots:
            slot = self.snapshots[hashes[hits - 1]]
            self.snapshots.move_to_end(hashes[hits - 1])
            self.pool.copy(slot, seq.state_slot)
        elif hits:
            disk.restore_state(seq.state_slot, record)

    # -- snapshots during a step -------------------------------------------------
    def cuts(self, seq: Sequence, start: int, n: int) -> list[tuple[int, Any]]:
        """Where in `seq`'s next `n` tokens (from `start`) its state is to be kept, and
        into which slot: interval snapshots, and its mark at the last block boundary."""
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
            if h not in self.snapshots and all(h != q for q, _ in self.pending):
                slot = self._take()
                if slot is not None:
                    out.append((p - start, slot))
                    self.pending.append((h, slot))
        mark = self.marks.get(id(seq))
        if mark is None:
            mark = self._take()
            if mark is None:
                return out
            self.marks[id(seq)] = mark
        out.append((last - start, mark))
        seq.state_mark = last
        return out

    def publish_pending(self) -> None:
        """The step that writes the pending snapshots is built: later steps may hit them
        (their restoring copies come after its writes in MLX's graph)."""
        for h, slot in self.pending:
            if h in self.snapshots:
                self.free_snapshots.append(slot)
            else:
                self.snapshots[h] = slot
        self.pending.clear()

    def drop_cache(self) -> None:
        """Forget every snapshot (after a failed step the pool is reset)."""
        for _, slot in self.snapshots.items():
            self.free_snapshots.append(slot)
        for _, slot in self.pending:
            self.free_snapshots.append(slot)
        self.free_snapshots.extend(self.marks.values())  # running sequences' marks are gone too
        self.snapshots.clear()
        self.pending.clear()
        self.marks.clear()

    def stats(self) -> dict:
        return {"kind": "recurrent state", "slots_running": self.num_running - len(self.free_running),
                "snapshots": len(self.snapshots), "snapshot_interval": self.interval,
                "bytes_per_slot": self.pool.bytes_per_slot, "slots_total": self.pool.num_slots}
