"""A sequence: one prompt and its generated tokens, as the scheduler sees it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from macinfer.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


_counter = itertools.count()


@dataclass(eq=False)  # identity, not field equality: two requests may look alike
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the request's, or a random one
    arrival: int = field(default_factory=lambda: next(_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_tables: list[list[int]] = field(default_factory=list)  # one per cache group (NULL_BLOCK: released)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # by position; [0] is None
    num_preemptions: int = 0
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    lora_slot: int = 0  # its LoRA adapter's slot in the adapted layers (0: the base model)
    images: Any = None  # `vision.inputs.ImageInputs` of a prompt with images (None: text only)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_committed_blocks: int = 0  # leading blocks of block_table already published to the prefix cache
    num_released_blocks: list[int] = field(default_factory=list)  # per group: unread entries below given back
    matcher: Any = None  # llguidance matcher of a request with a grammar (state: the output so far)
    state_slot: int | None = None  # recurrent-state slot while running (hybrid models)
    state_mark: int = 0  # position of the state kept in its mark slot (`engine/state_group.py`)
    thinking: str = "before"  # thinking budget: "before" the think block, "open", or "closed"
    thinking_tokens: int = 0  # output tokens inside the open think block
    forced_token_ids: list[int] = field(default_factory=list)  # the next tokens, whatever is sampled
    spec_token_ids: list[int] = field(default_factory=list)  # this step's draft tokens (speculative decoding)
    spec_misses: int = 0  # drafts rejected outright in a row
    spec_skip: int = 0  # decode steps left before this sequence drafts again
    spec_k: int = 0  # its draft length now, adapted to its acceptance (0: the configured k)
    # timing (time.perf_counter seconds)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def block_table(self) -> list[int]:
        """The first cache group's table (the full-attention one when the model has one)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (hot path)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
