"""Batched sampling on the device.

One call handles every row of a step: penalties, temperature, top-k, top-p,
min-p, then a Gumbel-max draw. The noise comes from a counter-based hash of
(seed, output position, token id), so a seeded request draws the same
numbers whether it runs alone or in any batch, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from macinfer.engine.sequence import Sequence

_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def _mix32(x: mx.array) -> mx.array:
    """lowbias32 integer hash (Chris Wellons): good avalanche, uint32 ops only."""
    x = x ^ (x >> 16)
    x = x * mx.array(_M1, dtype=mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(_M2, dtype=mx.uint32)
    return x ^ (x >> 16)


NOISE_BITS = 23  # (k + 0.5) / 2^23 is exact in float32 for every k < 2^23


def uniform_noise(seeds: mx.array, steps: mx.array, vocab: int) -> mx.array:
    """U(0,1) of shape [N, vocab], a pure function of (seed, step, token id),
    strictly inside (0, 1): the Gumbel transform of an exact 1.0 is +inf, which
    would win over every mask (top-k, top-p, grammar). With 24 bits, (2^24 - 1) + 0.5
    rounds up to 2^24 in float32; 23 bits keep every value exact."""
    return noise_at(seeds, steps, mx.arange(vocab, dtype=mx.uint32)[None, :])


def noise_at(seeds: mx.array, steps: mx.array, ids: mx.array) -> mx.array:
    """`uniform_noise` at the token ids `ids` ([N, k]) only: the same numbers."""
    key = _mix32(_mix32(seeds[:, None]) ^ steps[:, None])
    return bits_to_unit(_mix32(key + ids.astype(mx.uint32) * mx.array(0x9E3779B9, dtype=mx.uint32)))


def bits_to_unit(bits: mx.array) -> mx.array:
    """uint32 -> the midpoint of one of 2^23 equal cells of (0, 1), exact in float32."""
    return ((bits >> (32 - NOISE_BITS)).astype(mx.float32) + 0.5) * (1.0 / (1 << NOISE_BITS))


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (sampled logprob, [(id, logprob), ...]) or None when not requested
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _penalty_arrays(seqs: list[Sequence], vocab: int) -> tuple[mx.array, mx.array]:
    """Output-token counts and prompt+output presence, [N, vocab] each."""
    counts = np.zeros((len(seqs), vocab), dtype=np.float32)
    seen = np.zeros((len(seqs), vocab), dtype=bool)
    for i, s in enumerate(seqs):
        if not s.params.uses_penalties:
            continue
        if s.output_token_ids:
            counts[i] = np.bincount(s.output_token_ids, minlength=vocab)[:vocab]
        seen[i, s.prompt_token_ids] = True
        seen[i] |= counts[i] > 0
    return mx.array(counts), mx.array(seen)


# With every sampled row's top-k at most this, only that many candidates are sorted (an
# argpartition first): exact, and on MLX's CPU a 49k-token vocabulary's full argsort is
# most of a step's sampling (36 of 62 ms at 8 rows).
MAX_CANDIDATES = 1024


def _gumbel(u: mx.array) -> mx.array:
    return -mx.log(-mx.log(u))


def _truncated(scaled: mx.array, params: list, seeds: mx.array, steps: mx.array) -> mx.array:
    """Each row's draw among the tokens its top-k, top-p and min-p keep: a token stays if it
    is within top-k, the mass before it is < top_p, and its probability is >= min_p * the
    best one's (the best always stays). Candidates in rank order: the whole vocabulary
    sorted, or, when every sampled row has a top-k of at most `MAX_CANDIDATES`, the largest
    top-k's best tokens (probabilities still over the whole vocabulary, so top-p and min-p
    see the same numbers)."""
    vocab = scaled.shape[-1]
    sampled = [p for p in params if not p.greedy]
    width = max(p.top_k for p in sampled) if all(0 < p.top_k <= MAX_CANDIDATES for p in sampled) else vocab
    if width < vocab:
        best = mx.argpartition(-scaled, kth=width - 1, axis=-1)[:, :width]
        best_logits = mx.take_along_axis(scaled, best, axis=-1)
        within = mx.argsort(-best_logits, axis=-1)
        order = mx.take_along_axis(best, within, axis=-1)
        sorted_logits = mx.take_along_axis(best_logits, within, axis=-1)
        probs = mx.exp(sorted_logits - mx.logsumexp(scaled, axis=-1, keepdims=True))
    else:
        order = mx.argsort(-scaled, axis=-1)
        sorted_logits = mx.take_along_axis(scaled, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
    rank = mx.arange(order.shape[-1])[None, :]
    top_k = mx.array([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]
    top_p = mx.array([p.top_p for p in params])[:, None]
    min_p = mx.array([p.min_p for p in params])[:, None]
    drop = (rank >= top_k) | ((mx.cumsum(probs, axis=-1) - probs) >= top_p)
    drop = (drop | (probs < min_p * probs[:, :1])) & (rank > 0)
    sorted_logits = mx.where(drop, -mx.inf, sorted_logits)
    choice = mx.argmax(sorted_logits + _gumbel(noise_at(seeds, steps, order)), axis=-1)
    return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def sample(logits: mx.array, seqs: list[Sequence], mask: mx.array | None = None,
           eos_token_ids: tuple[int, ...] = ()) -> SamplerOutput:
    """`draw`, then its tokens (and logprobs) read back."""
    return draw(logits, seqs, mask, eos_token_ids).result()


@dataclass
class Draw:
    """A step's draw as lazy arrays: the tokens can feed the next step's graph
    (`ModelRunner`'s lookahead) before they are read back."""
    tokens: mx.array
    params: list
    chosen: mx.array | None = None  # the drawn tokens' logprobs, when any row wants them
    top_ids: mx.array | None = None
    top_lp: mx.array | None = None

    def result(self) -> SamplerOutput:
        if self.chosen is None:
            return SamplerOutput(self.tokens.tolist(), [None] * len(self.params))
        top = self.top_ids is not None
        mx.eval(self.tokens, self.chosen, *([self.top_ids, self.top_lp] if top else []))
        top_ids_l, top_lp_l = (self.top_ids.tolist(), self.top_lp.tolist()) if top else ([], [])
        chosen_l = self.chosen.tolist()
        out_lp: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, p in enumerate(self.params):
            if p.logprobs is None:
                out_lp.append(None)
                continue
            best: list[tuple[int, float]] = []
            if p.logprobs > 0:
                best = sorted(zip(top_ids_l[i], top_lp_l[i]), key=lambda t: -t[1])[: p.logprobs]
            out_lp.append((chosen_l[i], best))
        return SamplerOutput(self.tokens.tolist(), out_lp)


def draw(logits: mx.array, seqs: list[Sequence], mask: mx.array | None = None,
         eos_token_ids: tuple[int, ...] = ()) -> Draw:
    """logits: [N, vocab] for the N sequences that get a token this step; `mask`
    (bool, [N, vocab]): tokens a grammar allows. Logprobs are the model's own
    distribution, before the mask and penalties (as vLLM reports them), so they
    stay finite for a token a grammar forces. A row short of its `min_tokens` cannot
    draw `eos_token_ids` or its stop token ids."""
    logits = logits.astype(mx.float32)
    n, vocab = logits.shape
    params = [s.params for s in seqs]

    want_logprobs = [p.logprobs is not None for p in params]
    raw_logprobs = None
    if any(want_logprobs):
        raw_logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if mask is not None:
        logits = mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))

    if any(p.uses_penalties for p in params):
        counts, seen = _penalty_arrays(seqs, vocab)
        rep = mx.array([p.repetition_penalty for p in params])[:, None]
        logits = mx.where(seen, mx.where(logits > 0, logits / rep, logits * rep), logits)
        freq = mx.array([p.frequency_penalty for p in params])[:, None]
        pres = mx.array([p.presence_penalty for p in params])[:, None]
        logits = logits - freq * counts - pres * (counts > 0)

    early = [(i, t) for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens
             for t in {*eos_token_ids, *s.params.stop_token_ids} if t < vocab]
    if early:
        rows, cols = zip(*early)
        logits = logits.at[mx.array(rows), mx.array(cols)].add(mx.array(-mx.inf, dtype=mx.float32))

    if any(p.logit_bias for p in params):
        rows, cols, vals = [], [], []
        for i, p in enumerate(params):
            for tok, bias in (p.logit_bias or {}).items():
                rows.append(i)
                cols.append(tok)
                vals.append(bias)
        logits = logits.at[mx.array(rows), mx.array(cols)].add(mx.array(vals, dtype=mx.float32))

    tokens = mx.argmax(logits, axis=-1)
    if not all(p.greedy for p in params):
        temps = mx.array([p.temperature if not p.greedy else 1.0 for p in params])
        scaled = logits / temps[:, None]
        seeds = mx.array([s.seed & 0xFFFFFFFF for s in seqs], dtype=mx.uint32)
        steps = mx.array([s.num_output_tokens for s in seqs], dtype=mx.uint32)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            sampled = _truncated(scaled, params, seeds, steps)
        else:
            sampled = mx.argmax(scaled + _gumbel(noise_at(seeds, steps, mx.arange(vocab)[None, :])), axis=-1)
        is_greedy = mx.array([p.greedy for p in params])
        tokens = mx.where(is_greedy, tokens, sampled)

    if raw_logprobs is None:
        return Draw(tokens, params)
    k = max(p.logprobs or 0 for p in params)
    chosen = mx.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if k == 0:
        return Draw(tokens, params, chosen)
    top_ids = mx.argpartition(-raw_logprobs, kth=k - 1, axis=-1)[:, :k]
    return Draw(tokens, params, chosen, top_ids, mx.take_along_axis(raw_logprobs, top_ids, axis=-1))
