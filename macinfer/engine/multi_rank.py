"""The engine over several ranks: every rank runs the same steps on its shard.

Rank 0 (the driver) takes requests. Before each step it broadcasts the requests added and
aborted since the last one; every other rank (a worker) replays them and runs the same
step. Scheduling, block tables, prefix-cache hits, preemption, chunking and speculation
are deterministic functions of those inputs, so every rank plans the same batch without
it being shipped; the forward pass's collectives (all-reduces of the tensor-parallel
shards, the pipeline's sends) keep them in step. Rank 0 samples (it holds the real logits
in both modes) and broadcasts the tokens, so grammars, stop strings and drafts advance the
same everywhere.

Idle, the ranks sleep. MLX's ring transport spins a core while a receive is pending (its
socket thread polls a non-blocking socket), so no rank waits in a receive it does not
expect to complete soon: after each idle sync the driver syncs again after an interval
both sides know (10 ms after the last work, doubling to `IDLE_MAX`), and a worker sleeps
until then before it receives. A request that arrives meanwhile is sent at once; the
worker takes it at its next wake-up (within the interval). A worker times each sleep from
when its last receive completed: when it woke early that is when the driver's message
arrived, so it never drifts behind the driver (it would then make the driver wait), and
it spins at most the driver's lateness. Every `HEARTBEAT` seconds an idle sync asks for an
answer too, which the driver reads at its next sync (by then it has arrived: no wait), so
a dead or hung rank is found within `HEARTBEAT + timeout`, not at the next request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from typing import Any

import mlx.core as mx

from macinfer.distributed.group import DistContext, DistributedError
from macinfer.engine.profile import maybe

log = logging.getLogger("macinfer")

HEARTBEAT = 2.0  # seconds between round trips (acks) while idle
IDLE_FIRST, IDLE_MAX = 0.01, 0.25  # seconds between idle syncs: after the last work, doubling to the max


class StepInputs:
    """The driver's requests added / aborted since the last step, and the idle cadence
    (kept alike on every rank: a function of the syncs both sides saw)."""

    def __init__(self, ctx: DistContext):
        self.ctx, self.pending = ctx, []
        self.last = self.last_ack = time.monotonic()
        self.idle_syncs = 0  # syncs in a row with no inputs and nothing to run
        self.owed = False  # an idle heartbeat's answers, read at the next sync

    def record(self, event: tuple) -> None:
        if self.ctx.is_driver:
            self.pending.append(event)

    def sync(self, busy: bool, in_flight: bool) -> None:
        """Driver: send this step's inputs to the workers (they replay them in `run_worker`)
        and whether they answer: a round trip, except while a pipeline's step is in flight
        (its hidden state is on the way back ahead of any answer, and its arrival shows the
        ranks live) and on idle syncs between heartbeats; an idle heartbeat's answers are
        read at the next sync, before anything else comes from the workers."""
        if self.owed:
            self.ctx.ack()
            self.owed = False
        events, self.pending = self.pending, []
        now = time.monotonic()
        working = busy or bool(events)
        ack = not in_flight and (working or now - self.last_ack >= HEARTBEAT)
        self.ctx.broadcast((events, ack), "step inputs")
        if ack:
            self.last_ack = now
            if working:
                self.ctx.ack()
            else:
                self.owed = True
        self.last = now
        self.count(events, busy)

    def count(self, events: list, busy: bool) -> None:
        """After a sync, on every rank: `busy` (requests to run once `events` are applied)."""
        self.idle_syncs = 0 if events or busy else self.idle_syncs + 1

    def interval(self) -> float:
        """Seconds from one idle sync to the next (0: not idle, the next step follows at once)."""
        return min(IDLE_FIRST * 2 ** (self.idle_syncs - 1), IDLE_MAX) if self.idle_syncs else 0.0

    def wait(self) -> float:
        """Driver: seconds until the next idle sync is due."""
        return max(0.0, self.last + self.interval() - time.monotonic())

    def due(self) -> bool:
        return self.wait() == 0.0


def join(engine: Any, num_blocks: int, recurrent: bool) -> dict:
    """At load, once the engine's parts are built: check every rank loaded the same model
    and settings, set the runner and the scheduler for the ranks, and return this rank's
    status (`/status`)."""
    ctx, cfg = engine.dist, engine.config
    check_same_model(ctx, {"config": engine.loaded.config, "engine": dataclasses.asdict(cfg), "blocks": num_blocks,
                           "vocab": engine.model.args.vocab_size, "mlx": mx.__version__})
    status = rank_report(ctx, engine.model, engine.kv_cache.nbytes)
    engine.runner.dist, engine.runner.micro_batches = ctx, max(1, cfg.pipeline_micro_batches)
    if ctx.mode == "pipeline" and cfg.pipeline_micro_batches == 1:
        if recurrent and cfg.pipeline_depth == 2:  # a step's plan updates the state
            raise ValueError("--pipeline-depth 2: this model has recurrent state, which runs one "
                             "step at a time; use --pipeline-depth 1 (its default)")
        engine.scheduler.depth = cfg.pipeline_depth or (1 if recurrent else 2)
    status["steps_in_flight"] = engine.scheduler.depth
    log.info("%s: %d step(s) in flight", ctx.describe(), engine.scheduler.depth)
    return status


def run_worker(engine: Any) -> None:
    """A worker's life: replay the driver's inputs and run each step, until it shuts down.
    Idle, it sleeps until the driver's next sync is due before it receives (see above)."""
    ctx, inputs = engine.dist, engine._inputs
    arrived = time.monotonic()
    while True:
        if inputs.interval():
            time.sleep(max(0.0, arrived + inputs.interval() - time.monotonic()))
        payload = ctx.broadcast(None, "step inputs")
        arrived = time.monotonic()
        if payload is None:  # the driver is closing
            return
        events, ack = payload
        if ack:  # (as the driver's `sync`)
            ctx.ack()
        for kind, *args in events:
            if kind == "add":
                ids, params, rid, salt, images = args
                engine.add_request(ids, params, rid, cache_salt=salt, images=images)
            else:
                engine.abort_request(args[0])
        inputs.count(events, engine.has_unfinished_requests())
        with ctx.watch("step"):
            engine.run_step()


