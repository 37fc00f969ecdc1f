"""OpenAI chat/completions semantics on top of AsyncEngine: a request made ready (its prompt,
images, sampling params and output limits, validated once); the answers are `openai_output`."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

from macinfer.text import reasoning
from macinfer.engine.structured import GrammarError
from macinfer.sampling_params import InvalidSamplingParamsError, SamplingParams
from macinfer.server.async_engine import AsyncEngine, RequestStream
from macinfer.server.metrics import ServerMetrics
from macinfer.server import chat_output
from macinfer.server.chat_output import ChatPlan, ChatTurn
from macinfer.server.errors import APIError
from macinfer.server.openai_output import OpenAIOutput
from macinfer.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("macinfer.server")


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


_MAX_CHARS_PER_TOKEN = 32


class OpenAIServing(OpenAIOutput):
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
            return split_images(messages, limits, inline=engine.vision.processor.inline_marker)
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
