"""OpenAI chat/completions semantics on top of AsyncEngine: params, responses, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from macinfer.text import reasoning
from macinfer.engine.llm_engine import RequestOutput
from macinfer.engine.sequence import TokenLogprob
from macinfer.engine.structured import GrammarError
from macinfer.sampling_params import InvalidSamplingParamsError, SamplingParams
from macinfer.server.async_engine import AsyncEngine, RequestStream
from macinfer.server.metrics import ServerMetrics
from macinfer.server import chat_output
from macinfer.server.heartbeat import BEAT, with_heartbeat
from macinfer.server.chat_output import ChatPlan
from macinfer.server.protocol import ChatCompletionRequest, CompletionRequest, now, usage
from macinfer.text.tokenizer import IncrementalDetokenizer, TokenizerWrapper, token_text

log = logging.getLogger("macinfer.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatTurn:
    """A chat request made ready: prompt ids, what the answer must look like, and the
    prompt's last text (whether the template opened a think block)."""
    ids: list[int]
    plan: ChatPlan
    prompt_tail: str = ""
    ignored: list[str] = field(default_factory=list)  # fields this model cannot act on (a response header)
    images: Any = None  # `vision.inputs.ImageInputs` when the messages hold images


# The output cap of a request that sets none (`serve --max-tokens-default`): without one a
# request runs to the end of the context, minutes at CPU speed, which looks like a hang.
DEFAULT_MAX_TOKENS = 4096
# Sampling of a request that leaves a field unset; `serve --temperature/--top-p/--top-k/--seed`
# replace them, as llama-server's flags do.
SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None}


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                    logprobs: int | None, plan: ChatPlan | None = None,
                    defaults: dict[str, Any] = SAMPLING_DEFAULTS) -> list[SamplingParams]:
    """One SamplingParams per choice; choices of a seeded request get seed, seed+1, ...
    Fields the request leaves unset take the server's `defaults`."""
    given = {k: getattr(req, k) for k in SAMPLING_DEFAULTS}
    temperature, top_p, top_k, seed = (v if v is not None else defaults[k] for k, v in given.items())
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()} or None
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    out = []
    for i in range(req.n):
        try:
            out.append(SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                min_p=req.min_p, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                seed=None if seed is None else seed + i, stop=stop,
                stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                logprobs=logprobs, logit_bias=bias,
                grammar=plan.grammar if plan else None,
                thinking_budget=plan.thinking_budget if plan else None,
                thinking_end=plan.thinking_end if plan else (),
                thinking_open=plan.thinking_open if plan else False,
                skip_special_tokens=plan.skip_special_tokens if plan else True,
                # echo + logprobs: the prompt's tokens get logprobs too (lm-eval-harness scores with them)
                prompt_logprobs=logprobs if getattr(req, "echo", False) and logprobs is not None else None,
            ))
        except InvalidSamplingParamsError as e:
            raise APIError(400, str(e), param=e.param) from None
    return out


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


_MAX_CHARS_PER_TOKEN = 32


