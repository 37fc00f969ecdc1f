"""A scheduled step's forward pass: the graph for its inputs (`inputs`), the next decode
step built ahead while it computes (`engine/lookahead.py`), a pipeline's steps submitted
and finished, the evaluation; its tokens come from `verification`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from macinfer.engine.multi_rank import share_samples
from macinfer.engine.block_manager import BlockManager
from macinfer.engine.kv_groups import GroupBlocks
from macinfer.engine.lookahead import Lookahead, candidates
from macinfer.engine.profile import maybe
from macinfer.engine.runner.inputs import InputConfig, build_inputs, prompt_logprob_spans
from macinfer.engine.runner.verification import StepResult, pick, record_prompt_logprobs
from macinfer.engine.sampler import Draw, draw
from macinfer.engine.sequence import Sequence
from macinfer.engine.speculative import DraftRow
from macinfer.engine.state_group import StateStep
from macinfer.engine.structured import StructuredOutputs, allowed_tokens
from macinfer.kernels.paged_attention import PARTITION_SIZE
from macinfer.kv.attention import AttentionMetadata
from macinfer.kv.cache import KVCache


@dataclass
class Submitted:
    """A step in flight: its forward built (and on a worker, run), its tokens not yet sampled."""
    scheduled: list[tuple[Sequence, int]]
    logits: mx.array | None
    rows: list
    hidden: list[mx.array]
    step: StateStep | None = None  # its recurrent-state transaction


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, block_manager: BlockManager | None = None,
                 structured: StructuredOutputs | None = None, explicit_ops: bool = False,
                 prefill_tile: int | None = None, eos_token_ids: tuple[int, ...] = (),
                 mla_expand_from: int | None = None, decode_partition: int = PARTITION_SIZE,
                 decode_attention: str = "reference"):
        self.model = model
        self.decode_attention = decode_attention  # see AttentionMetadata
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
        self.groups: list[GroupBlocks | None] = block_manager.kv_groups if block_manager is not None else [None]
        self.state = block_manager.state if block_manager is not None else None
        self._step: StateStep | None = None  # the step's recurrent-state transaction (forward_logits)
        # Handed every forward's hidden rows with its scheduled sequences (an MTP head reads them).
        self.hidden_sink: Callable[[list[tuple[Sequence, int]], mx.array], None] | None = None

    @property
    def inputs(self) -> InputConfig:
        """The paths chosen at load that every step's metadata carries."""
        return InputConfig(self.block_size, self.explicit_ops, self.prefill_tile, self.mla_expand_from,
                           self.decode_partition, self.decode_attention)

    def prepare(
        self, scheduled: list[tuple[Sequence, int]], step: StateStep | None = None,
        ahead: tuple[mx.array, list[int]] | None = None
    ) -> tuple[mx.array, AttentionMetadata, list[int], list[Sequence | DraftRow]]:
        """The step's inputs (`inputs.build_inputs`), with this runner's groups and paths."""
        return build_inputs(scheduled, self.groups, self.kv_cache, self.inputs, self.state, step, ahead)

    def forward_logits(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[mx.array | None, list[Sequence | DraftRow]]:
        """Run the model; logits [N, vocab] for the rows that produce a token. Prompt
        logprobs of requests that ask for them are recorded on their sequences."""
        logits, seqs, self._hidden = [], [], []
        # Once per step: the lookahead built inside it prepares inputs again, under no transaction.
        step = self._step = self.state.begin() if self.state is not None else None
        ahead, self.ahead = self.ahead, None
        if ahead is not None:  # the decodes computed one step ahead; the rest as usual
            taken, seqs, scheduled = ahead.take(scheduled)
            if taken is not None:
                logits.append(taken)
                self.ahead_rows += len(seqs)
                if step is not None:
                    ahead.commit_states(seqs, self.state, step)
        parts = self._micro_batches(scheduled) if scheduled else []
        self.micro_batched_steps += len(parts) > 1
        for part in parts:
            with maybe(self.profile, "metadata"):
                input_ids, meta, rows, part_seqs = self.prepare(part, step)
            with maybe(self.profile, "graph"):
                hidden = self.model(input_ids, meta)
            # Over several ranks, evaluated every step: a pipeline stage's send is in it.
            self._hidden.append(hidden)
            if self.hidden_sink is not None:
                self.hidden_sink(part, hidden)
            if step is not None:
                step.commit()
            if rows:
                logits.append(self.model.logits(hidden[mx.array(rows)]))
                seqs.extend(part_seqs)
            spans = prompt_logprob_spans(part)
            if spans:
                record_prompt_logprobs(self.model, hidden, spans)
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

    def step(self, scheduled: list[tuple[Sequence, int]], reserve: Callable[[Sequence, int], bool] | None = None
             ) -> tuple[list[StepResult], list[tuple[Sequence, Exception]]]:
        """Forward + sample. Returns what each sampled sequence gains (one token, or
        its accepted drafts and one more) and per-sequence failures. If the batched
        sampler fails, rows are retried one by one so only the request that causes
        the failure is dropped. `reserve` (a sequence's next block, taken): build the
        next decode step ahead while this one computes (`engine/lookahead.py`)."""
        logits, rows = self.forward_logits(scheduled)
        step = self._step
        allowed, sampler, drawn = self._evaluate(scheduled, logits, rows, reserve)
        if logits is None:
            return [], []
        with maybe(self.profile, "sampler"):
            return self._pick(logits, rows, allowed, sampler, drawn, step)

    def submit(self, scheduled: list[tuple[Sequence, int]]) -> "Submitted":
        """A pipeline's step put in flight (`EngineConfig.pipeline_depth`): its forward is
        built; on a worker it is evaluated now (its stage sends the hidden state on), on the
        driver when `finish` takes it, after the next step is built behind it."""
        logits, rows = self.forward_logits(scheduled)
        # Every layer reads its pool after writing it, so the hidden state carries the K/V
        # writes. (Holding the pools here would keep the next step from updating them in
        # place: a copy of every pool a step.)
        sub = Submitted(scheduled, logits, rows, self._hidden, self._step)
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
            return self._pick(sub.logits, sub.rows, allowed, sampler, step=sub.step)

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
        with contextlib.ExitStack() as stack:
            # Its recurrent states set aside until the next step takes its rows.
            staged = stack.enter_context(self.state.staged()) if self.state is not None else None
            with maybe(self.profile, "graph"):
                logits = self.model.logits(self.model(input_ids, meta))
        with maybe(self.profile, "device"):
            # The state pool's own arrays too: this step's writes (snapshots, slot writes) done
            # now, in place, rather than left pending under a later write.
            mx.async_eval(logits, *([] if self.state is None else self.state.arrays()))
        self.ahead_built += len(items)
        self.ahead = Lookahead(logits, {seq: i for i, (seq, _) in enumerate(items)}, positions, rows)
        if staged is not None:  # the staged call holds the sequences in slot order (one decode call)
            assert len(meta.state.rounds) == 1 and len(meta.state.rounds[0]) == 1, meta.state.rounds
            by_slot = sorted((seq for seq, _ in items), key=lambda q: q.state_slot)
            self.ahead.staged, self.ahead.state_rows = staged, {q: j for j, q in enumerate(by_slot)}

    def _pick(self, logits: mx.array, rows: list, allowed: mx.array | None, sampler: bool,
              drawn: Draw | None = None, step: StateStep | None = None
              ) -> tuple[list[StepResult], list[tuple[Sequence, Exception]]]:
        share = None if self.dist is None else (lambda *a: share_samples(self.dist, *a))
        batched, results, failed = pick(logits, rows, allowed, sampler, self.eos_token_ids, drawn, step, share)
        if batched is None:
            self.ahead = None  # built on the draw that failed
        elif self.ahead is not None:  # the tokens it took as input, now known
            self.ahead.token_values = [batched.token_ids[i] for i in self.ahead.draw_rows]
        return results, failed
