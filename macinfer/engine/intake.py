"""Requests into the engine (vLLM v1's input processing): a prompt and its sampling
parameters validated against the model and the engine's limits, once, before anything
changes; then the sequence built (seed, grammar matcher, images, adapter slot) and queued.
Also LoRA adapters loaded and unloaded, and requests aborted. A mixin of `LLMEngine`: its
tokenizer, model, limits, scheduler and request table are the engine's."""

from __future__ import annotations

import logging
import random
import time
import uuid
from typing import TYPE_CHECKING

from macinfer.engine.outputs import _RequestState
from macinfer.engine.sequence import Sequence
from macinfer.lora.adapter import LoraAdapter, LoraError, load_adapter
from macinfer.sampling_params import InvalidSamplingParamsError, SamplingParams
from macinfer.text.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from macinfer.vision.inputs import ImageInputs

log = logging.getLogger("macinfer")


class PromptTooLongError(ValueError):
    pass


class RequestIntake:
    """Validation, queueing, adapters and aborts of `LLMEngine` (module docstring)."""

    def validate_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids for `prompt`, or a ValueError a user can act on. No state changes."""
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model.args.vocab_size
        rows = getattr(self.model.args, "input_vocab_size", None) or vocab
        if any(not isinstance(i, int) or not 0 <= i < rows for i in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {rows})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidSamplingParamsError("logit_bias", f"logit_bias token ids must be below {vocab}")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {len(ids)} tokens; this engine's context is {self.max_model_len} "
                "tokens and the prompt must leave room for at least one new token"
            )
        if params.max_tokens is not None and params.strict_max_tokens:
            if len(ids) + params.max_tokens > self.max_model_len:
                raise PromptTooLongError(
                    f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                    f"the context length ({self.max_model_len} tokens)"
                )
        if params.n != 1:
            raise ValueError("n > 1 is served by the API layer; the engine takes n=1")
        if params.grammar is not None:
            self.structured.validate(params.grammar)
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        images: "ImageInputs | None" = None,
        lora: str | None = None,
    ) -> str:
        """Queue a request. `cache_salt` keeps its prefix-cache entries private:
        only requests with the same salt can reuse them. `images`: from `prepare_images`
        (the prompt its ids). `lora`: the name of a loaded adapter to run it under (its
        blocks keyed by the adapter's content: shared with no other adapter's)."""
        params = params or SamplingParams()
        ids = self.validate_request(prompt, params)
        if lora is not None and lora not in self.loras:
            raise LoraError(f"no LoRA adapter named {lora!r} is loaded")
        own = getattr(self.vision, "lora", None)
        if own is not None and images is not None and images.spans:  # (`vision/modality_lora.py`)
            if lora is not None:
                raise LoraError(f"this model runs prompts with images under its own vision LoRA; a request with "
                                f"images takes no other adapter ({lora!r})")
            lora = own.name
        if lora is not None:
            cache_salt = f"{cache_salt or ''}\x00lora:{self.loras.adapters[lora].digest}"
        if images is not None and self.vision is None:
            raise ValueError("this model takes no images")
        if images is not None and any(s.end > len(ids) for s in images.spans):
            raise ValueError("images: their positions lie past the prompt (use the ids prepare_images returned)")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        seq = Sequence(request_id, ids, params, seed, arrival_time=time.perf_counter(), cache_salt=cache_salt,
                       images=images if images is not None and images.spans else None)
        if params.grammar is not None:
            seq.matcher = self.structured.matcher(params.grammar)  # GrammarError: the request's fault
        if seq.images is not None:
            self.stats["images"] += len(seq.images.spans)
            self.stats["image_tokens"] += seq.images.num_tokens
        if lora is not None:
            seq.lora_slot = self.loras.acquire(lora)[0]
        prompt_text = prompt if isinstance(prompt, str) else None
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, ids)
        self.requests[request_id] = _RequestState(seq, detok, prompt_text)
        self.scheduler.add(seq)
        if self.dist is not None:  # replayed on every rank before the next step (only once it was added here)
            # (images with their processed pixels: every rank encodes them, as it computes every step)
            self._inputs.record(("add", ids, params, request_id, cache_salt, seq.images))
        return request_id

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Serve the adapter at `path` as `name` (`macinfer/lora/`). Raises LoraError."""
        if self.dist is not None:
            raise LoraError("LoRA adapters are not served over --distributed ranks yet (each rank holds a share "
                            "of the layers they adapt)")
        adapter = load_adapter(name, path)
        self.loras.add(adapter)
        log.info("LoRA adapter %s loaded from %s (%s, %d layers, %.1f MiB)", name, path, adapter.format,
                 len(adapter.parts), adapter.nbytes / 2**20)
        return adapter

    def unload_lora(self, name: str) -> None:
        """Stop serving `name` (its running requests finish under it)."""
        self.loras.remove(name)

    def abort_request(self, request_id: str) -> None:
        if self.dist is not None:
            self._inputs.record(("abort", request_id))
        state = self.requests.pop(request_id, None)
        if state is not None and not state.seq.is_finished:
            self.scheduler.finish(state.seq, "abort")
