"""A step's sampled tokens into request outputs (vLLM v1's output processor): tokens
appended, speculation verdicts counted, stops and limits checked, text detokenized; a
request whose own work fails ends with finish_reason "error", the others go on."""

from __future__ import annotations

import logging
import time
from typing import Any

from macinfer.engine.outputs import RequestOutput, _RequestState
from macinfer.engine.sequence import Sequence, TokenLogprob
from macinfer.engine.speculative import record_verdict
from macinfer.text.reasoning import track_thinking
from macinfer.text.tokenizer import IncrementalDetokenizer

log = logging.getLogger("macinfer")


class OutputProcessor:
    """The engine's running requests (`requests`, by id) as outputs, step by step;
    `stats`: the engine's token and speculation counters, kept here."""

    def __init__(self, requests: dict[str, _RequestState], scheduler: Any, tokenizer: Any, stats: dict,
                 max_model_len: int):
        self.requests, self.scheduler, self.tokenizer = requests, scheduler, tokenizer
        self.stats, self.max_model_len = stats, max_model_len

    def process(self, sched: Any, results: list, errors: list) -> list[RequestOutput]:
        """The step's sampled tokens appended, stops checked, outputs built."""
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n - len(seq.spec_token_ids)  # drafts count once accepted
        now = time.perf_counter()
        outputs = [self.fail(seq, err) for seq, err in errors]
        for r in results:
            seq = r.seq
            try:
                if seq.spec_token_ids:
                    self._count_verdict(len(seq.spec_token_ids), len(r.token_ids) - 1)
                    seq.num_computed_tokens += len(r.token_ids) - 1  # the accepted drafts' K/V are written
                    record_verdict(seq, len(r.token_ids) - 1, len(seq.spec_token_ids))
                    if r.recompute_from is not None:  # recurrent state rewound (`ModelRunner.step`)
                        seq.num_computed_tokens = r.recompute_from
                if seq.first_token_time is None:
                    seq.first_token_time = now
                finished = False
                for token, lp in zip(r.token_ids, r.logprobs):
                    seq.output_token_ids.append(token)
                    if seq.params.thinking_budget is not None and seq.thinking != "closed":
                        track_thinking(seq, self.tokenizer)
                    self.stats["generation_tokens"] += 1
                    if lp is not None:
                        seq.logprobs.append(TokenLogprob(token, lp[0], lp[1]))
                    if finished := self._add_token(seq, token):
                        break
                outputs.append((self.requests.pop(seq.request_id) if finished
                                else self.requests[seq.request_id]).output(finished))
            except Exception as e:
                log.exception("request %s failed", seq.request_id)
                outputs.append(self.fail(seq, e))
        for seq, _ in sched.scheduled:
            seq.spec_token_ids = []
        return outputs

    def fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End `seq`'s request with finish_reason "error" and the exception's text."""
        state = self.requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        seq.finish_time = time.perf_counter()
        if state is None:
            state = _RequestState(seq, IncrementalDetokenizer(self.tokenizer), None)
        out = state.output(finished=True)
        out.error = f"{type(error).__name__}: {error}"
        return out

    def _count_verdict(self, drafted: int, accepted: int) -> None:
        st = self.stats
        st["spec_draft_tokens"] += drafted
        st["spec_accepted_tokens"] += accepted
        st["spec_verify_steps"] += 1
        for j in range(drafted):
            st["spec_drafted_by_position"][j] += 1
            st["spec_accepted_by_position"][j] += j < accepted

    def _add_token(self, seq: Sequence, token: int) -> bool:
        """One new output token through the request's output state; True (and the
        sequence finished) when it ends the request."""
        reason = self.requests[seq.request_id].add_token(token, self.tokenizer.eos_token_ids, self.max_model_len)
        if reason is None:
            return False
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq, reason)
        return True
