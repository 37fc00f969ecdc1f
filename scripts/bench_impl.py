#!/usr/bin/env python
"""The same model on the engine's two model paths: the hand-written graph (`models/llama.py`:
fused q/k/v and gate/up matmuls, compiled SwiGLU, RoPE tables shared by the layers) and
mlx-lm's own classes through the paged adapter (`models/mlx_lm_adapter.py`, the path every
other family, vision language models included, runs on). Random weights, a Llama-family
shape (default: Qwen2, hidden 512 x 8 layers, as `scripts/bench_vision.py`'s language model).

    python scripts/bench_impl.py [--family qwen2] [--hidden 512] [--layers 8] [-c 8] [--repeats 2]

Reported per path (alternating, each in this process in turn): throughput of c requests of
--prompt-len tokens generating --gen-len each, and the decode step (that run's time less a
prefill-and-one-token run of the same prompts, over the remaining steps)."""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2", choices=["llama", "qwen2", "qwen3", "mistral"])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("-c", "--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

    import mlx.core as mx

    from macinfer import LLM
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import tiny_model_dir

    path, _ = tiny_model_dir(pathlib.Path(tempfile.mkdtemp()), a.family, tie=False, hidden_size=a.hidden,
                             num_hidden_layers=a.layers, intermediate_size=4 * a.hidden,
                             num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 256),
                             vocab_size=32000)
    gen = SamplingParams(temperature=0, max_tokens=a.gen_len, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    results: dict[str, list[tuple[float, float]]] = {"auto": [], "mlx-lm": []}
    for r in range(a.repeats):
        for impl in (("auto", "mlx-lm") if r % 2 == 0 else ("mlx-lm", "auto")):
            llm = LLM(path, model_impl=impl, max_num_seqs=a.concurrency, kv_cache_gb=0.2, max_model_len=2048,
                      enable_prefix_caching=False)
            prompts = [[5 + (i * 7 + j) % 30000 for j in range(a.prompt_len)] for i in range(a.concurrency)]
            llm.generate(prompts, SamplingParams(max_tokens=2))  # warm up
            start = time.perf_counter()
            llm.generate(prompts, gen)
            whole = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate(prompts, one)
            first = time.perf_counter() - start
            results[impl].append((a.concurrency * a.gen_len / whole, (whole - first) / (a.gen_len - 1) * 1000))
            llm.close()
    print(f"{a.family} hidden {a.hidden} x {a.layers} layers, float32, {a.concurrency} x {a.prompt_len}-token prompts, "
          f"{a.gen_len} new tokens; {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
          f"MLX {mx.__version__} ({mx.default_device()}); {a.repeats} alternating repeats")
    for impl, name in (("auto", "hand-written graph"), ("mlx-lm", "mlx-lm classes (adapter)")):
        tps, step = [x[0] for x in results[impl]], [x[1] for x in results[impl]]
        print(f"  {name:26s} {statistics.median(tps):7.1f} tok/s ({min(tps):.1f}-{max(tps):.1f}), "
              f"decode step {statistics.median(step):.1f} ms ({min(step):.1f}-{max(step):.1f})")


if __name__ == "__main__":
    main()
