"""One engine configuration running batches to the end, for the benchmarks that compare
configurations each in a process of its own (`bench draft`, `scripts/bench_kv_quant.py`):
decode tok/s from the step every request has its first token, and the speculation counters."""

from __future__ import annotations

import time


class MacinferBatch:
    """The engine (`EngineConfig(**engine)`) running a batch of requests to the end, in a
    process of its own (`isolated.py`)."""

    def __init__(self, model_dir: str, engine: dict):
        from macinfer.engine.llm_engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(model_dir, EngineConfig(**engine))

    def run(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0) -> dict:
        from macinfer.sampling_params import SamplingParams

        e = self.engine
        before = dict(e.stats)
        start = time.perf_counter()
        ids = [e.add_request(p, SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens))
               for i, p in enumerate(prompts)]
        done, first = {}, {}
        while e.has_unfinished_requests():
            outs = e.step()
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, (now, len(o.token_ids)))
                if o.finished:
                    done[o.request_id] = o
        end = time.perf_counter()
        tokens = [done[i].token_ids for i in ids]
        # Decode: from the step every request had its first token (all prompts prefilled) on.
        start_decode = max(t for t, _ in first.values())
        verify = e.stats["spec_verify_steps"] - before["spec_verify_steps"]
        accepted = e.stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        drafted = e.stats["spec_draft_tokens"] - before["spec_draft_tokens"]
        return {"tokens": tokens, "seconds": end - start, "decode_seconds": end - start_decode,
                "decode_tokens": sum(len(t) for t in tokens) - sum(n for _, n in first.values()),
                "verify_steps": verify, "accepted": accepted, "drafted": drafted}