def _generation_error(out: RequestOutput) -> APIError:
    """What a client learns of a failed request: a message meant for it (shutdown,
    engine stopped: 503), or a generic 500. Exception text and paths stay in the log."""
    if out.client_error:
        return APIError(503, out.client_error, type="server_error", code="service_unavailable")
    log.error("request %s failed: %s", out.request_id, out.error)
    return APIError(500, "generation failed with an internal error (details are in the server log)",
                    type="server_error")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 aliases: tuple[str, ...] = (), cache_isolation: str = "key-and-user", tool_parser: str | None = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, sampling_defaults: dict[str, Any] | None = None,
                 allow_image_urls: bool = False):
        self.engine = engine
        self.allow_image_urls = allow_image_urls
        self.default_max_tokens = default_max_tokens
        self.sampling_defaults = {**SAMPLING_DEFAULTS, **(sampling_defaults or {})}
        self.tool_parser = tool_parser
        self._template_renders_tools: bool | None = None  # (`_renders_tools`, decided on first use)
        self.model_name = model_name
        self.aliases = {model_name, *aliases}
        self.cache_isolation = cache_isolation
        self.tokenizer = engine.engine.tokenizer
        self.metrics = metrics

    def check_model(self, model: str | None) -> None:
        """For `GET /v1/models/{id}`: this server's id and aliases only. Generation requests
        take any `model` value, as llama-server does (one model is served; agents send
        their own model names), and answer with this server's id."""
        if model is not None and model not in self.aliases:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def _validate(self, prompt: str | list[int], params: list[SamplingParams], plan: ChatPlan | None = None) -> list[int]:
        try:
            return self.engine.validate(prompt, params[0])
        except GrammarError as e:  # a schema the grammar compiler refuses
            where = {"tools": "the tool's parameters schema", "response_format": "the response_format schema"}
            raise APIError(400, f"{where.get(plan.grammar_param, 'the grammar') if plan else 'the grammar'} does not "
                           f"compile: {str(e).removeprefix('invalid grammar: ')}",
                           param=plan.grammar_param if plan else None) from None
        except ValueError as e:
            param = getattr(e, "param", None) or (
                "max_tokens" if "max_tokens" in str(e) else "prompt" if "prompt" in str(e) else None)
            raise APIError(400, str(e), param=param, code="context_length_exceeded" if "context" in str(e) else None) from None

    # -- chat -------------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest) -> ChatTurn:
        """Prompt ids: the chat template rendered and tokenized as transformers does,
        with special-token strings in message content kept as plain text; and the
        plan for the answer (tools, tool choice, response format, reasoning)."""
        if sum(len(m.text()) for m in req.messages) > _MAX_CHARS_PER_TOKEN * self.engine.engine.max_model_len:
            raise APIError(400, f"messages are far beyond this model's context of {self.engine.engine.max_model_len} "
                           "tokens", param="messages", code="context_length_exceeded")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        fmt = req.response_format.model_dump(exclude_none=True, by_alias=True) if req.response_format else None
        try:
            plan = chat_output.plan(tools, choice, req.parallel_tool_calls, fmt, self.tokenizer.chat_template,
                                    self.tool_parser, renders_tools=not tools or self._renders_tools())
        except chat_output.PlanError as e:
            raise APIError(400, str(e), param=e.param) from None
        messages = chat_output.template_messages(
            [m.model_dump(exclude_none=True) | {"content": m.template_content()} for m in req.messages])
        messages, pictures = self._images(messages)
        if plan.forced == "generic":
            messages = chat_output.with_generic_tools(messages, plan.tool_specs)
        template, ignored = self.tokenizer.chat_template, []
        effort = reasoning.effort_kwargs(req.reasoning_effort, template)
        if effort is None:  # no thinking control in this template: nothing to map it onto
            effort, ignored = {}, ["reasoning_effort"]
        kwargs = {**effort, **(req.chat_template_kwargs or {})} or None
        try:
            ids = self.tokenizer.encode_chat(
                messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, documents=req.documents,
                chat_template_kwargs=kwargs, tools=plan.tools,
            )
        except ValueError as e:  # a template that refuses the conversation (roles, order), bad kwargs
            raise APIError(400, str(e), param="messages") from None
        tail = self.tokenizer.decode(ids[-8:], skip_special_tokens=False) if plan.reasoning else ""
        if req.thinking_budget is not None:
            self._thinking_budget(req, plan, kwargs or {}, tail)
        images = None
        if pictures:
            try:
                ids, images = self.engine.engine.prepare_images(ids, pictures)
            except ValueError as e:  # ImageError: the image's fault; else the model's: 400 either way
                raise APIError(400, str(e), param="messages") from None
        return ChatTurn(ids, plan, tail, ignored, images)

    def _images(self, messages: list[dict]) -> tuple[list[dict], list]:
        """The messages' images taken out and decoded (a 400 naming the part when one is
        bad, or when this model takes none)."""
        from macinfer.vision.images import ImageLimits
        from macinfer.vision.messages import IMAGE_PARTS, split_images

        has = any(isinstance(m.get("content"), list) and any(p.get("type") in IMAGE_PARTS for p in m["content"])
                  for m in messages)
        if not has:
            return messages, []
        engine = self.engine.engine
        if engine.vision is None:
            why = engine.vision_refusal or "it is a text model"
            raise APIError(400, f"this model takes no images: {why}", param="messages")
        limits = dataclasses.replace(engine.vision.limits if engine.vision else ImageLimits(),
                                     allow_urls=self.allow_image_urls)
        try:
            return split_images(messages, limits)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    def _renders_tools(self) -> bool:
        """Whether the chat template puts `tools` in the prompt (rendered with and without one)."""
        if self._template_renders_tools is None:
            probe = [{"role": "user", "content": "x"}]
            tool = [{"type": "function", "function": {"name": "probe_tool_name", "parameters": {"type": "object"}}}]
            try:
                self._template_renders_tools = "probe_tool_name" in self.tokenizer.apply_chat_template(probe, tools=tool)
            except ValueError:  # a template that refuses the probe: trust its own tool handling
                self._template_renders_tools = True
        return self._template_renders_tools

    def _thinking_budget(self, req: ChatCompletionRequest, plan: ChatPlan, kwargs: dict, tail: str) -> None:
        """Close the think block after `thinking_budget` tokens of it (the template's marker, forced)."""
        if not reasoning.template_reasons(self.tokenizer.chat_template) or kwargs.get("enable_thinking") is False:
            raise APIError(400, "a thinking budget needs thinking on, in a chat template with a think block",
                           param="thinking_budget")
        if plan.grammar is not None:
            raise APIError(400, "a thinking budget with a response format or a forced tool call is not supported",
                           param="thinking_budget")
        plan.thinking_budget, plan.thinking_open = req.thinking_budget, reasoning.prompt_opens_think(tail)
        plan.thinking_end = tuple(self.tokenizer.encode("\n" + reasoning.END + "\n\n", add_special_tokens=False))

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

    def prepare(self, req, prompt: str | list[int], max_tokens, logprobs,
                plan: ChatPlan | None = None) -> tuple[list[int], list[SamplingParams]]:
        """Sampling params and validated prompt ids. Tokenizes: call it off the event loop."""
        params = sampling_params(req, max_tokens, logprobs, plan, self.sampling_defaults)
        if logprobs is not None:
            self.tokenizer.token_byte_table()  # built here, off the event loop, before responses need it
        context = self.engine.engine.max_model_len
        if isinstance(prompt, str) and len(prompt) > _MAX_CHARS_PER_TOKEN * context:
            # Refuse before tokenizing: no tokenizer packs this many characters into a token.
            raise APIError(400, f"prompt is {len(prompt):,} characters, far beyond this model's context of "
                           f"{context} tokens", param="prompt", code="context_length_exceeded")
        ids = self._validate(prompt, params, plan)  # the prompt must leave room for one token
        return ids, params, self._limit_output(params, max_tokens, context - len(ids), context)

    def _limit_output(self, params: list[SamplingParams], asked: int | None, room: int, context: int) -> str | None:
        """Output limits as local servers set them: a `max_tokens` beyond what the context
        leaves is clamped to it (the answer ends with finish_reason "length"), and none
        given means `default_max_tokens` (also within the room). Returns the
        `x-macinfer-max-tokens` header's value when the server chose the limit."""
        limit = min(asked if asked is not None else self.default_max_tokens, room)
        for p in params:
            p.max_tokens = limit
        if asked is None:
            return f"{limit} (default)"
        if asked > room:
            return f"{limit} (asked {asked}; the prompt leaves {room} of the {context}-token context)"
        return None

    def submit(self, req, ids: list[int], params: list[SamplingParams], kind: str,
               client: tuple[int | None, str | None], images: Any = None,
               lora: str | None = None) -> tuple[str, RequestStream]:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        return rid, self.engine.submit(ids, params, rid, cache_salt=self.cache_salt(req.cache_salt, *client),
                                       images=images, lora=lora)

    def cache_salt(self, salt: str | None, key_id: str | None, user: str | None) -> str | None:
        """Requests share prefix-cache entries only within the isolation scope: a
        request's own `cache_salt`, plus its API key (a digest of it) and/or `user` field."""
        parts = [salt or ""]
        if self.cache_isolation in ("key", "key-and-user"):
            parts.append(f"key:{key_id}" if key_id is not None else "")
        if self.cache_isolation == "key-and-user":
            parts.append(user or "")
        return "\x00".join(parts) if any(parts) else None

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
            raise _generation_error(failed[0])
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
                    yield event(_generation_error(out).body())
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
