"""What the engine hands back per request, and the text-side state behind it
(detokenizer, stop-string hold-back): the output-processor half of the engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from macinfer.engine.sequence import Sequence, TokenLogprob
from macinfer.text.tokenizer import IncrementalDetokenizer

log = logging.getLogger("macinfer")


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
    # per prompt position (the first None), when the request asked for prompt_logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None
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

    def add_token(self, token: int, eos_token_ids, max_model_len: int) -> str | None:
        """Detokenize one new output token (already in seq.output_token_ids) and check
        every stop condition; the finish reason when it ends the request, else None."""
        seq, p = self.seq, self.seq.params
        stop_token = (token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                # The matcher gave up (e.g. llguidance's lexer/parser limits on a runaway
                # number): the output is cut where it stands, like hitting max_tokens.
                log.warning("request %s: grammar cannot continue (%s); ending it as 'length'",
                            seq.request_id, seq.matcher.get_error())
                seq.output_token_ids.pop()
                if seq.logprobs and len(seq.logprobs) > seq.num_output_tokens:
                    seq.logprobs.pop()
                return "length"
            # Complete (only EOS allowed next): end here rather than spend a step on EOS.
            grammar_done = seq.matcher.is_stopped()
        checked = len(self.text)  # text before this token held no stop string
        if stop_token:  # the token that ends a request is never part of its text
            self.stop_reason = token if token in p.stop_token_ids else None  # None: end of sequence
            return "stop"
        self.text += self.detok.add(token)
        if grammar_done:
            return "stop"
        if p.stop and len(self.text) > checked and seq.num_output_tokens >= p.min_tokens:
            search_from = max(0, checked - self.max_stop_len + 1)
            hits = [(i, s) for s in p.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                at, self.stop_reason = min(hits)
                self.text = self.text[:at]
                return "stop"
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_tokens >= max_model_len:
            return "length"
        return None

    def output(self, finished: bool) -> RequestOutput:
        """What changed since the last output: new text (holding back what could still
        become a stop string) and new token ids, plus everything so far."""
        seq = self.seq
        safe = len(self.text) if finished else max(self.emitted_chars, len(self.text) - max(self.max_stop_len - 1, 0))
        delta = self.text[self.emitted_chars : safe]
        self.emitted_chars = safe
        delta_ids = seq.output_token_ids[self.emitted_tokens :]
        self.emitted_tokens = seq.num_output_tokens
        metrics = {}
        if seq.first_token_time is not None:
            metrics["ttft"] = seq.first_token_time - seq.arrival_time
        if finished and seq.finish_time is not None:
            metrics["e2e"] = seq.finish_time - seq.arrival_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=self.text[:safe],
            token_ids=list(seq.output_token_ids),
            delta_text=delta,
            delta_token_ids=delta_ids,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            logprobs=list(seq.logprobs),
            prompt_logprobs=(list(seq.prompt_logprobs or [None] * seq.num_prompt_tokens)
                             if seq.params.prompt_logprobs is not None else None),
            num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics,
            prompt=self.prompt,
            stop_reason=self.stop_reason if finished else None,
        )
