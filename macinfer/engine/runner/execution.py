"""Turns a scheduled step into one ragged forward pass and samples from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macinfer.kernels.paged_attention import PARTITION_SIZE
from macinfer.kv.attention import AttentionMetadata
from macinfer.kv.prefill_plan import PrefillSpan
from macinfer.engine.block_manager import BlockManager, GroupBlocks
from macinfer.distributed.engine import share_samples
from macinfer.engine.lookahead import Lookahead, candidates
from macinfer.engine.profile import maybe
from macinfer.engine.sampler import Draw, SamplerOutput, draw, sample
from macinfer.engine.sequence import Sequence, TokenLogprob
from macinfer.engine.speculative import DraftRow, accepted_tokens, verify_rows
from macinfer.engine.structured import StructuredOutputs, allowed_tokens
from macinfer.kv.cache import KVCache
from macinfer.kv.spec import cdiv
from macinfer.kv.state import SeqChunk, plan_state


class _GroupTables:
    """Slots and block tables of one cache group for a step, as they are gathered."""

    def __init__(self, group: GroupBlocks | None, block_size: int):
        self.group, self.bs = group, block_size
        self.kind = None if group is None else group.kind
        self.slots: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.decode_floors: list[int] = []
        self.decode_groups: list[tuple[int, int]] = []
        self.prefills: list[PrefillSpan] = []

    def add(self, table: list[int], pos: np.ndarray, row: int, as_decodes: bool = False) -> None:
        """One scheduled sequence: new tokens at `pos`, rows from `row`. A bounded group's
        tables start at the first block the step's first query reads. A single token, or
        a speculating sequence (`as_decodes`: its real token and drafts), is attended as
        decode rows, one per token, each with its own context length: the in-place
        decode path, with no gathered copy of the context."""
        bs = self.bs
        bounded = self.kind is not None and self.kind.bounded
        first_block = self.group.first_block(int(pos[0])) if bounded else 0
        origin = first_block * bs
        t = np.asarray(table, dtype=np.int64)
        self.slots.extend((t[pos // bs] * bs + pos % bs).tolist())
        if len(pos) == 1 or as_decodes:
            if as_decodes:
                self.decode_groups.append((len(self.decode_tables), len(pos)))
            for p in pos.tolist():
                self.decode_tables.append(table[first_block : cdiv(p + 1, bs)])
                self.decode_lens.append(p + 1 - origin)  # counted from the table's first block
                if bounded:
                    self.decode_floors.append(int(self.kind.key_floor(p)) - origin)
            return
        context = int(pos[-1]) + 1
        blocks = table[first_block : cdiv(context, bs)]
        self.prefills.append(PrefillSpan(row, len(pos), context - origin, mx.array(blocks, dtype=mx.int32), origin))

    def metadata(self, kv_cache: KVCache, positions: mx.array, explicit_ops: bool,
                 prefill_tile: int | None, mla_expand_from: int | None = None,
                 decode_partition: int = PARTITION_SIZE) -> AttentionMetadata:
        meta = AttentionMetadata(
            kv_cache=kv_cache,
            positions=positions,
            slots=np.asarray(self.slots, dtype=np.int64),
            kind=self.kind,
            explicit_ops=explicit_ops,
            prefill_tile=prefill_tile,
            mla_expand_from=mla_expand_from,
            decode_partition=decode_partition,
            num_decodes=len(self.decode_tables),
            prefills=self.prefills,
            decode_groups=self.decode_groups,
        )
        # The attention takes plain decode rows first, then each speculating group.
        assert not self.decode_groups or sum(n for _, n in self.decode_groups) == \
            len(self.decode_tables) - self.decode_groups[0][0], "plain decodes must precede speculating ones"
        if self.decode_tables:
            width = max(len(t) for t in self.decode_tables)
            padded = np.zeros((len(self.decode_tables), width), dtype=np.int32)
            for i, t in enumerate(self.decode_tables):
                padded[i, : len(t)] = t
            meta.decode_block_tables = mx.array(padded)
            meta.decode_context_lens = mx.array(self.decode_lens, dtype=mx.int32)
            meta.decode_max_context = max(self.decode_lens)
            if self.decode_floors and max(self.decode_floors) > 0:
                meta.decode_floors = mx.array(self.decode_floors, dtype=mx.int32)
        return meta


@dataclass
class Submitted:
    """A step in flight: its forward built (and on a worker, run), its tokens not yet sampled."""
    scheduled: list[tuple[Sequence, int]]
    logits: mx.array | None
    rows: list
    hidden: list[mx.array]


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, block_manager: BlockManager | None = None,
                 structured: StructuredOutputs | None = None, explicit_ops: bool = False,
                 prefill_tile: int | None = None, eos_token_ids: tuple[int, ...] = (),
                 mla_expand_from: int | None = None, decode_partition: int = PARTITION_SIZE):
        self.model = model
        self.decode_partition = decode_partition  # see AttentionMetadata
        self.eos_token_ids = tuple(eos_token_ids)  # what `min_tokens` holds back
        self.explicit_ops = explicit_ops  # see AttentionMetadata
        self.prefill_tile = prefill_tile
        self.mla_expand_from = mla_expand_from  # see AttentionMetadata
        self.dist = None  # over several ranks: rank 0 samples, the others take its tokens
        self.micro_batches = 1  # pipeline mode: forwards a step is cut into (EngineConfig)
        self.profile = None  # a StepProfile while `macinfer bench profile` runs
        self.micro_batched_steps = 0  # pipeline steps run as several micro-batches
        self.ahead: Lookahead | None = None  # the next decode step, queued while this one computes
        self.ahead_rows = 0  # rows taken from a lookahead, and built (`bench profile`, tests)
        self.ahead_built = 0
        self.structured = structured
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.groups: list[GroupBlocks | None] = block_manager.groups if block_manager is not None else [None]
        self.state = block_manager.state if block_manager is not None else None

    def prepare(
        self, scheduled: list[tuple[Sequence, int]], snapshots: bool = False,
        ahead: tuple[mx.array, list[int]] | None = None
    ) -> tuple[mx.array, AttentionMetadata, list[int], list[Sequence | DraftRow]]:
        """Flat inputs for `scheduled` (decodes and speculating sequences first, then
        prompt chunks: the scheduler's order). Returns (input_ids, metadata,
        rows to sample, what each row samples for: a sequence, or one of its drafts).
        `snapshots`: keep recurrent states at block boundaries for the prefix cache
        (generation steps; their caller publishes them once the forward is built).
        `ahead`: (input ids, positions) of one decode token per sequence, the next step's,
        built while this one computes (`engine/lookahead.py`)."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence | DraftRow] = []
        tables = [_GroupTables(g, self.block_size) for g in self.groups]
        chunks: list[SeqChunk] = []
        if self.state is not None:
            self.state.end_step()

        for k, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens if ahead is None else ahead[1][k]
            row = len(positions)
            drafts = seq.spec_token_ids
            real = n - len(drafts)
            if ahead is None:
                ids.extend(seq.token_slice(start, start + real))
                ids.extend(drafts)
            pos = np.arange(start, start + n)
            positions.extend(pos.tolist())
            for g, t in enumerate(tables):
                t.add(seq.block_tables[g], pos, row, as_decodes=bool(drafts))
            if self.state is not None:
                if drafts:  # its state before the drafts, restored if one is rejected
                    self.state.keep_before_verify(seq)
                cuts = self.state.cuts(seq, start, real) if snapshots else []
                chunks.append(SeqChunk(row, n, seq.state_slot, start == 0, cuts))
            if ahead is not None or start + real == seq.num_tokens:
                # A speculating sequence samples at its real token and after each draft.
                sample_rows.extend(range(row + real - 1, row + n))
                sample_seqs.extend(verify_rows(seq) if drafts else [seq])

        pos_arr = mx.array(positions, dtype=mx.int32)
        metas = [t.metadata(self.kv_cache, pos_arr, self.explicit_ops, self.prefill_tile,
                            self.mla_expand_from, self.decode_partition) for t in tables]
        meta = metas[0] if metas else AttentionMetadata(self.kv_cache, pos_arr, np.zeros(0, dtype=np.int64))
        meta.groups = metas
        if self.state is not None:
            meta.state = plan_state(chunks)
        input_ids = ahead[0] if ahead is not None else mx.array(ids, dtype=mx.int32)
        return input_ids, meta, sample_rows, sample_seqs

    def forward_logits(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[mx.array | None, list[Sequence | DraftRow]]:
        """Run the model; logits [N, vocab] for the rows that produce a token. Prompt
        logprobs of requests that ask for them are recorded on their sequences."""
        logits, seqs, self._hidden = [], [], []
        ahead, self.ahead = self.ahead, None
        if ahead is not None:  # the decodes computed one step ahead; the rest as usual
            taken, seqs, scheduled = ahead.take(scheduled)
            if taken is not None:
                logits.append(taken)
                self.ahead_rows += len(seqs)
                if self.state is not None:
                    ahead.commit_states(seqs, self.state)
        parts = self._micro_batches(scheduled) if scheduled else []
        self.micro_batched_steps += len(parts) > 1
        for part in parts:
            with maybe(self.profile, "metadata"):
                input_ids, meta, rows, part_seqs = self.prepare(part, snapshots=True)
            with maybe(self.profile, "graph"):
                hidden = self.model(input_ids, meta)
            # Over several ranks, evaluated every step: a pipeline stage's send is in it.
            self._hidden.append(hidden)
            if self.state is not None:
                self.state.publish_pending()
            if rows:
                logits.append(self.model.logits(hidden[mx.array(rows)]))
                seqs.extend(part_seqs)
            spans = _prompt_logprob_spans(part)
            if spans:
                self._record_prompt_logprobs(hidden, spans)
        if not logits:
            return None, seqs
        return (logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=0)), seqs

    def _micro_batches(self, scheduled: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
        """The step's sequences in one forward, or, in pipeline mode, in `micro_batches`
        forwards of about equal tokens, built as one graph: a stage sends a micro-batch on
        and starts the next while the following stage takes the first, so the stages
        overlap instead of waiting in turn (recurrent models: one, as their state plan is
        a step's). Off by default: with a core per rank it lowers decode throughput (0.70x at
        2), since each micro-batch reads the stage's weights again (docs/distributed.md)."""
        n = self.micro_batches if self.dist is not None and self.dist.mode == "pipeline" else 1
        if n == 1 or self.state is not None or len(scheduled) < n:
            return [scheduled]
        total = sum(k for _, k in scheduled)
        parts: list[list[tuple[Sequence, int]]] = [[]]
        done = 0
        for i, item in enumerate(scheduled):  # contiguous (the order prepare expects), cut at token quantiles
            left_parts, left_seqs = n - len(parts), len(scheduled) - i
            if parts[-1] and left_parts and (done >= total * len(parts) / n or left_seqs <= left_parts):
                parts.append([])
            parts[-1].append(item)
            done += item[1]
        return parts

    def _record_prompt_logprobs(self, hidden: mx.array, spans: list[tuple[Sequence, int, int, int]]) -> None:
        """Logprob of each prompt token given the tokens before it (and the top
        alternatives), from the rows of this step's prompt chunks."""
        rows = [r for _, row, _, n in spans for r in range(row, row + n)]
        targets = [t for seq, _, pos, n in spans for t in seq.prompt_token_ids[pos + 1 : pos + 1 + n]]
        logits = self.model.logits(hidden[mx.array(rows)]).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, mx.array(targets)[:, None], axis=-1)[:, 0]
        k = max(seq.params.prompt_logprobs for seq, *_ in spans)
        top_ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k] if k else None
        top_lp = mx.take_along_axis(lp, top_ids, axis=-1) if k else None
        mx.eval(chosen, *([top_ids, top_lp] if k else []))
        chosen_l = chosen.tolist()
        top_ids_l, top_lp_l = (top_ids.tolist(), top_lp.tolist()) if k else ([], [])
        i = 0
        for seq, _, pos, n in spans:
            want = seq.params.prompt_logprobs
            if len(seq.prompt_logprobs) < seq.num_prompt_tokens:
                seq.prompt_logprobs = [None] * seq.num_prompt_tokens
            for j in range(n):
                top = sorted(zip(top_ids_l[i], top_lp_l[i]), key=lambda t: -t[1])[:want] if want else []
                seq.prompt_logprobs[pos + 1 + j] = TokenLogprob(targets[i], chosen_l[i], top)
                i += 1

    def step(self, scheduled: list[tuple[Sequence, int]], reserve: Callable[[Sequence, int], bool] | None = None
             ) -> tuple[list[StepResult], list[tuple[Sequence, Exception]]]:
        """Forward + sample. Returns what each sampled sequence gains (one token, or
        its accepted drafts and one more) and per-sequence failures. If the batched
        sampler fails, rows are retried one by one so only the request that causes
        the failure is dropped. `reserve` (a sequence's next block, taken): build the
        next decode step ahead while this one computes (`engine/lookahead.py`)."""
        logits, rows = self.forward_logits(scheduled)
        allowed, sampler, drawn = self._evaluate(scheduled, logits, rows, reserve)
        if logits is None:
            return [], []
        with maybe(self.profile, "sampler"):
            return self._pick(logits, rows, allowed, sampler, drawn)

    def submit(self, scheduled: list[tuple[Sequence, int]]) -> "Submitted":
        """A pipeline's step put in flight (`EngineConfig.pipeline_depth`): its forward is
        built; on a worker it is evaluated now (its stage sends the hidden state on), on the
        driver when `finish` takes it, after the next step is built behind it."""
        logits, rows = self.forward_logits(scheduled)
        # Every layer reads its pool after writing it, so the hidden state carries the K/V
        # writes. (Holding the pools here would keep the next step from updating them in
        # place: a copy of every pool a step.)
        sub = Submitted(scheduled, logits, rows, self._hidden)
        if self.dist is not None and not self.dist.is_driver:
            with maybe(self.profile, "device"):
                mx.eval(*sub.hidden)
        return sub

    def finish(self, sub: "Submitted") -> tuple[list[StepResult], list[tuple[Sequence, Exception]]]:
        """Evaluate a submitted step and sample it (the driver), or take the driver's tokens."""
        sampler = self.dist is None or self.dist.is_driver
        with maybe(self.profile, "device"):
            mx.eval(*([] if sub.logits is None or not self._needs_logits() else [sub.logits]), *sub.hidden)
        if sub.logits is None:
            return [], []
        allowed = self._allowed(sub.rows, sub.logits) if sampler and self._has_grammar(sub.rows) else None
        with maybe(self.profile, "sampler"):
            return self._pick(sub.logits, sub.rows, allowed, sampler)

    def _evaluate(self, scheduled: list[tuple[Sequence, int]], logits: mx.array | None, rows: list,
                  reserve: Callable[[Sequence, int], bool] | None) -> tuple[Any, bool, Draw | None]:
        """Run the step's graph; (the tokens grammars allow per row, whether this rank
        samples, the draw when it was queued with the graph)."""
        # The K/V writes are evaluated with the logits (every layer reads its pool after
        # writing it), unless the step samples nothing. A lookahead writes the same pool
        # objects, so they must not be in the list it waits on (it evaluates them itself).
        ahead = reserve is not None and logits is not None and self.dist is None
        sampler = self.dist is None or self.dist.is_driver
        outputs = [*([] if logits is None or not self._needs_logits() else [logits]),
                   *([] if ahead else self.kv_cache.state())]
        if self.dist is not None:  # (a chunk that samples nothing still sends its hidden state on)
            outputs.extend(self._hidden)
        allowed, drawn = None, None
        grammar = logits is not None and sampler and self._has_grammar(rows)
        if grammar or ahead:
            # Grammar masks are computed on the host while the device runs the forward pass.
            with maybe(self.profile, "device"):  # (MLX's CPU backend returns near the graph's end)
                mx.async_eval(*outputs)
            if grammar:
                allowed = self._allowed(rows, logits)
        if ahead:
            items, draw_rows = candidates(scheduled, rows, reserve)
            if items:
                try:
                    with maybe(self.profile, "sampler"):
                        drawn = draw(logits, rows, allowed, self.eos_token_ids)
                except Exception:
                    drawn = None  # a row's bad parameter: `_pick` retries row by row, no lookahead
                if drawn is not None:
                    with maybe(self.profile, "device"):
                        mx.async_eval(drawn.tokens)
                    self._build_ahead(items, drawn.tokens, draw_rows)
        if ahead and self.ahead is None and self.state is not None:
            outputs.extend(self.kv_cache.state())  # built nothing: the states are evaluated here
        # Evaluate the forward pass on its own: an error here (e.g. out of memory
        # inside the graph) is the batch's, and must not reach the per-row retry
        # below, where MLX would hand back the failed arrays as if evaluated.
        with maybe(self.profile, "device"):
            mx.eval(*outputs)
        return allowed, sampler, drawn

    def _has_grammar(self, rows: list) -> bool:
        return self.structured is not None and any(s.matcher is not None for s in rows)

    def _allowed(self, rows: list, logits: mx.array) -> mx.array:
        """The tokens each row's grammar allows now, as a mask over the vocabulary."""
        return allowed_tokens(self.structured.bitmask(rows), logits.shape[1])

    def _needs_logits(self) -> bool:
        """Whether this rank evaluates the logits: a pipeline worker's come from its own
        stage's output and are never read (tensor-parallel ranks all run the head: it may
        hold a collective)."""
        return self.dist is None or self.dist.is_driver or self.dist.mode == "tensor"

    def _build_ahead(self, items: list[tuple[Sequence, int]], tokens: mx.array, rows: list[int]) -> None:
        """Queue the next step's forward for `items` (sequence, the position of its next
        token), its input ids this step's `tokens` at `rows`."""
        ids = tokens if rows == list(range(tokens.shape[0])) else tokens[mx.array(rows)]
        ids = ids.astype(mx.int32)
        positions = [p for _, p in items]
        with maybe(self.profile, "metadata"):
            input_ids, meta, _, _ = self.prepare([(seq, 1) for seq, _ in items], ahead=(ids, positions))
        pool = self.kv_cache.states if self.state is not None else None
        if pool is not None:
            pool.staging = {}  # its recurrent states set aside until the next step takes its rows
        try:
            with maybe(self.profile, "graph"):
                logits = self.model.logits(self.model(input_ids, meta))
        finally:
            staged = None if pool is None else pool.staging
            if pool is not None:
                pool.staging = None
        with maybe(self.profile, "device"):
            # The pool's own arrays too: this step's writes (snapshots, slot writes) done now,
            # in place, rather than left pending under a later write.
            mx.async_eval(logits, *([] if pool is None else pool.slot_arrays()))
        self.ahead_built += len(items)
        self.ahead = Lookahead(logits, {seq: i for i, (seq, _) in enumerate(items)}, positions, rows)
        if pool is not None:  # the staged call holds the sequences in slot order (one decode call)
            assert len(meta.state.rounds) == 1 and len(meta.state.rounds[0]) == 1, meta.state.rounds
            by_slot = sorted((seq for seq, _ in items), key=lambda q: q.state_slot)
            self.ahead.states, self.ahead.state_rows = staged, {q: j for j, q in enumerate(by_slot)}

    def _pick(self, logits: mx.array, rows: list, allowed: mx.array | None, sampler: bool,
              drawn: Draw | None = None) -> tuple[list[StepResult], list[tuple[Sequence, Exception]]]:
        owners = _owners(rows)
        failed: dict[Sequence, Exception] = {}
        try:
            out = drawn.result() if drawn is not None else sample(logits, rows, allowed, self.eos_token_ids) \
                if sampler else SamplerOutput([0] * len(rows), [None] * len(rows))
            if self.ahead is not None:  # the tokens it took as input, now known
                self.ahead.token_values = [out.token_ids[i] for i in self.ahead.draw_rows]
        except Exception:
            self.ahead = None  # built on the draw that failed
            out = SamplerOutput([0] * len(rows), [None] * len(rows))
            for i, row in enumerate(rows):
                if owners[i] in failed:
                    continue
                try:
                    one = sample(logits[i : i + 1], [row], None if allowed is None else allowed[i : i + 1],
                                 self.eos_token_ids)
                except Exception as e:
                    failed[owners[i]] = e
                    continue
                out.token_ids[i], out.logprobs[i] = one.token_ids[0], one.logprobs[0]
        if self.dist is not None:
            out.token_ids, out.logprobs, failed = share_samples(self.dist, out.token_ids, out.logprobs, failed, owners)
        results: list[StepResult] = []
        i = 0
        while i < len(rows):
            seq = owners[i]
            k = len(seq.spec_token_ids) if isinstance(rows[i], Sequence) and seq.spec_token_ids else 0
            if seq not in failed:
                tokens = accepted_tokens(seq.spec_token_ids if k else [], out.token_ids[i : i + k + 1])
                if seq.forced_token_ids:  # (a thinking budget's closing marker: no drafts meanwhile)
                    results.append(StepResult(seq, [seq.forced_token_ids.pop(0)], [None]))
                    i += k + 1
                    continue
                results.append(StepResult(seq, tokens, out.logprobs[i : i + len(tokens)]))
                if k and len(tokens) <= k and self.state is not None:
                    # A draft was rejected: the recurrent state consumed it. Back to the state
                    # before the step; the real token and the accepted drafts are computed
                    # again with the next one (cheaper than running each draft position
                    # separately to keep its state: measured in the README).
                    self.state.restore_before_verify(seq)
                    results[-1].recompute_from = seq.num_computed_tokens
            i += k + 1
        return results, list(failed.items())


@dataclass
class StepResult:
    seq: Sequence
    token_ids: list[int]  # new tokens: accepted drafts, then one sampled token
    logprobs: list  # per token: (logprob, top) or None
    recompute_from: int | None = None  # recurrent state rewound: tokens from here are computed again


def _prompt_logprob_spans(scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, int, int]]:
    """(sequence, first row, first position, rows) of prompt positions whose next
    prompt token's logprob is wanted in this step (rows follow the scheduled order)."""
    spans, row = [], 0
    for seq, n in scheduled:
        start = seq.num_computed_tokens
        if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            spans.append((seq, row, start, min(start + n, seq.num_prompt_tokens - 1) - start))
        row += n
    return spans


def _owners(rows: list[Sequence | DraftRow]) -> list[Sequence]:
    """The sequence each sampler row belongs to (draft rows follow their sequence)."""
    owners: list[Sequence] = []
    for row in rows:
        owners.append(row if isinstance(row, Sequence) else owners[-1])
    return owners
