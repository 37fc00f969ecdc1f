"""The notebook API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Iterator
from typing import Any

from macinfer.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from macinfer.sampling_params import SamplingParams

Message = dict[str, Any]


class _Worker:
    """One daemon thread that runs every engine call. It parks on its queue for the
    life of the process and is never joined: an MLX thread that exits while the
    interpreter tears down races MLX's static destructors (seen as "terminate called
    without an active exception")."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="macinfer-llm", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, args, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to the caller
                    future.set_exception(e)

    def submit(self, fn, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        return future


class LLM:
    """Offline, batched generation on one engine.

    >>> llm = LLM("smollm2")                      # the bundled test model
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].text

    Safe to share between threads: the engine lives on one worker thread of its
    own (MLX streams belong to the thread that made them); calls from several
    threads are batched together, each step's outputs routed to their caller. A
    call interrupted by Ctrl-C (or any exception) aborts its requests, so the
    next call starts clean.
    """

    def __init__(self, model: str, **engine_kwargs: Any):
        self._worker = _Worker()
        self._live: set[str] = set()  # requests some caller is waiting on (worker thread only)
        self._pending: dict[str, list[RequestOutput]] = {}  # their outputs not yet collected
        self.engine: LLMEngine = self._call(LLMEngine, model, EngineConfig(**engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def __repr__(self) -> str:
        e = self.engine
        return (f"LLM(model={e.loaded.name!r}, architecture={e.model.args.model_type!r}, "
                f"max_model_len={e.max_model_len}, kv_blocks={e.kv_cache.num_blocks}x{e.kv_cache.block_size})")

    def _call(self, fn, *args: Any) -> Any:
        return self._worker.submit(fn, *args).result()

    def _add(self, prompts: list, params_list: list[SamplingParams]) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        self._live.update(ids)
        return ids

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort_request(rid)
            self._live.discard(rid)
            self._pending.pop(rid, None)

    def _pump(self, rids: set[str]) -> list[RequestOutput]:
        """Outputs for `rids`: buffered ones, else one engine step (others' outputs buffered)."""
        mine = [o for r in rids for o in self._pending.pop(r, [])]
        if not mine and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id in rids:
                    mine.append(out)
                elif out.request_id in self._live:
                    self._pending.setdefault(out.request_id, []).append(out)
        elif not mine:
            raise RuntimeError(f"requests {sorted(rids)} are no longer in the engine")
        for out in mine:
            if out.finished:
                self._live.discard(out.request_id)
        return mine

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = self._call(self._add, prompts, params_list)
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in self._call(self._pump, set(ids) - set(final)):
                    if out.finished:
                        final[out.request_id] = out
        finally:
            self._call(self._abort, [rid for rid in ids if rid not in final])
        return [final[rid] for rid in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs as tokens arrive; each carries `delta_text`."""
        [rid] = self._call(self._add, [prompt], [params or SamplingParams()])
        try:
            while True:
                for out in self._call(self._pump, {rid}):
                    yield out
                    if out.finished:
                        return
        finally:
            self._call(self._abort, [rid])

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
