#!/usr/bin/env python
"""Quality of the int8 KV cache on a real model: logits vs the full-precision cache.

For each prompt, greedy-decodes --tokens tokens with the full-precision cache,
then scores prompt + continuation (prefill, then one decode step per token)
with both caches and compares the logits at every generated position.

    python scripts/kv_quality.py            # bundled SmolLM2 Q4_1
"""

from __future__ import annotations

import argparse

import numpy as np

PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):", "Photosynthesis is the process",
           "Once upon a time, in a quiet village,", "The three laws of thermodynamics are"]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()

    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.sampling_params import SamplingParams

    full = LLMEngine(args.model, EngineConfig(kv_cache_gb=0.2, max_model_len=2048))
    int8 = LLMEngine(full.loaded, EngineConfig(kv_cache_gb=0.2, max_model_len=2048, kv_cache_dtype="int8"))
    diffs, kls, agree = [], [], []
    for prompt in PROMPTS:
        ids = full.tokenizer.encode(prompt)
        rid = full.add_request(ids, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
        out = None
        while out is None:
            out = next((o for o in full.step() if o.request_id == rid and o.finished), None)
        tokens = ids + out.token_ids
        chunks = [len(ids)] + [1] * (len(out.token_ids) - 1)
        a = full.score([tokens[:-1]], chunks)[0][len(ids) - 1:]
        b = int8.score([tokens[:-1]], chunks)[0][len(ids) - 1:]
        diffs.append(np.abs(a - b).max())
        pa, pb = log_softmax(a), log_softmax(b)
        kls.append(float((np.exp(pa) * (pa - pb)).sum(-1).mean()))
        agree.append(float((a.argmax(-1) == b.argmax(-1)).mean()))
    print(f"model {args.model}; {len(PROMPTS)} prompts x {args.tokens} generated positions; "
          f"KV pool bytes/token: full {full.kv_cache.nbytes // (full.kv_cache.num_blocks * 16)}, "
          f"int8 {int8.kv_cache.nbytes // (int8.kv_cache.num_blocks * 16)}")
    print(f"max |logit diff| {max(diffs):.4f}; mean KL(full || int8) {np.mean(kls):.2e}; "
          f"greedy top-1 agreement {100 * np.mean(agree):.1f}%")


if __name__ == "__main__":
    main()
