"""OpenAI chat/completions semantics on top of AsyncEngine: params, responses, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from macinfer.engine.llm_engine import RequestOutput
from macinfer.sampling_params import InvalidSamplingParamsError, SamplingParams
from macinfer.server.async_engine import AsyncEngine, RequestStream
from macinfer.server.metrics import ServerMetrics
from macinfer.server.protocol import ChatCompletionRequest, CompletionRequest, now, usage
from macinfer.tokenizer import TokenizerWrapper


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                    logprobs: int | None) -> list[SamplingParams]:
    """One SamplingParams per choice; choices of a seeded request get seed, seed+1, ..."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    out = []
    for i in range(req.n):
        try:
            out.append(SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                seed=None if req.seed is None else req.seed + i, stop=stop,
                stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                logprobs=logprobs, strict_max_tokens=max_tokens is not None,
            ))
        except InvalidSamplingParamsError as e:
            raise APIError(400, str(e), param=e.param) from None
    return out


def _token_text(tok: TokenizerWrapper, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        self.metrics = metrics

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def _validate(self, prompt: str | list[int], params: list[SamplingParams]) -> list[int]:
        try:
            return self.engine.validate(prompt, params[0])
        except ValueError as e:
            param = "max_tokens" if "max_tokens" in str(e) else "prompt" if "prompt" in str(e) else None
            raise APIError(400, str(e), param=param, code="context_length_exceeded" if "context" in str(e) else None) from None

    # -- chat -------------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """Prompt ids: the chat template rendered and tokenized as transformers does,
        with special-token strings in message content kept as plain text."""
        messages = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in req.messages]
        try:
            return self.tokenizer.encode_chat(
                messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, documents=req.documents,
                chat_template_kwargs=req.chat_template_kwargs,
            )
        except ValueError as e:  # a template that refuses the conversation (roles, order), bad kwargs
            raise APIError(400, str(e), param="messages") from None

    def _logprob_entry(self, lp) -> dict[str, Any]:
        text = _token_text(self.tokenizer, lp.token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := _token_text(self.tokenizer, i)), "logprob": v, "bytes": list(t.encode())}
                                 for i, v in lp.top]}

    def _completion_logprobs(self, lps, offset: int) -> dict[str, Any]:
        tokens = [_token_text(self.tokenizer, lp.token_id) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{_token_text(self.tokenizer, i): v for i, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def start(self, req, prompt: str | list[int], max_tokens, logprobs, kind: str) -> tuple[str, list[int], RequestStream]:
        params = sampling_params(req, max_tokens, logprobs)
        ids = self._validate(prompt, params)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        return rid, ids, self.engine.submit(ids, params, rid, cache_salt=req.cache_salt)

    async def complete(self, kind: str, req, rid: str, ids: list[int], gen, request) -> dict[str, Any]:
        """Non-streaming: wait for every choice; abort if the client goes away."""
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
        errors = [o.error for o in final.values() if o.finish_reason == "error"]
        if errors:
            raise APIError(500, f"generation failed: {errors[0]}", type="server_error")
        choices = []
        for i in sorted(final):
            out = final[i]
            self.metrics.observe(out)
            if kind == "chat":
                choice = {"index": i, "message": {"role": "assistant", "content": out.text},
                          "logprobs": {"content": [self._logprob_entry(lp) for lp in out.logprobs]} if req.logprobs else None,
                          "finish_reason": out.finish_reason}
            else:
                text = (req.prompt if req.echo and isinstance(req.prompt, str) else "") + out.text
                choice = {"index": i, "text": text, "finish_reason": out.finish_reason,
                          "logprobs": self._completion_logprobs(out.logprobs, 0) if req.logprobs is not None else None}
            choices.append(choice)
        completion_tokens = sum(len(o.token_ids) for o in final.values())
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": now(), "model": self.model_name, "choices": choices,
                "usage": usage(len(ids), completion_tokens, final[min(final)].num_cached_tokens)}

    async def stream(self, kind: str, req, rid: str, ids: list[int], gen) -> AsyncIterator[str]:
        """SSE events; closing this generator (client gone) aborts the request."""
        created, obj = now(), "chat.completion.chunk" if kind == "chat" else "text_completion"
        sent_role: set[int] = set()
        text_pos: dict[int, int] = {}
        completion_tokens, cached_tokens = 0, 0

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        def chunk(choice: dict) -> str:
            return event({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]})

        try:
            async for i, out in gen:
                if out.finish_reason == "error":
                    err = APIError(500, f"generation failed: {out.error}", type="server_error")
                    yield event(err.body())
                    break
                new_lps = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out.logprobs else []
                if kind == "chat":
                    delta: dict[str, Any] = {}
                    if i not in sent_role:
                        sent_role.add(i)
                        delta["role"] = "assistant"
                    if out.delta_text or "role" in delta:
                        delta["content"] = out.delta_text
                    choice = {"index": i, "delta": delta, "finish_reason": out.finish_reason,
                              "logprobs": {"content": [self._logprob_entry(lp) for lp in new_lps]} if req.logprobs else None}
                else:
                    choice = {"index": i, "text": out.delta_text, "finish_reason": out.finish_reason,
                              "logprobs": self._completion_logprobs(new_lps, text_pos.get(i, 0)) if req.logprobs is not None else None}
                    text_pos[i] = text_pos.get(i, 0) + len(out.delta_text)
                if out.finished:
                    completion_tokens += len(out.token_ids)
                    if i == 0:
                        cached_tokens = out.num_cached_tokens
                    self.metrics.observe(out)
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
