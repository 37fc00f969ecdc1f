"""Which prompt chunks of a step are attended together.

A burst of short prompts would otherwise be one attention call per prompt per
layer; chunks of similar sizes are padded into one call (`SpanBatch`), and where
each chunk's output rows lie is worked out once a step on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the flat batch
    length: int  # tokens in this chunk
    context_len: int  # tokens in cache after this chunk (prefix + chunk)
    block_table: mx.array  # [num_blocks_for_context] int32
    key_offset: int = 0  # position of the table's first key (a bounded group's tables start late)
    # The last key position each query may read when some read past themselves (an image's
    # tokens attending both ways, `vision/inputs.py`); None: causal.
    key_ceilings: np.ndarray | None = None
    # The sequence's prompt length where some query reads the prompt and a window after it
    # with keys between unread (`PromptAndWindow`: a preempted sequence's recompute); None: causal.
    prompt_len: int | None = None


# Prompt chunks this short, with this little context, are attended together in one
# padded call per group of similar sizes rather than one call each: a burst of short
# prompts is one dispatch per layer, not one per prompt (16 x 32-token prompts on
# the CPU: attention 227 -> ~80-135 ms of a ~1 s step).
BATCH_SPAN_TOKENS = 128
BATCH_SPAN_CONTEXT = 1024
# A group's padded scores (query x key, per head) may be this many times its real
# ones, plus this many per span: about what one call's overhead costs in scores on
# the CPU (~0.4 ms a call, SmolLM2's 9 heads).
BATCH_PADDING = 1.5
BATCH_SLACK = 4096


@dataclass
class SpanBatch:
    spans: list[int]  # indices into the step's prefill spans
    q_rows: mx.array  # [n * length]: each span's rows of the flat batch (pads repeat its last row)
    tables: mx.array  # [n, nb] block tables, padded
    qpos: np.ndarray  # [n, length] each query's position in its span's context
    key_offsets: np.ndarray  # [n] position of each span's first key
    length: int
    context: int


def group_spans(spans: list[PrefillSpan]) -> list[list[int]]:
    """Groups (>= 2 spans each) of short spans whose padded attention costs at most
    BATCH_PADDING times their own plus BATCH_SLACK a span; other spans are attended alone."""
    short = sorted((i for i, s in enumerate(spans)  # (a span with a mask of its own is attended alone)
                    if s.length <= BATCH_SPAN_TOKENS and s.context_len <= BATCH_SPAN_CONTEXT
                    and s.key_ceilings is None and s.prompt_len is None),
                   key=lambda i: (spans[i].context_len, spans[i].length), reverse=True)
    groups: list[list[int]] = [[]]
    for i in short:
        trial = groups[-1] + [i]
        padded = len(trial) * max(spans[j].length for j in trial) * max(spans[j].context_len for j in trial)
        real = sum(spans[j].length * spans[j].context_len for j in trial)
        if groups[-1] and padded > BATCH_PADDING * real + BATCH_SLACK * len(trial):
            groups.append([i])
        else:
            groups[-1] = trial
    return [g for g in groups if len(g) >= 2]


def _span_batch(spans: list[PrefillSpan], group: list[int]) -> SpanBatch:
    length = max(spans[i].length for i in group)
    context = max(spans[i].context_len for i in group)
    nb = max(spans[i].block_table.shape[0] for i in group)
    tables = np.zeros((len(group), nb), np.int32)
    rows = np.zeros((len(group), length), np.int32)
    qpos = np.zeros((len(group), length), np.int32)
    for b, i in enumerate(group):
        s = spans[i]
        tables[b, : s.block_table.shape[0]] = np.array(s.block_table)
        j = np.minimum(np.arange(length), s.length - 1)
        rows[b] = s.start + j
        qpos[b] = s.context_len - s.length + j
    offsets = np.array([spans[i].key_offset for i in group])
    return SpanBatch(group, mx.array(rows.reshape(-1)), mx.array(tables), qpos, offsets, length, context)


def plan_prefills(spans: list[PrefillSpan]) -> tuple[list[SpanBatch], list[int], mx.array | None]:
    """(batched groups, spans attended alone, where each prefill row's output lies in
    the concatenation of the groups' padded outputs and then the lone spans'; None
    when nothing is batched and the outputs are already in order)."""
    batches = [_span_batch(spans, g) for g in group_spans(spans)]
    if not batches:
        return [], list(range(len(spans))), None
    batched = {i for b in batches for i in b.spans}
    alone = [i for i in range(len(spans)) if i not in batched]
    where: dict[int, int] = {}  # span -> first row of its output
    at = 0
    for b in batches:
        for k, i in enumerate(b.spans):
            where[i] = at + k * b.length
        at += len(b.spans) * b.length
    for i in alone:
        where[i], at = at, at + spans[i].length
    index = np.concatenate([np.arange(where[i], where[i] + s.length) for i, s in enumerate(spans)])
    return batches, alone, mx.array(index.astype(np.int32))


def batch_mask(b: SpanBatch, kind=None) -> mx.array:
    """[n, 1, length, context]: causal within each span's context, from the floor the
    group's kind (a sliding window, a local chunk) puts on each query."""
    qpos = b.qpos[:, :, None]
    kpos = np.arange(b.context)[None, None, :]
    mask = kpos <= qpos
    if kind is not None and kind.bounded:
        offsets = b.key_offsets[:, None, None]
        mask &= kpos >= kind.key_floor(qpos + offsets) - offsets
    return mx.array(mask[:, None])