def pipelined_step(engine: Any) -> list:
    """One step of a pipeline with two steps in flight (`EngineConfig.pipeline_depth`).

    Step k is scheduled without step k-1's sequences (still in flight), then step k-1 is
    finished: on the driver its forward is evaluated only now, after step k is built, and
    its tokens are sampled and sent; a worker has already run step k's stage by then. So
    while the driver runs the last layers of step k-1, the first stage runs step k: the
    bubble is filled. Every rank schedules step k before taking step k-1's tokens, so
    the plans agree without being shipped. When nothing could go in behind step k-1 (one
    stream), the next step goes in once its tokens are taken, in the same call, not a call
    later. Returns step k-1's outputs."""
    submitted, failed = _submit(engine)
    prev, engine._in_flight = engine._in_flight, submitted
    if prev is None:
        return failed
    sched, runner = engine.scheduler, engine.runner
    results, errors = runner.finish(prev)
    sched.in_flight.difference_update(seq for seq, _ in prev.scheduled)
    # A sequence aborted while its step was in flight has ended: its tokens are dropped.
    results = [r for r in results if not r.seq.is_finished]
    errors = [(seq, e) for seq, e in errors if not seq.is_finished]
    with maybe(runner.profile, "outputs"):
        outputs = failed + engine.output.process(prev, results, errors)  # (a step's outputs need its `scheduled` only)
    if submitted is None:
        engine._in_flight, failed = _submit(engine)
        outputs += failed
    return outputs


def _submit(engine: Any) -> tuple[Any, list]:
    """Schedule a step, encode the images it reaches and put it in flight: (the step, None
    when there is nothing to run; the outputs of requests whose image failed)."""
    from macinfer.engine import images

    sched, runner = engine.scheduler, engine.runner
    with maybe(runner.profile, "schedule"):
        plan = sched.schedule()
    if not plan:
        return None, []
    failed = images.encode_step(engine.vision.encoder, plan.scheduled, engine.output.fail) \
        if engine.vision is not None else []
    if not plan.scheduled:
        return None, failed
    engine._count(plan)
    submitted = runner.submit(plan.scheduled)
    sched.in_flight.update(seq for seq, _ in plan.scheduled)
    engine.overlapped_steps += engine._in_flight is not None
    return submitted, failed


def shutdown(ctx: DistContext) -> None:
    """Driver: let the workers return from `run_worker`."""
    if ctx.is_driver:
        ctx.broadcast(None, "shutdown")


def agree_on_blocks(ctx: DistContext, num_blocks: int) -> int:
    """Every rank's pool must hold every block the shared plan hands out: the smallest."""
    return min(ctx.gather(num_blocks, "KV pool sizes"))


def check_same_model(ctx: DistContext, what: dict) -> None:
    """Start-up: every rank loaded the same model with the same engine settings."""
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    digests = ctx.gather(digest, "start-up check")
    if len(set(digests)) > 1:
        raise DistributedError(f"the ranks loaded different models or settings (fingerprints by rank: "
                               f"{', '.join(digests)}); give every rank the same model and flags")


def share_samples(ctx: DistContext, token_ids: list, logprobs: list, failed: dict, owners: list) -> tuple:
    """The driver's sampled tokens (and per-request sampling failures) on every rank."""
    payload = (token_ids, logprobs, {s.request_id: f"{type(e).__name__}: {e}" for s, e in failed.items()}) \
        if ctx.is_driver else None
    token_ids, logprobs, errors = ctx.broadcast(payload, "sampled tokens")
    if not ctx.is_driver:
        failed = {s: RuntimeError(errors[s.request_id]) for s in set(owners) if s.request_id in errors}
    return token_ids, logprobs, failed


def rank_report(ctx: DistContext, model: Any, kv_bytes: int) -> dict:
    """What each rank holds (its plan, weights and KV pool bytes), gathered at start-up:
    logged by every rank for itself, and `/status` shows all of them."""
    from mlx.utils import tree_flatten

    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    mine = {"rank": ctx.rank, "plan": getattr(model, "distributed_plan", ""), "weights_bytes": weights,
            "kv_bytes": kv_bytes, "active_memory_bytes": mx.get_active_memory(),
            "peak_memory_bytes": mx.get_peak_memory()}
    log.info("rank %d of %d: weights %.2f GiB, KV pool %.2f GiB", ctx.rank, ctx.size, weights / 2**30,
             kv_bytes / 2**30)
    return {"mode": ctx.mode, "ranks": ctx.gather(mine, "rank report")}
