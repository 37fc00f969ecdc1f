"""A step's tokens from its logits: sampling (row by row when the batched draw fails, so
only the request at fault is dropped), draft acceptance, the recurrent state rewound
when a draft is rejected, and prompt logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from macinfer.engine.sampler import Draw, SamplerOutput, sample
from macinfer.engine.sequence import Sequence, TokenLogprob
from macinfer.engine.speculative import DraftRow, accepted_tokens
from macinfer.engine.state_group import StateStep


@dataclass
class StepResult:
    seq: Sequence
    token_ids: list[int]  # new tokens: accepted drafts, then one sampled token
    logprobs: list  # per token: (logprob, top) or None
    recompute_from: int | None = None  # recurrent state rewound: tokens from here are computed again


def pick(logits: mx.array, rows: list, allowed: mx.array | None, sampler: bool, eos_token_ids: tuple[int, ...],
         drawn: Draw | None = None, step: StateStep | None = None, share=None
         ) -> tuple[SamplerOutput | None, list[StepResult], list[tuple[Sequence, Exception]]]:
    """Sample every row (`sampler`: this rank samples; else zeros, to be replaced by the
    driver's through `share`) or take the draw queued with the graph (`drawn`), accept
    each speculating sequence's drafts, and rewind (`step`: the state transaction) the
    recurrent state of one whose draft was rejected. Returns (the sampler's output, or
    None when the queued draw failed; what each sequence gains; per-sequence failures)."""
    row_owners = owners(rows)
    failed: dict[Sequence, Exception] = {}
    batched: SamplerOutput | None = None
    try:
        batched = drawn.result() if drawn is not None else sample(logits, rows, allowed, eos_token_ids) \
            if sampler else SamplerOutput([0] * len(rows), [None] * len(rows))
        out = batched
    except Exception:
        out = SamplerOutput([0] * len(rows), [None] * len(rows))
        for i, row in enumerate(rows):
            if row_owners[i] in failed:
                continue
            try:
                one = sample(logits[i : i + 1], [row], None if allowed is None else allowed[i : i + 1], eos_token_ids)
            except Exception as e:
                failed[row_owners[i]] = e
                continue
            out.token_ids[i], out.logprobs[i] = one.token_ids[0], one.logprobs[0]
    if share is not None:
        out.token_ids, out.logprobs, failed = share(out.token_ids, out.logprobs, failed, row_owners)
    results: list[StepResult] = []
    i = 0
    while i < len(rows):
        seq = row_owners[i]
        k = len(seq.spec_token_ids) if isinstance(rows[i], Sequence) and seq.spec_token_ids else 0
        if seq not in failed:
            tokens = accepted_tokens(seq.spec_token_ids if k else [], out.token_ids[i : i + k + 1])
            if seq.forced_token_ids:  # (a thinking budget's closing marker: no drafts meanwhile)
                results.append(StepResult(seq, [seq.forced_token_ids.pop(0)], [None]))
                i += k + 1
                continue
            results.append(StepResult(seq, tokens, out.logprobs[i : i + len(tokens)]))
            if k and len(tokens) <= k and step is not None:
                # A draft was rejected: the recurrent state consumed it. Back to the state
                # before the step; the real token and the accepted drafts are computed
                # again with the next one (cheaper than running each draft position
                # separately to keep its state: measured in the README).
                step.restore(seq)
                results[-1].recompute_from = seq.num_computed_tokens
        i += k + 1
    return batched, results, list(failed.items())


def record_prompt_logprobs(model, hidden: mx.array, spans: list[tuple[Sequence, int, int, int]]) -> None:
    """Logprob of each prompt token given the tokens before it (and the top
    alternatives), from the rows of this step's prompt chunks."""
    rows = [r for _, row, _, n in spans for r in range(row, row + n)]
    targets = [t for seq, _, pos, n in spans for t in seq.prompt_token_ids[pos + 1 : pos + 1 + n]]
    logits = model.logits(hidden[mx.array(rows)]).astype(mx.float32)
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


def owners(rows: list[Sequence | DraftRow]) -> list[Sequence]:
    """The sequence each sampler row belongs to (draft rows follow their sequence)."""
    owners: list[Sequence] = []
    for row in rows:
        owners.append(row if isinstance(row, Sequence) else owners[-1])
    return owners
