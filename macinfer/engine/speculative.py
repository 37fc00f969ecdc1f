"""Speculative decoding by prompt lookup (n-gram drafts), verified in one forward pass.

Decode reads every weight once per token, whether one row or a few go through the
matmuls, so checking k guessed tokens costs about as much as producing one. The
guesses come from the sequence itself: the last n tokens (n from `max_n` down to
`min_n`) are looked up earlier in prompt + output, and the k tokens that followed
their latest occurrence are the draft (vLLM's "ngram" method, llama.cpp's lookup
decoding). It pays where the answer repeats its input: code edits, quoting,
summaries, structured data.

Verification keeps the output distribution exact. Row j of the sequence's forward
pass is sampled as if the draft's first j tokens were already output (same
penalties, same noise: the sampler's noise is a function of (seed, output
position)), and drafts are accepted while they equal what was sampled. For a
deterministic draft this is the standard rejection rule: a draft token d is
kept with probability p(d), and on rejection the sampled token is distributed
as p without d. Greedy and seeded requests therefore produce the same tokens
with or without speculation. A request with a grammar drafts too: drafts are cut
where the grammar would refuse them, and each draft row is masked for the grammar
state after the drafts before it (llguidance computes those masks without moving
the matcher).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams


MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int  # draft tokens per sequence per step (k)
    min_n: int = 2  # shortest suffix looked up
    max_n: int = 4  # longest suffix looked up (tried first)
    # Sequences decoding at once above which no step speculates: at large batches the
    # extra rows make a step compute-bound, and a rejected draft is pure cost.
    max_batch: int = 4
    # With a batched drafter: prompt lookup first, the drafter for the sequences it misses.
    lookup_first: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens {self.num_tokens}: take 1 to {MAX_SPECULATIVE_TOKENS} (a "
                             "verify step of more rows costs more than its drafts are likely to save)")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("prompt lookup needs 1 <= min n-gram <= max n-gram")
        if self.max_batch < 1:
            raise ValueError("speculative max batch must be at least 1")


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` (max_n down to min_n tokens long); [] when none recurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows starting at 0 .. length-n-1: each has at least one token after it.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def propose(seq: Sequence, k: int, min_n: int, max_n: int) -> list[int]:
    """The draft for a decoding sequence: prompt lookup, cut where a grammar would
    refuse it (its tokens could never be accepted)."""
    return cut_for_grammar(seq, propose_ngram(np.asarray(seq.token_ids), k, min_n, max_n))


def cut_for_grammar(seq: Sequence, drafts: list[int]) -> list[int]:
    """`drafts` up to the first token `seq`'s grammar would refuse (it could never be accepted)."""
    if drafts and seq.matcher is not None:
        drafts = drafts[: seq.matcher.validate_tokens(drafts)]
    return drafts


def draft_limit(seq: Sequence, k: int, max_model_len: int) -> int:
    """Draft tokens `seq` may take this step: at most k and its adapted length
    (`record_verdict`); all accepted plus the bonus token must stay within max_tokens
    and the context."""
    limit = min(k, seq.spec_k or k, max_model_len - seq.num_tokens - 1)
    if seq.params.max_tokens is not None:
        limit = min(limit, seq.params.max_tokens - seq.num_output_tokens - 1)
    return max(limit, 0)


@dataclass(eq=False)
class DraftRow:
    """What the sampler reads of a sequence, for the row after `j` draft tokens:
    the output as if those drafts were accepted (penalties, noise position)."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    matcher: None = None  # a grammar's masks for draft rows come with the sequence's own row

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def verify_rows(seq: Sequence) -> list[Sequence | DraftRow]:
    """The sampler rows of a speculating sequence: itself, then one per draft token."""
    drafts = seq.spec_token_ids
    rows: list[Sequence | DraftRow] = [seq]
    for j in range(1, len(drafts) + 1):
        rows.append(DraftRow(seq.params, seq.seed, seq.prompt_token_ids, seq.output_token_ids + drafts[:j]))
    return rows


MAX_SKIP = 16


def record_verdict(seq: Sequence, accepted: int, drafted: int) -> None:
    """Adapt a sequence's drafting to how its drafts fare. Its draft length follows its
    acceptance: one more than it accepted last time (so a fully accepted draft grows by
    one, up to k; a draft cut short at j drafts j + 1 next). A draft rejected outright
    doubles the decode steps it waits before drafting again (up to MAX_SKIP); any accepted
    token resets that. A verify step with 4 drafts costs ~40% more than a plain decode
    step on the CPU at 256 tokens of context (~2x at 4k), and a draft model's forwards
    grow with the draft's length, so text that never repeats should rarely pay them."""
    seq.spec_k = accepted + 1 if accepted < drafted else drafted + 1
    if accepted:
        seq.spec_misses = 0
    else:
        seq.spec_misses += 1
        seq.spec_skip = min(1 << seq.spec_misses, MAX_SKIP)


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a sequence gains: sampled tokens while they confirm the draft, then
    the first one that differs (or the bonus token after a fully accepted draft)."""
    for j, d in enumerate(drafts):
        if sampled[j] != d:
            return sampled[: j + 1]
    return sampled[: len(drafts) + 1]
