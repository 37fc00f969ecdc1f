#!/usr/bin/env python
"""Prompt-lookup speculation on recurrent state: what a rejected draft costs.

On the `scripts/bench_hybrid.py` models (same random weights), 64 greedy tokens from a
32-token prompt, k=4 drafts from an oracle (the true continuation, so acceptance is set
by the experiment, not by the text): no speculation, every draft accepted, and the last
draft of every step rejected (the state is restored and the accepted tokens computed
again with the next one: `ModelRunner.step`). Medians of 3; every run's tokens are
checked equal to the run without speculation.

    python scripts/spec_recurrent.py [qwen3_next] [mamba2]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(family: str) -> str:
    from macinfer.engine import scheduler
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.sampling_params import SamplingParams
    from scripts.bench_hybrid import model_dir
    from tests.helpers import generate

    path = model_dir(family)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = list(range(100, 132))
    base = LLMEngine(path, EngineConfig(enable_prefix_caching=False, kv_cache_gb=0.5))
    want = generate(base, [prompt], params)[0].token_ids
    mode = {"reject_last": False}

    def oracle(seq, k, min_n, max_n):
        drafts = list(want[seq.num_output_tokens : seq.num_output_tokens + k])
        if mode["reject_last"] and len(drafts) > 1:
            drafts[-1] = 3 + (drafts[-1] + 1) % 290
        return drafts

    original = scheduler.propose
    scheduler.propose = oracle
    try:
        spec = LLMEngine(path, EngineConfig(enable_prefix_caching=False, kv_cache_gb=0.5, num_speculative_tokens=4))

        def timed(engine) -> float:
            runs = []
            for _ in range(3):
                start = time.perf_counter()
                assert generate(engine, [prompt], params)[0].token_ids == want
                runs.append(time.perf_counter() - start)
            return statistics.median(runs)

        plain, accepted = timed(base), timed(spec)
        mode["reject_last"] = True
        rejected = timed(spec)
    finally:
        scheduler.propose = original
    return (f"{family}: 64 tokens, no speculation {plain:.2f} s; k=4 all accepted {accepted:.2f} s "
            f"({plain / accepted:.2f}x); last draft rejected each step {rejected:.2f} s ({plain / rejected:.2f}x)")


if __name__ == "__main__":
    names = sys.argv[1:] or ["qwen3_next", "mamba2"]
    if len(names) == 1:
        print(run(names[0]), flush=True)
    else:  # one process a family: a second model in the same process measured 2-3x slower here
        import subprocess

        for name in names:
            subprocess.run([sys.executable, __file__, name], check=True)
