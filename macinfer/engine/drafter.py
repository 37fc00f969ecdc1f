"""Speculative decoding with a draft model: a small model of the same tokenizer proposes
each speculating sequence's next k tokens, for all of them in one batch.

The draft runs on its own paged KV pool (its own cache groups, as many blocks as the
target's full-attention pool, so every sequence the target holds fits; one budget buys
both, `cache_plan.Companion`) through the
engine's own `ModelRunner`. Each target sequence has a shadow sequence on the draft's
side holding the same tokens; a step proposes in k batched forwards: the first takes
every shadow's uncomputed tokens (the tokens accepted since its last proposal, or a
chunk of its prompt), the next k-1 one token each. A rejected draft needs no rollback:
the shadow's computed length falls back to what it shares with the target's tokens,
and the next forward writes over the rejected K/V.

The draft samples as the request does (its temperature, top-k/p, min-p, penalties over
the tokens known) with the noise the target will draw that output position with: the
sampler's noise is a function of (seed, output position, token id), so where the two
models' distributions are close their Gumbel-max draws coincide, and a sampled request
has its drafts accepted about as often as a greedy one (a draft's argmax would be
accepted only with the target's probability of it). The verifier (`engine/speculative.py`)
outputs the target's own draw at every position and keeps a draft only while it equals
it, so whatever the draft proposes, the output is exactly what decoding without
speculation gives, greedy or seeded.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from macinfer.engine.block_manager import BlockManager
from macinfer.engine.cache_plan import Companion, kv_pool_bytes, plan_caches
from macinfer.engine.runner import ModelRunner
from macinfer.engine.sampler import draw
from macinfer.engine.sequence import Sequence, SequenceStatus
from macinfer.engine.speculative import MAX_SPECULATIVE_TOKENS
from macinfer.sampling_params import SamplingParams

log = logging.getLogger("macinfer")


def weight_bytes(model: Any) -> int:
    """The bytes of a model's parameters (what a drafter adds to the memory budget)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def check_pair(target: Any, draft: Any) -> None:
    """A ValueError with the reason when `draft` (LoadedModel) cannot draft for `target`."""
    model = draft.model
    if hasattr(model, "state_specs") and list(model.state_specs()):
        raise ValueError(f"draft model {draft.name}: it has recurrent layers, whose state a rejected draft "
                         "would have to roll back; use an attention-only draft model")
    # Every draft token must be the same token in the target (the target may have more:
    # added specials the draft never proposes).
    t_vocab = target.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    d_vocab = draft.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    differ = sorted((i, tok) for tok, i in d_vocab.items() if t_vocab.get(tok) != i)
    if differ:
        raise ValueError(f"draft model {draft.name}: its tokenizer differs from the target's ({len(differ)} of its "
                         f"{len(d_vocab)} tokens, e.g. id {differ[0][0]} {differ[0][1]!r}); a draft must share the "
                         "target's vocabulary")
    if draft.model.args.vocab_size > target.model.args.vocab_size:
        raise ValueError(f"draft model {draft.name}: its output layer has {draft.model.args.vocab_size} rows, more "
                         f"than the target's {target.model.args.vocab_size}")
    d_bytes, t_bytes = weight_bytes(draft.model), weight_bytes(target.model)
    if d_bytes > t_bytes:
        raise ValueError(f"draft model {draft.name} ({d_bytes / 2**20:.1f} MiB of weights) is bigger than the "
                         f"target ({t_bytes / 2**20:.1f} MiB): it would cost more than it saves")
    if d_bytes * 2 > t_bytes:
        log.warning("draft model %s is %.0f%% of the target's size: drafting costs about what it saves",
                    draft.name, 100 * d_bytes / t_bytes)


@dataclass(eq=False)
class _DrawRow:
    """What the sampler reads for a draft: the request's parameters and seed, the tokens
    known (penalties), and the output position drawn (`ahead` drafts past the known ones)."""
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    ahead: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.ahead


