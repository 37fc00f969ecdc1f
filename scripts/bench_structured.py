#!/usr/bin/env python
"""Cost of constrained decoding inside the batch: N concurrent requests with none
constrained, then with a fraction of them held to a JSON schema (llguidance
masks). Reports aggregate tok/s (medians over repeats) and the host time spent
computing masks per step. Greedy, same prompts; unconstrained rows ignore EOS so
they run to max_tokens.

    python scripts/bench_structured.py                    # bundled SmolLM2, 16 streams, half constrained
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from macinfer.bench.common import hardware, versions
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.structured import json_schema_grammar
from macinfer.loading.loader import bundled_test_model
from macinfer.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "summary": {"type": "string", "maxLength": 160}},
    "required": ["title", "tags", "rating", "summary"], "additionalProperties": False}


def run(engine: LLMEngine, prompts, grammar, fraction: float, max_tokens: int) -> dict:
    s = engine.structured
    calls, spent = [], []
    original = s.bitmask

    def timed(seqs):
        t = time.perf_counter()
        out = original(seqs)
        if out is not None:
            spent.append(time.perf_counter() - t)
        return out

    s.bitmask = timed
    n_constrained = round(len(prompts) * fraction)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        constrained = i < n_constrained
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not constrained,
                                             grammar=grammar if constrained else None))
    tokens, steps = 0, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        tokens += sum(len(o.delta_token_ids) for o in outs)
    wall = time.perf_counter() - start
    s.bitmask = original
    calls = spent
    return {"tok_s": tokens / wall, "tokens": tokens, "steps": steps, "wall_s": wall,
            "mask_ms_per_masked_step": 1000 * statistics.fmean(calls) if calls else 0.0, "masked_steps": len(calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = args.model or bundled_test_model()
    engine = LLMEngine(model, EngineConfig(kv_cache_gb=0.5, max_num_seqs=args.streams, enable_prefix_caching=False))
    asks = ["Review the movie Inception.", "Review a pizza place in Naples.", "Review the book Dune.",
            "Review a hiking trail in the Alps."]
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": f"{asks[i % 4]} Answer in JSON."}])
               for i in range(args.streams)]
    grammar = json_schema_grammar(SCHEMA)
    engine.structured.ll_tokenizer  # noqa: B018  built once, outside the timings
    run(engine, prompts[:2], grammar, 0.5, 8)  # warm-up
    results = {}
    for label, fraction in (("none", 0.0), (f"{args.fraction:g} constrained", args.fraction)):
        runs = [run(engine, prompts, grammar, fraction, args.max_tokens) for _ in range(args.repeats)]
        results[label] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(json.dumps({"model": model, **versions(), "hardware": hardware()["chip"], "streams": args.streams,
                      "max_tokens": args.max_tokens, "schema": SCHEMA, "results": results}, indent=2))
    for label, r in results.items():
        print(f"{label:<18} {r['tok_s']:7.1f} tok/s  ({r['tokens']:.0f} tokens, {r['steps']:.0f} steps); "
              f"mask {r['mask_ms_per_masked_step']:.2f} ms per masked step")


if __name__ == "__main__":
    main()
