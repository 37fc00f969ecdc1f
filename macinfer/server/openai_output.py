"""The OpenAI answer side: a finished request as a chat.completion / text_completion body,
or its stream of SSE chunks, with logprobs in both shapes (chat's entries, the legacy
completions' lists and text offsets) and echo. A mixin of `OpenAIServing`, which holds the
tokenizer, metrics and model name it reads."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from macinfer.engine.outputs import RequestOutput
from macinfer.engine.sequence import TokenLogprob
from macinfer.server import chat_output
from macinfer.server.chat_output import ChatTurn
from macinfer.server.errors import APIError, generation_error
from macinfer.server.heartbeat import BEAT, with_heartbeat
from macinfer.server.protocol import now, usage
from macinfer.text.tokenizer import IncrementalDetokenizer, TokenizerWrapper, token_text


class TextOffsets:
    """Where each token starts in a completion's text (`text_offset`), from the same
    incremental decode the engine uses, so multi-byte characters split over tokens and
    SentencePiece spaces count as they appear in the text."""

    def __init__(self, tokenizer: TokenizerWrapper, context: list[int], start: int,
                 skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, context)
        self.start = start

    def take(self, token_ids: list[int]) -> list[int]:
        out = []
        for t in token_ids:
            out.append(self.start + len(self.detok.text))
            self.detok.add(t)
        return out


class OpenAIOutput:
    """Answers of `OpenAIServing` (its `tokenizer`, `metrics`, `model_name`)."""

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        """A token's logprob `token` string and exact `bytes` (joined, they rebuild the text)."""
        data = self.tokenizer.token_bytes(token_id)
        return token_text(data), list(data)

    def _logprob_entry(self, lp) -> dict[str, Any]:
        text, data = self._token(lp.token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": data,
                "top_logprobs": [{"token": (t := self._token(i))[0], "logprob": v, "bytes": t[1]} for i, v in lp.top]}

    def _completion_logprobs(self, lps, offsets: list[int]) -> dict[str, Any]:
        """The legacy completions shape. `lps` may hold None (the first prompt token of
        an echo, which has no logprob)."""
        return {"tokens": [self._token(lp.token_id)[0] for lp in lps],
                "token_logprobs": [lp.logprob if lp.top is not None else None for lp in lps],
                "top_logprobs": [None if lp.top is None else {self._token(i)[0]: v for i, v in lp.top} for lp in lps],
                "text_offset": offsets}

    async def wait_final(self, gen, request) -> dict[int, RequestOutput]:
        """Every choice's final output; aborts (499) if the client goes away, raises the
        request's generation error."""
        final: dict[int, RequestOutput] = {}

        async def collect():
            try:
                async for i, out in gen:
                    if out.finished:
                        final[i] = out
            finally:
                gen.close()

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "client disconnected")
        task.result()
        failed = [o for o in final.values() if o.finish_reason == "error"]
        if failed:
            raise generation_error(failed[0])
        return final

    async def complete(self, kind: str, req, rid: str, ids: list[int], gen, request,
                       turn: ChatTurn | None = None) -> dict[str, Any]:
        """Non-streaming: wait for every choice; abort if the client goes away."""
        final = await self.wait_final(gen, request)
        choices = []
        for i in sorted(final):
            out = final[i]
            self.metrics.observe(out, self.model_name)
            if kind == "chat":
                msg, proc = chat_output.message(turn.plan, out.text, turn.prompt_tail)
                choice = {"index": i, "message": msg,
                          "logprobs": {"content": [self._logprob_entry(lp) for lp in out.logprobs]} if req.logprobs else None,
                          "finish_reason": proc.finish_reason(out.finish_reason)}
            else:
                echoed = self._echo(req, ids)
                lps = None
                if req.logprobs is not None:
                    head = self._echo_logprobs(req, ids, out)
                    lps = self._completion_logprobs(head[0] + out.logprobs, head[1] + TextOffsets(
                        self.tokenizer, ids, len(echoed)).take([lp.token_id for lp in out.logprobs]))
                choice = {"index": i, "text": echoed + out.text, "finish_reason": out.finish_reason, "logprobs": lps}
            choices.append(choice)
        completion_tokens = sum(len(o.token_ids) for o in final.values())
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": now(), "model": self.model_name, "choices": choices,
                "usage": usage(len(ids), completion_tokens, final[min(final)].num_cached_tokens)}

    def _echo_logprobs(self, req, ids: list[int], out: RequestOutput) -> tuple[list, list[int]]:
        """The echoed prompt's logprob entries and text offsets (the first token has
        no logprob: null, as OpenAI's API gives it)."""
        if not req.echo or out.prompt_logprobs is None:
            return [], []
        first = TokenLogprob(ids[0], 0.0, None)  # top None: rendered as null
        lps = [first, *out.prompt_logprobs[1:]]
        return lps, TextOffsets(self.tokenizer, [], 0).take(ids)

    def _echo(self, req, ids: list[int]) -> str:
        """The prompt as text when a completion asks for `echo` (token-id prompts decoded)."""
        if not getattr(req, "echo", False):
            return ""
        prompt = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) \
            else req.prompt
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False)

    async def stream(self, kind: str, req, rid: str, ids: list[int], gen,
                     turn: ChatTurn | None = None) -> AsyncIterator[str]:
        """SSE events; closing this generator (client gone) aborts the request."""
        created, obj = now(), "chat.completion.chunk" if kind == "chat" else "text_completion"
        sent_role: set[int] = set()
        procs: dict[int, chat_output.ChatOutput] = {}
        completion_tokens, cached_tokens = 0, 0

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        so_far: dict[int, int] = {}  # tokens each choice has generated
        opts = req.stream_options
        continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)

        def chunk(choice: dict) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if continuous:
                body["usage"] = usage(len(ids), sum(so_far.values()), cached_tokens)
            return event(body)

        echoed = self._echo(req, ids) if kind == "completion" else ""
        offsets: dict[int, TextOffsets] = {}
        try:
            async for item in with_heartbeat(gen):
                if item is BEAT:  # a comment: SSE readers skip it, proxies and sockets see bytes
                    yield ": keep-alive\n\n"
                    continue
                i, out = item
                if kind == "completion" and i not in offsets:
                    offsets[i] = TextOffsets(self.tokenizer, ids, len(echoed))
                    if echoed:  # each choice starts with the prompt (and its logprobs, once computed)
                        head = self._echo_logprobs(req, ids, out)
                        yield chunk({"index": i, "text": echoed, "finish_reason": None,
                                     "logprobs": self._completion_logprobs(*head) if req.logprobs is not None else None})
                if out.finish_reason == "error":
                    yield event(generation_error(out).body())
                    break
                so_far[i] = len(out.token_ids)
                new_lps = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out.logprobs else []
                if kind == "chat":
                    proc = procs.setdefault(i, chat_output.ChatOutput(turn.plan, turn.prompt_tail))
                    delta: dict[str, Any] = {}
                    if i not in sent_role:
                        sent_role.add(i)
                        delta["role"] = "assistant"
                        delta["content"] = ""
                    delta.update(proc.parts(out))
                    choice = {"index": i, "delta": delta, "finish_reason": proc.finish_reason(out.finish_reason),
                              "logprobs": {"content": [self._logprob_entry(lp) for lp in new_lps]} if req.logprobs else None}
                else:
                    choice = {"index": i, "text": out.delta_text, "finish_reason": out.finish_reason,
                              "logprobs": self._completion_logprobs(new_lps, offsets[i].take(
                                  [lp.token_id for lp in new_lps])) if req.logprobs is not None else None}
                if out.finished:
                    completion_tokens += len(out.token_ids)
                    if i == 0:
                        cached_tokens = out.num_cached_tokens
                    self.metrics.observe(out, self.model_name)
                if delta_nonempty(choice) or out.finished:
                    yield chunk(choice)
            else:
                if req.stream_options and req.stream_options.include_usage:
                    yield event({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                 "choices": [], "usage": usage(len(ids), completion_tokens, cached_tokens)})
        finally:
            gen.close()
        yield "data: [DONE]\n\n"


def delta_nonempty(choice: dict) -> bool:
    if "delta" in choice:
        return bool(choice["delta"]) or bool(choice.get("logprobs"))
    return bool(choice["text"]) or bool(choice.get("logprobs") and choice["logprobs"]["tokens"])
