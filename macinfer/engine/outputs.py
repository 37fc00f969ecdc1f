"""What the engine hands back per request, and the text-side state behind it
(detokenizer, stop-string hold-back): the output-processor half of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from macinfer.engine.sequence import Sequence, TokenLogprob
from macinfer.tokenizer import IncrementalDetokenizer


@dataclass(repr=False)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str  # all text so far (stop strings removed)
    token_ids: list[int]
    delta_text: str  # new since the previous output of this request
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when finish_reason == "error" (the exception, for logs and the Python API)
    client_error: str | None = None  # a message safe to show a remote client, when there is one
    prompt: str | None = None  # the prompt text, when the request was given as text
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS)

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        state = f"finish_reason={self.finish_reason!r}" if self.finished else "running"
        err = f", error={self.error!r}" if self.error else ""
        return (f"RequestOutput({self.request_id!r}, {state}, prompt_tokens={len(self.prompt_token_ids)}, "
                f"tokens={len(self.token_ids)}, text={text!r}{err})")


class _RequestState:
    """Text-side state of one request: detokenizer and stop-string hold-back."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, prompt: str | None):
        self.seq = seq
        self.detok = detok
        self.prompt = prompt
        self.text = ""
        self.emitted_chars = 0
        self.emitted_tokens = 0
        self.stop_reason: str | int | None = None
        self.max_stop_len = max((len(s) for s in seq.params.stop), default=0)
