"""The notebook API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import atexit
import sys
import concurrent.futures
import queue
import threading
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

from macinfer.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from macinfer.sampling_params import SamplingParams

Message = dict[str, Any]


class _Worker:
    """One daemon thread that runs every engine call. It ends when its LLM is
    closed or collected (`stop`), and whoever stops it waits for it to end: an MLX
    thread that exits while the interpreter tears down races MLX's static destructors
    ("terminate called without an active exception", exit code 134: seen on every
    `llm.close()` just before the script ended)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="macinfer-llm", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, future = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to the caller
                    future.set_exception(e)
            # Drop this job's references now: a bound method held until the next job
            # would keep its LLM (and the engine's memory) alive after the caller let go.
            del fn, args, future

    def submit(self, fn, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        return future

    def stop(self) -> None:
        self.stopped = True
        self._jobs.put(None)


def _release(worker: _Worker, engine_box: list) -> None:
    """Run when an LLM is collected (or closed): the engine is freed on its own thread,
    then the thread ends and MLX's buffer cache gives the memory back."""
    from macinfer.loading.memory import release_freed

    def free() -> None:
        import mlx.core as mx

        if engine_box and engine_box[0].disk is not None:
            engine_box[0].close()  # the prefix cache to its disk tier first
        # Work still queued on this thread's stream (a decode step built ahead and never
        # taken) must end before the process may: MLX aborts an exit with a stream busy.
        mx.synchronize()
        engine_box.clear()
        release_freed()

    worker.submit(free)
    worker.stop()
    if threading.current_thread() is not worker.thread:  # (collected on the worker itself: it ends next)
        worker.thread.join(timeout=120)  # the prefix cache's write to disk may take a while
        _until_gone(worker.thread.native_id)


def _until_gone(tid: int | None, timeout: float = 5.0) -> None:
    """Wait until the OS thread `tid` has exited: `join` returns before a thread's C++
    thread-locals (MLX's per-thread stream) are destroyed, and a process that exits
    meanwhile aborts. Linux shows live threads in /proc; elsewhere a short grace period."""
    import os
    import time

    if tid is None:
        return
    if not os.path.isdir("/proc/self/task"):
        time.sleep(0.2)
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.005)


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
        try:
            engine = self._call(LLMEngine, model, EngineConfig(**engine_kwargs))
        except BaseException:
            self._worker.stop()
            raise
        # The engine is owned through a box the finalizer can empty: the LLM object is
        # what users drop, and its engine must go with it (not at interpreter exit).
        if engine.dist is not None:
            if not engine.dist.is_driver:  # a worker rank (under mlx.launch): rank 0's steps, then exit
                self._call(engine.run_worker)
                sys.exit(0)
            atexit.register(lambda: None if self._worker.stopped else self._call(engine.close))
        self._engine_box = [engine]
        if engine.disk is not None:  # written at exit too, if never closed (the box, not the engine: no leak)
            box, worker = self._engine_box, self._worker
            atexit.register(lambda: None if worker.stopped or not box else worker.submit(box[0].close).result(120))
        self._finalizer = weakref.finalize(self, _release, self._worker, self._engine_box)
        self._finalizer.atexit = False
        self.tokenizer = engine.tokenizer

    @property
    def engine(self) -> LLMEngine:
        if not self._engine_box:
            raise RuntimeError("this LLM is closed")
        return self._engine_box[0]

    def close(self) -> None:
        """Free the engine (weights, KV cache) and its thread now; also done when the
        LLM is garbage collected."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        e = self.engine
        return (f"LLM(model={e.loaded.name!r}, architecture={e.model.args.model_type!r}, "
                f"max_model_len={e.max_model_len}, kv_blocks={e.kv_cache.num_blocks}x{e.kv_cache.block_size}, "
                f"cache_groups={len(e.kv_cache.groups)})")

    def cache_groups(self) -> list[dict]:
        """Per KV cache group: kind, layers, block size, blocks total/used/cached, bytes per token."""
        return self._call(self.engine.cache_groups)

    def _call(self, fn, *args: Any) -> Any:
        if threading.current_thread() is self._worker.thread:
            # Already on the worker (e.g. a half-read stream collected by the cyclic GC
            # there runs its `finally`): waiting on our own queue would deadlock.
            return fn(*args)
        if self._worker.stopped:
            raise RuntimeError("this LLM is closed")
        future = self._worker.submit(fn, *args)
        try:
            return future.result()
        except RuntimeError as e:
            # Ctrl-C landing inside the future's lock surfaces as "cannot release un-acquired
            # lock" (seen in a shuffled CI run): the user pressed Ctrl-C, so that is what they get.
            if isinstance(e.__context__, KeyboardInterrupt):
                raise e.__context__ from None
            raise

    def _add(self, prompts: list, params_list: list[SamplingParams], ids: list[str],
             loras: list[str | None] | None = None) -> None:
        added: list[str] = []
        try:
            for prompt, p, rid, lora in zip(prompts, params_list, ids, loras or [None] * len(prompts)):
                images = None
                if isinstance(prompt, tuple):  # (ids, ImageInputs): a chat with images
                    prompt, images = prompt
                added.append(self.engine.add_request(prompt, p, request_id=rid, images=images, lora=lora))
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        self._live.update(ids)

    def _abort(self, ids: list[str]) -> None:
        if not self._engine_box:  # closed: nothing left to abort
            return
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

    def load_lora(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at `path` (mlx-lm's or PEFT's files) as `name`: requests
        name it with `lora=`, and run batched with the base's and other adapters'."""
        self._call(self.engine.load_lora, name, path)

    def unload_lora(self, name: str) -> None:
        self._call(self.engine.unload_lora, name)

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; results in prompt order. `lora`: the
        loaded adapter to run them under (`load_lora`), or one per prompt (None: the base)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("need one lora (or None) per prompt")
        # Ids chosen here, so an interrupt (Ctrl-C) even while they are being added
        # still aborts every one of them: nothing keeps decoding behind the next call.
        ids = [uuid.uuid4().hex for _ in prompts]
        final: dict[str, RequestOutput] = {}
        try:
            self._call(self._add, prompts, params_list, ids, loras)
            while len(final) < len(ids):
                for out in self._call(self._pump, set(ids) - set(final)):
                    if out.finished:
                        final[out.request_id] = out
        finally:
            self._call(self._abort, [rid for rid in ids if rid not in final])
        return [final[rid] for rid in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               lora: str | None = None) -> Iterator[RequestOutput]:
        """Yield outputs as tokens arrive; each carries `delta_text`."""
        rid = uuid.uuid4().hex
        try:
            self._call(self._add, [prompt], [params or SamplingParams()], [rid], [lora])
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

    def _chat_prompt(self, messages: list[Message], **chat_options: Any) -> Any:
        """A conversation's prompt: its ids, or (ids, images) when a message holds image parts
        (`{"type": "image", "image": PIL image | bytes | path}`, or an `image_url` data URL)."""
        from macinfer.vision.images import ImageLimits
        from macinfer.vision.messages import split_images

        vision = self.engine.vision
        messages, images = split_images(messages, vision.limits if vision else ImageLimits(), allow_paths=True,
                                        inline=vision.processor.inline_marker if vision else None)
        ids = self.tokenizer.encode_chat(messages, **chat_options)
        return self.engine.prepare_images(ids, images) if images else ids

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | None = None,
        lora: str | list[str | None] | None = None,
        **chat_options: Any,
    ) -> RequestOutput | list[RequestOutput]:
        """One conversation -> one output; a list of conversations -> a list."""
        batch = bool(messages) and isinstance(messages[0], list)
        convs = messages if batch else [messages]
        outs = self.generate([self._chat_prompt(c, **chat_options) for c in convs], params,  # type: ignore[arg-type]
                             lora=lora)
        return outs if batch else outs[0]

    def chat_stream(self, messages: list[Message], params: SamplingParams | None = None,
                    lora: str | None = None, **chat_options: Any) -> Iterator[RequestOutput]:
        return self.stream(self._chat_prompt(messages, **chat_options), params, lora)
