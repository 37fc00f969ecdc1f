"""Turns a scheduled step into one ragged forward pass and samples from it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macinfer.attention import AttentionMetadata, PrefillSpan
from macinfer.engine.block_manager import cdiv
from macinfer.engine.sampler import SamplerOutput, sample
from macinfer.engine.sequence import Sequence
from macinfer.kv_cache import KVCache


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size

    def prepare(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[mx.array, AttentionMetadata, list[int], list[Sequence]]:
        """Flat inputs for `scheduled` (decodes first). Returns
        (input_ids, metadata, rows to sample, sequences those rows belong to)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []

        for seq, n in scheduled:
            start = seq.num_computed_tokens
            row = len(ids)
            ids.extend(seq.token_slice(start, start + n))
            pos = np.arange(start, start + n)
            positions.extend(pos.tolist())
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            context = start + n
            blocks = seq.block_table[: cdiv(context, bs)]
            if n == 1:
                decode_tables.append(blocks)
                decode_lens.append(context)
            else:
                prefills.append(PrefillSpan(row, n, context, mx.array(blocks, dtype=mx.int32)))
            if context == seq.num_tokens:
                sample_rows.append(row + n - 1)
                sample_seqs.append(seq)

        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            positions=mx.array(positions, dtype=mx.int32),
            slot_mapping=mx.array(slots, dtype=mx.int32),
            num_decodes=len(decode_tables),
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = np.zeros((len(decode_tables), width), dtype=np.int32)
            for i, t in enumerate(decode_tables):
                padded[i, : len(t)] = t
            meta.decode_block_tables = mx.array(padded)
            meta.decode_context_lens = mx.array(decode_lens, dtype=mx.int32)
            meta.decode_max_context = max(decode_lens)
        return mx.array(ids, dtype=mx.int32), meta, sample_rows, sample_seqs

    def forward_logits(self, scheduled: list[tuple[Sequence, int]]) -> tuple[mx.array | None, list[Sequence]]:
        """Run the model; logits [N, vocab] for the rows that produce a token."""
        input_ids, meta, rows, seqs = self.prepare(scheduled)
        hidden = self.model(input_ids, meta)
        logits = self.model.logits(hidden[mx.array(rows)]) if rows else None
        return logits, seqs

    def step(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[list[Sequence], SamplerOutput, list[tuple[Sequence, Exception]]]:
        """Forward + sample. Returns (sampled sequences, their tokens, per-sequence
        failures). If the batched sampler fails, rows are retried one by one so
        only the request that causes the failure is dropped."""
        logits, seqs = self.forward_logits(scheduled)
        # Evaluate the forward pass on its own: an error here (e.g. out of memory
        # inside the graph) is the batch's, and must not reach the per-row retry
        # below, where MLX would hand back the failed arrays as if evaluated.
        mx.eval(*([] if logits is None else [logits]), *self.kv_cache.state())
        if logits is None:
            return [], SamplerOutput([], []), []
        try:
            out = sample(logits, seqs)
        except Exception:
            out, ok, errors = SamplerOutput([], []), [], []
            for i, seq in enumerate(seqs):
                try:
                    row = sample(logits[i : i + 1], [seq])
                except Exception as e:
                    errors.append((seq, e))
                    continue
                ok.append(seq)
                out.token_ids += row.token_ids
                out.logprobs += row.logprobs
            return ok, out, errors
        return seqs, out, []
