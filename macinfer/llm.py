"""The notebook API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from macinfer.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from macinfer.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Offline, batched generation on one engine.

    >>> llm = LLM("smollm2")                      # the bundled test model
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].text
    """

    def __init__(self, model: str, **engine_kwargs: Any):
        self.engine = LLMEngine(model, EngineConfig(**engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs as tokens arrive; each carries `delta_text`."""
        rid = self.engine.add_request(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    def apply_chat_template(self, messages: list[Message], **chat_options: Any) -> list[int]:
        """Prompt token ids for a conversation (see `TokenizerWrapper.encode_chat` for the options:
        tools, documents, continue_final_message, chat_template_kwargs)."""
        return self.tokenizer.encode_chat(messages, **chat_options)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | None = None,
        **chat_options: Any,
    ) -> RequestOutput | list[RequestOutput]:
        """One conversation -> one output; a list of conversations -> a list."""
        batch = bool(messages) and isinstance(messages[0], list)
        convs = messages if batch else [messages]
        outs = self.generate([self.apply_chat_template(c, **chat_options) for c in convs], params)  # type: ignore[arg-type]
        return outs if batch else outs[0]

    def chat_stream(self, messages: list[Message], params: SamplingParams | None = None,
                    **chat_options: Any) -> Iterator[RequestOutput]:
        return self.stream(self.apply_chat_template(messages, **chat_options), params)
