"""The engine: requests in, one scheduled forward pass per `step()`, outputs out."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import numpy as np

from macinfer import kernels
from macinfer.kernels.backend import Backend
from macinfer.lora.registry import LoraRegistry
from macinfer.engine.choices import choose_paths
from macinfer.engine.disk_cache import disk_cache_for
from macinfer.engine.drafter import weight_bytes
from macinfer.engine.proposers import load_proposer, speculative_method
from macinfer.engine.block_manager import BlockManager
from macinfer.engine.config import EngineConfig
from macinfer.engine.embedding import EmbeddingJob
from macinfer.engine.runner import ModelRunner
from macinfer.engine.profile import maybe
from macinfer.engine.outputs import RequestOutput, _RequestState
from macinfer.engine.output_processor import OutputProcessor
from macinfer.engine.intake import PromptTooLongError, RequestIntake  # noqa: F401 (its home for callers)
from macinfer.engine.layout_check import check_against_mlx_lm
from macinfer.engine.scoring import score
from macinfer.engine.scheduler import Scheduler
from macinfer.engine.sequence import Sequence
from macinfer.engine.speculative import SpeculativeConfig
from macinfer.engine.state_group import StateGroup
from macinfer.engine.structured import StructuredOutputs
from macinfer.engine.cache_plan import plan_caches
from macinfer.kv.spec import FirstTokens
from macinfer.engine import images as engine_images
from macinfer.engine import multi_rank as dist_engine
from macinfer.distributed import group as dist_group
from macinfer.loading.loader import LoadedModel, load

if TYPE_CHECKING:
    from macinfer.vision.inputs import ImageInputs

log = logging.getLogger("macinfer")


class LLMEngine(RequestIntake):
    def __init__(self, model: str | LoadedModel, config: EngineConfig | None = None, progress=None):
        """`progress(done, total)` is called while weights load (files or tensors)."""
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        method = speculative_method(cfg)
        speculative = SpeculativeConfig(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                                        cfg.speculative_max_batch or 1, cfg.prompt_lookup_first) \
            if cfg.num_speculative_tokens else None
        context = (cfg.max_model_len, cfg.rope_scaling) if cfg.rope_scaling and cfg.max_model_len else None
        self.dist = None
        if cfg.distributed:
            if isinstance(model, LoadedModel):
                raise ValueError("distributed: give the model's path, so each rank loads its own part")
            self.dist = dist_group.init(cfg.distributed, cfg.distributed_timeout)
            self._inputs = dist_engine.StepInputs(self.dist)
        self.loaded = model if isinstance(model, LoadedModel) else load(model, cfg.model_impl, progress, context,
                                                                         self.dist)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        if cfg.chat_template is not None:
            from macinfer.text.chat_templates import resolve_chat_template

            missing = self.tokenizer.set_chat_template(resolve_chat_template(cfg.chat_template))
            if missing:
                log.warning("--chat-template %s writes %s, which this model's vocabulary lacks as tokens "
                            "(a template for another model family?)", cfg.chat_template, ", ".join(missing))
        args = self.model.args
        cfg = self.config
        model_len = args.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > model_len:
            # Positions beyond the trained ones give garbage without a RoPE extension:
            # refused, never silently capped (`--rope-scaling` stretches RoPE at load).
            raise ValueError(f"--max-model-len {cfg.max_model_len} is beyond this model's trained context of "
                             f"{model_len} tokens; use at most {model_len}, or add --rope-scaling yarn to "
                             "stretch RoPE to it (YaRN)")
        self.max_model_len = cfg.max_model_len or model_len
        self.vision, self.vision_refusal = engine_images.load(self)

        from macinfer.engine.selfcheck import self_check

        # This engine's device: its memory, limits, self-checked kernels and the paths chosen below.
        self.backend = Backend.detect(autotune=None if cfg.autotune else False)
        self.backend.kernel_mode = self_check(kernels.requested_mode())
        # A drafter's weights and pool share the target's budget: loaded first.
        self.drafter = load_proposer(self, method, progress, context)
        companion = self.drafter.companion() if self.drafter is not None else None
        # One cache spec per layer, decided by the model at load; caches of one kind form a
        # group; the budget buys each group's pool (`cache_plan.py`).
        plan = plan_caches(self.model, cfg, self._kv_dtype(), self.max_model_len, self.backend, companion)
        if self.dist is not None:  # one block plan for all ranks: every pool holds the smallest count
            agreed = dist_engine.agree_on_blocks(self.dist, plan.num_blocks)
            if agreed != plan.num_blocks:
                plan = plan_caches(self.model, dataclasses.replace(cfg, num_kv_blocks=agreed), self._kv_dtype(),
                                   self.max_model_len, self.backend)
        self.layer_specs, self.state_specs, self.kv_cache = plan.layer_specs, plan.state_specs, plan.kv_cache
        groups, num_blocks, states, bs = plan.groups, plan.num_blocks, plan.kv_cache.states, cfg.block_size
        # A sequence must always fit the pool alone, so preemption can always make room.
        if groups:
            self.max_model_len = min(self.max_model_len, num_blocks * cfg.block_size)
        slots = None if states is None else StateGroup(states, cfg.max_num_seqs, bs, plan.interval,
                                                       cfg.enable_prefix_caching, plan.num_verify)
        self.disk = disk_cache_for(self) if cfg.kv_disk_gb else None
        self.block_manager = BlockManager(groups, bs, cfg.enable_prefix_caching,
                                          cache_key=self.disk.identity if self.disk else self.loaded.source,
                                          state=slots)
        if self.disk is not None:
            self.block_manager.attach_disk(self.disk)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.max_prefill_with_decodes, speculative, self.max_model_len)
        if self.drafter is not None:
            self.drafter.allocate(plan.num_blocks)
            self.backend.set_limits(weight_bytes(self.model) + self.drafter.nbytes, self.kv_cache.nbytes)
        self.scheduler.drafter = self.drafter
        self.loras = LoraRegistry(self.model, cfg.max_loras)
        if self.vision is not None and self.vision.lora is not None:  # image prompts run under it
            self.loras.add(self.vision.lora, own=True)
        self.scheduler.on_lora_done = self.loras.release
        self.structured = StructuredOutputs(self.tokenizer, args.vocab_size)
        # Where there is more than one correct path (Metal kernels or MLX's ops, explicit or
        # fused attention ops, MLA's prompt form): the faster on the model's own shapes,
        # measured once per device and cached (`engine/choices.py`).
        self.paths = choose_paths(self.model, self.layer_specs, self.kv_cache.dtype, self.backend)
        if hasattr(self.model, "use_paths"):  # paths inside the model's own layers (the Llama file's qmv)
            self.model.use_paths(self.paths)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.structured,
                                  explicit_ops=self.paths.explicit_ops, prefill_tile=self.paths.prefill_tile,
                                  eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                                  mla_expand_from=self.paths.mla_expand_from,
                                  decode_partition=self.paths.decode_partition,
                                  decode_attention=self.paths.decode_attention)
        if self.drafter is not None and self.drafter.every_step:  # an MTP head reads the target's hidden rows
            self.runner.hidden_sink = self.drafter.capture
        self.distributed_status = None if self.dist is None else dist_engine.join(self, plan.num_blocks,
                                                                                  states is not None)
        if speculative is not None and cfg.speculative_max_batch is None:  # measured on this device
            from macinfer.engine.spec_batch import choose_speculative_batch

            self.scheduler.speculative = dataclasses.replace(
                speculative, max_batch=choose_speculative_batch(self, cfg.num_speculative_tokens))
        check_against_mlx_lm(self)
        self.requests: dict[str, _RequestState] = {}
        self._in_flight = None  # a pipeline's step whose tokens are not back yet (`pipelined_step`)
        self.overlapped_steps = 0  # steps submitted while another was in flight
        if states is not None:
            log.info("recurrent state: %d caches, %.2f MiB a sequence; %d slots (%d running), a snapshot every "
                     "%d tokens", len(self.state_specs), states.bytes_per_slot / 2**20, states.num_slots,
                     cfg.max_num_seqs, plan.interval)
        # Speculation: drafts checked and accepted, sequence-steps that verified drafts, and
        # how often the draft at each position was accepted (its acceptance per position).
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                      "spec_verify_steps": 0, "spec_accepted_by_position": [0] * cfg.num_speculative_tokens,
                      "spec_drafted_by_position": [0] * cfg.num_speculative_tokens, "images": 0, "image_tokens": 0}
        self.output = OutputProcessor(self.requests, self.scheduler, self.tokenizer, self.stats, self.max_model_len)
        log.info(
            "KV cache: %.2f GiB, %s%s, blocks of %d tokens: %s; max_model_len %d; decode attention: %s",
            self.kv_cache.nbytes / 2**30, self.kv_cache.dtype,
            f" as {self.kv_cache.kv_cache_dtype}" if self.kv_cache.quantized else "", bs,
            "; ".join(f"{g.kind.describe()}: {len(g.layers)} layers ({len(g.caches)} keep K/V), "
                      f"{g.num_blocks} blocks, {g.bytes_per_block // bs} bytes a token" for g in groups),
            self.max_model_len,
            self.paths.decode_attention + (" (reference in the layers keeping first tokens apart)"
                                           if self.kv_cache.first_of else ""),
        )
        draft_kv = getattr(self.drafter, "kv_cache", None)
        if draft_kv is not None:
            log.info("drafter's KV cache: %.2f GiB in the same budget, %d blocks", draft_kv.nbytes / 2**30,
                     draft_kv.groups[0].num_blocks if draft_kv.groups else 0)

    def prepare_images(self, prompt: list[int], images: list) -> tuple[list[int], "ImageInputs"]:
        """The prompt's image markers expanded for `images` (decoded PIL images) by the
        model's processor: the ids to queue and the `images` argument of `add_request`.
        CPU work on the host (resizing): callers on an event loop run it in a worker.
        Raises ImageError (the request's fault) or ValueError (this model takes no images)."""
        return engine_images.prepare(self.vision, self.vision_refusal, prompt, images)

    def cache_groups(self) -> list[dict]:
        """Per cache group: its kind, the layers reading it and the caches keeping K/V in it,
        block size, blocks total/used/cached, bytes per token and in all; for a model with
        recurrent layers, last, the state: slots total/running, snapshots, bytes."""
        stats = self.block_manager.stats()
        for st, g in zip(stats, self.kv_cache.groups):
            st["caches"] = list(g.caches)
            st["bytes_per_token"] = g.bytes_per_block // self.kv_cache.block_size
            if isinstance(g.kind, FirstTokens):  # (only each sequence's first tokens cost it)
                st["first_tokens"] = g.kind.count
            st["bytes"] = self.kv_cache.group_nbytes(g)
        return stats

    def drafter_pool(self) -> dict | None:
        """The drafter's own KV pool (bought from the same budget): blocks total/used and
        bytes; None without one."""
        kv = getattr(self.drafter, "kv_cache", None)
        if kv is None:
            return None
        bm = self.drafter.block_manager
        return {"blocks_total": bm.num_blocks, "blocks_used": bm.num_used_blocks, "bytes": kv.nbytes}

    def memory_bytes(self) -> int:
        """What this engine holds: weights (a vision tower's too) plus the KV pools (and recurrent state)."""
        from mlx.utils import tree_flatten

        vision = self.vision.encoder.nbytes if self.vision is not None else 0
        draft = self.drafter.nbytes if self.drafter is not None else 0
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters())) + self.kv_cache.nbytes + vision + draft

    def _kv_dtype(self) -> mx.Dtype:
        """The dtype K/V come out of the projections in (what mlx-lm's cache would hold)."""
        return self.model.kv_dtype()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def score(self, token_lists: list[list[int]], chunks: list[int]) -> list[np.ndarray]:
        """Logits at every position of each token list, fed in `chunks` (`engine/scoring.py`)."""
        if self.dist is not None and getattr(self, "requests", None) is not None:
            # (at load every rank runs the check against mlx-lm together; after it, rank 0 alone would wait)
            raise ValueError("score() bypasses the scheduler, so it cannot run over --distributed ranks")
        return score(self, token_lists, chunks)

    def embedding_job(self, token_lists: list[list[int]]) -> EmbeddingJob:
        """Embeddings of `token_lists`, one forward pass per `job.step()` (call them
        between engine steps, as the server's engine thread does)."""
        if self.dist is not None:
            raise ValueError("embeddings are not served with --distributed (they would run on rank 0 alone)")
        if self.loaded.pooling is None:
            raise ValueError("this model does not publish embedding use (no sentence-transformers pooling "
                             "config, no GGUF pooling_type)")
        for i, tokens in enumerate(token_lists):
            if not tokens or len(tokens) > self.max_model_len:
                raise PromptTooLongError(f"input {i} has {len(tokens)} tokens; 1 to {self.max_model_len} fit")
        return EmbeddingJob(self, token_lists)

    def embed(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        """Pooled, as the model publishes, final hidden states of each input (float32
        [hidden]), through the same paged cache and attention as generation, several
        inputs per forward pass."""
        job = self.embedding_job(token_lists)
        try:
            while not job.step():
                pass
        finally:
            job.close()
        return list(job.results)

    # -- the loop -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and report what changed.

        A failure that belongs to one request (its sampling, its detokenizing)
        ends that request with finish_reason "error"; the others go on.
        """
        if self.dist is not None:  # the workers replay this step's inputs, then run it too
            self._inputs.sync(busy=self.has_unfinished_requests(), in_flight=self._in_flight is not None)
            with self.dist.watch("step"):
                return self.run_step()
        return self.run_step()

    def idle(self) -> None:
        """Called by a serving loop with nothing to run: over several ranks, a sync when one
        is due (the workers wake for it; a dead or hung rank is found; aborts reach them)."""
        if self.dist is not None and self._inputs.due():
            self.step()

    def idle_wait(self, longest: float) -> float:
        """How long a serving loop with nothing to run may wait for requests (at most
        `longest`) before it calls `idle` again."""
        return min(longest, self._inputs.wait()) if self.dist is not None else longest

    def close(self) -> None:
        """Write the prefix cache to its disk tier (when on); over several ranks, let the
        workers return (they exit with the driver)."""
        if self.disk is not None:
            disk, self.disk = self.disk, None
            try:
                disk.flush(self.block_manager)
            except Exception:  # a shutdown goes on: the tier is a cache
                log.exception("writing the prefix cache to disk failed")
            disk.close()
        if self.dist is not None and self.dist.is_driver:
            dist_engine.shutdown(self.dist)
            self.dist = None

    def run_worker(self) -> None:
        """A worker rank's loop: the driver's steps, until it closes."""
        dist_engine.run_worker(self)

    def run_step(self) -> list[RequestOutput]:
        if self.scheduler.depth > 1:  # a pipeline with two steps in flight
            return dist_engine.pipelined_step(self)
        prof = self.runner.profile
        with maybe(prof, "schedule"):
            sched = self.scheduler.schedule()
        if not sched:
            return []
        failed = engine_images.encode_step(self.vision.encoder, sched.scheduled, self.output.fail) \
            if self.vision is not None else []
        if not sched.scheduled:
            return failed
        self._count(sched)
        try:
            results, errors = self.runner.step(sched.scheduled, self._lookahead())
        except Exception as e:  # the batch itself failed: no sequence's KV can be trusted
            if self.dist is not None:  # the ranks could no longer be in step
                dist_group.fatal(f"forward pass failed on rank {self.dist.rank}: {type(e).__name__}: {e}")
            log.exception("forward pass failed; failing the %d scheduled requests", len(sched.scheduled))
            outputs = [self.output.fail(seq, e) for seq, _ in sched.scheduled]
            self._recover_after_failed_step()
            return outputs
        with maybe(prof, "outputs"):
            outputs = failed + self.output.process(sched, results, errors)
        if not self.scheduler.running:  # the sequences a lookahead was for have all ended
            self.runner.ahead = None
        return outputs

    def _count(self, sched) -> None:
        if self.runner.profile is not None:
            self.runner.profile.steps += 1
        for seq, n in sched.scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.stats["prompt_tokens"] += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)

    def _lookahead(self) -> Callable[[Sequence, int], bool] | None:
        """How the runner takes a sequence's next block when it may build the next decode
        step ahead (`engine/lookahead.py`); None where it may not: several ranks (lockstep
        collectives), a step that may speculate, an MTP head (it reads every forward's rows)."""
        sched = self.scheduler
        if (not self.config.async_scheduling or self.dist is not None or self.runner.hidden_sink is not None
                or (sched.speculative is not None and len(sched.running) <= sched.speculative.max_batch)):
            return None
        return self._reserve_next

    def _reserve_next(self, seq: Sequence, n: int) -> bool:
        """Room for `n` tokens of `seq` (the token this step draws included), taken now,
        as the scheduler would next step; False when no block is free or the context is full."""
        if n > self.max_model_len or not self.block_manager.can_allocate(seq, n):
            return False
        self.block_manager.allocate(seq, n)
        return True

    def _recover_after_failed_step(self) -> None:
        """A failed forward (e.g. out of memory inside lazy evaluation) may leave any
        slot of the K/V pools unwritten: withdraw every prefix-cache entry, reset the
        pools, and recompute the other running sequences from their tokens."""
        self.runner.ahead = None
        self.block_manager.drop_cache()
        self.kv_cache.reset()
        if self.drafter is not None:
            self.drafter.reset()
        for seq in list(self.scheduler.running):
            self.scheduler.preempt(seq)
        log.warning("KV cache reset after a failed step; %d running requests will be recomputed",
                    len(self.scheduler.waiting))
