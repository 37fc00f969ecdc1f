"""A scheduled step's inputs: flat token ids and positions, each cache group's slots and
block tables, the recurrent-state plan, and which rows sample. Host tables only: the
forward (`execution`) turns them into a graph."""

from __future__ import annotations

from dataclasses import dataclass
import mlx.core as mx
import numpy as np

from macinfer.engine.kv_groups import NULL_BLOCK, GroupBlocks
from macinfer.engine.sequence import Sequence
from macinfer.engine.speculative import DraftRow, verify_rows
from macinfer.engine.state_group import StateGroup, StateStep
from macinfer.kernels.paged_attention import PARTITION_SIZE
from macinfer.kv.attention import AttentionMetadata
from macinfer.kv.cache import KVCache
from macinfer.kv.prefill_plan import PrefillSpan
from macinfer.kv.spec import FullAttention, cdiv
from macinfer.kv.state import SeqChunk, plan_state


class GroupTables:
    """Slots and block tables of one cache group for a step, as they are gathered."""

    def __init__(self, group: GroupBlocks | None, block_size: int):
        self.group, self.bs = group, block_size
        self.kind = None if group is None else group.kind
        self.slots: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.decode_floors: list[int] = []
        self.decode_keep: list[int] = []
        self.decode_groups: list[tuple[int, int]] = []
        self.prefills: list[PrefillSpan] = []

    def add(self, table: list[int], pos: np.ndarray, row: int, as_decodes: bool = False,
            ceilings: np.ndarray | None = None, prompt_len: int | None = None) -> None:
        """One scheduled sequence: new tokens at `pos`, rows from `row`. A bounded group's
        tables start at the first block the step's first query reads. A single token, or
        a speculating sequence (`as_decodes`: its real token and drafts), is attended as
        decode rows, one per token, each with its own context length: the in-place
        decode path, with no gathered copy of the context. `prompt_len`: the sequence's
        (a kind that reads the prompt whole and a window after it masks the keys between)."""
        bs = self.bs
        bounded = self.kind is not None and self.kind.bounded
        first_block = self.group.first_block(int(pos[0])) if bounded else 0
        origin = first_block * bs
        t = np.asarray(table, dtype=np.int64)
        kind = self.kind or FullAttention()
        holed = getattr(kind, "keeps_prompt", False) and prompt_len is not None
        if len(t) * bs > int(pos[-1]):
            self.slots.extend((t[pos // bs] * bs + pos % bs).tolist())
        else:  # positions its table does not cover (`FirstTokens`): written to the null block, never read
            held = pos < len(t) * bs
            self.slots.extend(np.where(held, t[np.minimum(pos // bs, max(len(t) - 1, 0))] * bs if len(t) else 0,
                                       NULL_BLOCK * bs) + pos % bs)
        if len(pos) == 1 or as_decodes:
            if as_decodes:
                self.decode_groups.append((len(self.decode_tables), len(pos)))
            for p in pos.tolist():
                self.decode_tables.append(table[first_block : cdiv(p + 1, bs)])
                self.decode_lens.append(kind.stored_keys(p + 1) - origin)  # counted from the table's first block
                if bounded:
                    self.decode_floors.append(int(self.kind.key_floor(p)) - origin)
                elif holed:
                    self.decode_floors.append(int(self.kind.window_floor(p)))
                    self.decode_keep.append(prompt_len)
            return
        context = kind.stored_keys(int(pos[-1]) + 1)
        blocks = table[first_block : cdiv(context, bs)]
        holed = holed and int(self.kind.window_floor(int(pos[-1]))) > prompt_len
        self.prefills.append(PrefillSpan(row, len(pos), context - origin, mx.array(blocks, dtype=mx.int32), origin,
                                         ceilings, prompt_len if holed else None))

    def metadata(self, kv_cache: KVCache, positions: mx.array, cfg: "InputConfig") -> AttentionMetadata:
        meta = AttentionMetadata(
            kv_cache=kv_cache,
            positions=positions,
            slots=np.asarray(self.slots, dtype=np.int64),
            kind=self.kind,
            explicit_ops=cfg.explicit_ops,
            prefill_tile=cfg.prefill_tile,
            mla_expand_from=cfg.mla_expand_from,
            decode_partition=cfg.decode_partition,
            decode_attention=cfg.decode_attention,
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
                if self.decode_keep and max(f - k for f, k in zip(self.decode_floors, self.decode_keep)) > 0:
                    meta.decode_keep = mx.array(self.decode_keep, dtype=mx.int32)
                elif self.decode_keep:  # every row's window still reaches its prompt: causal
                    meta.decode_floors = None
        return meta


@dataclass(frozen=True)
class InputConfig:
    """What every step's metadata carries from load (the engine backend's `Paths`)."""
    block_size: int
    explicit_ops: bool = False
    prefill_tile: int | None = None
    mla_expand_from: int | None = None
    decode_partition: int = PARTITION_SIZE
    decode_attention: str = "reference"


def build_inputs(
    scheduled: list[tuple[Sequence, int]], groups: list[GroupBlocks | None], kv_cache: KVCache, cfg: InputConfig,
    state: StateGroup | None = None, step: StateStep | None = None, ahead: tuple[mx.array, list[int]] | None = None,
) -> tuple[mx.array, AttentionMetadata, list[int], list[Sequence | DraftRow]]:
    """Flat inputs for `scheduled` (decodes and speculating sequences first, then prompt
    chunks: the scheduler's order). Returns (input_ids, metadata, rows to sample, what
    each row samples for: a sequence, or one of its drafts).
    `step`: the engine step's state transaction; with it, recurrent states are kept at
    block boundaries for the prefix cache and a speculating sequence's state is kept
    before its verify (without it, nothing is: scoring, embeddings, the step built ahead).
    `ahead`: (input ids, positions) of one decode token per sequence, the next step's,
    built while this one computes (`engine/lookahead.py`)."""
    ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence | DraftRow] = []
    tables = [GroupTables(g, cfg.block_size) for g in groups]
    chunks: list[SeqChunk] = []
    image_rows: list[int] = []
    image_parts: list[mx.array] = []
    rope: list[tuple[int, np.ndarray]] = []  # (first row, [axes, n]) of sequences with multimodal RoPE
    lora: list[int] = []  # each row's adapter slot

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
        lora.extend([seq.lora_slot] * n)
        if seq.images is not None:
            if ahead is None:
                _image_rows(seq, start, start + real, row, image_rows, image_parts)
            if seq.images.rope is not None:
                rope.append((row, seq.images.rope_rows(pos)))
        ceilings = seq.images.key_ceilings(pos) if seq.images is not None and ahead is None and n > 1 else None
        for g, t in enumerate(tables):
            t.add(seq.block_tables[g], pos, row, as_decodes=bool(drafts), ceilings=ceilings,
                  prompt_len=seq.num_prompt_tokens)
        if state is not None:
            if drafts:  # its state before the drafts, restored if one is rejected
                if step is None:
                    raise RuntimeError("a speculating sequence's inputs need the step's state transaction")
                step.keep(seq)
            cuts = state.cuts(seq, start, real, step) if step is not None else []
            chunks.append(SeqChunk(row, n, seq.state_slot, start == 0, cuts))
        if ahead is not None or start + real == seq.num_tokens:
            # A speculating sequence samples at its real token and after each draft.
            sample_rows.extend(range(row + real - 1, row + n))
            sample_seqs.extend(verify_rows(seq) if drafts else [seq])

    pos_arr = mx.array(positions, dtype=mx.int32)
    metas = [t.metadata(kv_cache, pos_arr, cfg) for t in tables]
    meta = metas[0] if metas else AttentionMetadata(kv_cache, pos_arr, np.zeros(0, dtype=np.int64))
    meta.groups = metas
    if state is not None:
        meta.state = plan_state(chunks)
    if rope:
        axes = rope[0][1].shape[0]  # (3; HunyuanOCR's 4)
        table = np.broadcast_to(np.asarray(positions, dtype=np.int64), (axes, len(positions))).copy()
        for first, rows in rope:
            table[:, first: first + rows.shape[1]] = rows
        if (table == table[0]).all():  # text rows only (a decode after an image): plain RoPE, shifted
            meta.rope_offsets = mx.array(table[0], dtype=mx.int32)
        else:
            meta.rope_positions = mx.array(table, dtype=mx.int32)
    if any(lora):
        meta.lora_slots = mx.array(lora, dtype=mx.uint32)
    if image_rows:
        meta.image_rows = mx.array(image_rows, dtype=mx.int32)
        feats = image_parts[0] if len(image_parts) == 1 else mx.concatenate(image_parts, axis=-2)
        if feats.ndim == 3:  # DeepStack: the input rows, then what each early layer adds
            meta.image_features, meta.image_deepstack = feats[0], feats[1:]
        else:
            meta.image_features = feats
    input_ids = ahead[0] if ahead is not None else mx.array(ids, dtype=mx.int32)
    return input_ids, meta, sample_rows, sample_seqs


def _image_rows(seq: Sequence, start: int, end: int, row: int, rows: list[int], parts: list[mx.array]) -> None:
    """The step's rows (from `row`, at positions [start, end)) that take `seq`'s image
    features, and those features, in the same order."""
    for span in seq.images.overlapping(start, end):
        if span.features is None:
            raise RuntimeError("an image in the step was not encoded before it")
        picked = [i for i, r in enumerate(span.rows) if start <= span.offset + r < end]
        if not picked:
            continue
        rows.extend(row + span.offset + span.rows[i] - start for i in picked)
        whole = len(picked) == len(span.rows)
        feats = span.features  # [rows, hidden], or [1 + early layers, rows, hidden] (DeepStack)
        if not whole:
            feats = feats[..., mx.array(picked, dtype=mx.int32), :]
        parts.append(feats)


def prompt_logprob_spans(scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, int, int]]:
    """(sequence, first row, first position, rows) of prompt positions whose next
    prompt token's logprob is wanted in this step (rows follow the scheduled order)."""
    spans, row = [], 0
    for seq, n in scheduled:
        start = seq.num_computed_tokens
        if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            spans.append((seq, row, start, min(start + n, seq.num_prompt_tokens - 1) - start))
        row += n
    return spans