class DraftModel:
    """The scheduler's batched proposer (`Scheduler.drafter`): up to k tokens of the draft
    model per speculating sequence, drawn as the request samples (module docstring)."""

    every_step = False  # proposes only in steps that speculate

    def prefix_limit(self, seq: Sequence) -> int | None:
        """The longest prefix-cache hit the target may take for `seq` (None: any): a draft
        model's shadow recomputes whatever its target skipped."""
        return None

    def __init__(self, model: Any, cache_key: str, target_cfg: Any, max_model_len: int, backend: Any,
                 prefix_caching: bool = False):
        self.model = model
        # The draft's pools (built by `allocate` once the target's plan has its blocks): a
        # block per target block plus one per running sequence (its tokens per sequence
        # are the target's plus k); a prefix cache only where a shadow cannot recompute
        # what a prefix hit of its target skips (an MTP head's, `engine/mtp_drafter.py`).
        self.cache_key, self.backend, self.max_model_len = cache_key, backend, max_model_len
        self.pool_cfg = dataclasses.replace(
            target_cfg, enable_prefix_caching=prefix_caching, kv_cache_gb=None, kv_cache_dtype="auto",
            kv_group_size=None, kv_quant_start=0, num_speculative_tokens=0, memory_limit_bytes=None)
        self.kv_cache: Any = None
        self.chunk = target_cfg.max_num_batched_tokens  # catch-up tokens per step, all shadows together
        self.vocab = model.args.vocab_size
        self.max_len = min(max_model_len, model.args.max_position_embeddings)
        self.shadows: dict[Sequence, Sequence] = {}
        self.forwards = 0  # the draft's forward passes (bench, tests)

    def companion(self) -> Companion:
        """What this drafter brings to its target's plan: its weights and its pool's bytes
        for the target's block count (one budget buys both)."""
        kv = kv_pool_bytes(self.model, self.pool_cfg, self.model.kv_dtype(), self.pool_cfg.max_num_seqs)
        return Companion(weight_bytes(self.model), kv)

    def allocate(self, target_blocks: int) -> None:
        """Build the draft's pools for a target of `target_blocks` blocks."""
        cfg = dataclasses.replace(self.pool_cfg, num_kv_blocks=target_blocks + self.pool_cfg.max_num_seqs)
        plan = plan_caches(self.model, cfg, self.model.kv_dtype(), self.max_model_len, self.backend)
        self.kv_cache = plan.kv_cache
        self.block_manager = BlockManager(plan.groups, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                                          cache_key=self.cache_key)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager)

    @property
    def nbytes(self) -> int:
        return weight_bytes(self.model) + (self.kv_cache.nbytes if self.kv_cache is not None else 0)

    def _shadow(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow, its tokens made `seq`'s; its computed length cut to the tokens
        the two still share (drafts the target rejected are recomputed)."""
        sh = self.shadows.get(seq)
        if sh is None:
            sh = Sequence(seq.request_id, seq.prompt_token_ids, SamplingParams(), 0)
            sh.status = SequenceStatus.RUNNING
            self.block_manager.free(sh)  # empty tables, one per group
            self.shadows[seq] = sh
        old, new = sh.output_token_ids, seq.output_token_ids
        # Only the drafts appended last step can differ: the outputs before them were the
        # target's then, and a sequence's outputs only grow (a preempted one is forgotten).
        start = max(0, len(old) - MAX_SPECULATIVE_TOKENS)
        same = len(seq.prompt_token_ids) + start
        for a, b in zip(old[start:], new[start:]):
            if a != b:
                break
            same += 1
        sh.num_computed_tokens = min(sh.num_computed_tokens, same)
        sh.output_token_ids = list(new)
        return sh

    def forget(self, seq: Sequence) -> None:
        """Free `seq`'s shadow (it finished, was aborted or preempted)."""
        sh = self.shadows.pop(seq, None)
        if sh is not None:
            self.block_manager.free(sh)

    def reset(self) -> None:
        """Drop every shadow and the pool's contents (after a failed forward, its or the
        target's): the sequences running now decode without drafts, new ones draft again."""
        for seq in list(self.shadows):
            self.forget(seq)
        self.block_manager.drop_cache()
        self.kv_cache.reset()

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Up to k draft tokens for each (sequence, k); a sequence whose shadow is still
        catching up on its prompt (more than this step's chunk) or has no room gets none."""
        budget = self.chunk
        active: list[tuple[Sequence, Sequence, int]] = []
        catch_up: list[tuple[Sequence, int]] = []
        shadows = [(seq, self._shadow(seq), k) for seq, k in wants if seq.num_tokens + k <= self.max_len]
        # Shadows with the least to catch up first: a long prompt's takes what the rest leave.
        for seq, sh, k in sorted(shadows, key=lambda t: t[1].num_tokens - t[1].num_computed_tokens):
            todo = sh.num_tokens - sh.num_computed_tokens
            n = min(todo, budget)
            if n <= 0:
                continue
            # Room for the drafts fed back in (k - 1 more tokens).
            room = sh.num_computed_tokens + n + (k - 1 if n == todo else 0)
            if not self.block_manager.can_allocate(sh, room):
                continue
            self.block_manager.allocate(sh, room)
            budget -= n
            catch_up.append((sh, n))
            if n == todo:
                active.append((seq, sh, k))
        if not catch_up:
            return {}
        catch_up.sort(key=lambda item: item[1] != 1)  # the runner takes decode rows first
        # Round 0 computes every shadow's uncomputed tokens; round j feeds each shadow's
        # draft j - 1 and draws draft j. The rounds are one lazy graph (a round's input ids
        # are the previous round's argmax, never read back in between): one sync a step.
        target = {sh: seq for seq, sh, _ in active}
        ready = [sh for sh, n in catch_up if sh.num_computed_tokens + n == sh.num_tokens]
        rounds = [(self._forward(catch_up, [self._row(target[sh], 0) for sh in ready]),
                   {sh: i for i, sh in enumerate(ready)})]
        for sh, n in catch_up:
            sh.num_computed_tokens += n
        for j in range(1, max((k for *_, k in active), default=0)):
            fed = [sh for _, sh, k in active if k > j]
            if not fed:
                break
            prev, where = rounds[-1]
            ids = prev[mx.array([where[sh] for sh in fed])]
            rows = [self._row(target[sh], j) for sh in fed]
            rounds.append((self._forward([(sh, 1) for sh in fed], rows, (ids, [sh.num_computed_tokens for sh in fed])),
                           {sh: i for i, sh in enumerate(fed)}))
            for sh in fed:
                sh.num_computed_tokens += 1
        mx.eval(*(tokens for tokens, _ in rounds), *self.kv_cache.state())
        values = [(tokens.tolist(), where) for tokens, where in rounds]
        drafts: dict[Sequence, list[int]] = {}
        for seq, sh, k in active:
            drafts[seq] = [tokens[where[sh]] for tokens, where in values[:k]]
            sh.output_token_ids.extend(drafts[seq])
        return drafts

    def _row(self, seq: Sequence, j: int) -> _DrawRow:
        """The sampler's view of `seq`'s draft j (0: the first)."""
        params = seq.params
        if params.logit_bias and max(params.logit_bias) >= self.vocab:  # rows past the draft's head
            params = dataclasses.replace(params, logit_bias={t: b for t, b in params.logit_bias.items()
                                                             if t < self.vocab})
        return _DrawRow(params, seq.seed, seq.prompt_token_ids, seq.output_token_ids, j)

    def _forward(self, scheduled: list[tuple[Sequence, int]], rows: list[_DrawRow],
                 ahead: tuple[mx.array, list[int]] | None = None) -> mx.array:
        """One batched forward of the draft (lazy), and each of `rows` drawn from the rows
        that produce a token. `ahead`: (input ids, positions) of one token a shadow, still
        unevaluated."""
        return self._forward_rows(scheduled, rows, ahead)[0]

    def _forward_rows(self, scheduled: list[tuple[Sequence, int]], rows: list[_DrawRow],
                      ahead: tuple[mx.array, list[int]] | None = None) -> tuple[mx.array, mx.array | None]:
        """`_forward`'s draws, and the hidden rows they were drawn from."""
        input_ids, meta, sample_rows, _ = self.runner.prepare(scheduled, ahead=ahead)
        self.forwards += 1
        hidden = self.runner.model(input_ids, meta)
        if not sample_rows:
            return mx.zeros((0,), dtype=mx.int32), None
        out = hidden[mx.array(sample_rows)]
        logits = self.runner.model.logits(out)[:, : self.vocab]
        return draw(logits, rows).tokens.astype(mx.int32), out


TRAINED_DRAFTERS = ("eagle", "dflash", "medusa", "speculator")  # architecture names of trained drafter heads


def refuse_trained_drafter(path: str) -> None:
    """A ValueError naming the format when `path` is a trained drafter checkpoint macinfer
    does not run (EAGLE 1/2, DFlash, Medusa, other vLLM speculators) rather than a language
    model. (EAGLE-3 heads run: `models/eagle3.py`.)"""
    import json
    import os

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return
    with open(config_path) as f:
        config = json.load(f)
    names = " ".join(config.get("architectures") or []) + " " + str(config.get("model_type", ""))
    found = next((t for t in TRAINED_DRAFTERS if t in names.lower()), None)
    if found is None and ("speculators_config" in config or "draft_vocab_size" in config):
        found = "speculator"
    if found is not None:
        raise ValueError(f"draft model {path}: a trained {found} drafter ({names.strip()}); of the trained heads "
                         "macinfer runs EAGLE-3, Gemma 4's assistant and DFlash checkpoints with a dflash_config "
                         "(Medusa and EAGLE 1/2 have other layouts)")


def load_drafter(engine: Any, progress: Any = None, context: Any = None) -> DraftModel:
    """`engine`'s draft model (`EngineConfig.draft_model`), checked against its target; a
    ValueError with the reason when it cannot draft for it."""
    from macinfer.loading.loader import load, resolve

    cfg = engine.config
    refuse_trained_drafter(resolve(cfg.draft_model))
    draft = load(cfg.draft_model, cfg.model_impl, progress, context)
    check_pair(engine.loaded, draft)
    drafter = DraftModel(draft.model, draft.source, cfg, engine.max_model_len, engine.backend)
    log.info("draft model %s: %.1f MiB of weights, %d tokens a step", draft.name, drafter.nbytes / 2**20,
             cfg.num_speculative_tokens)
    return drafter

