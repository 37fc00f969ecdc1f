#!/usr/bin/env python
"""Engine benchmark: macinfer vs mlx-lm on the same weights, in the same run.

Measures single-stream decode tok/s, prefill tok/s and offline throughput at
several concurrency levels; prints a table with ratios and writes JSON.
Random token prompts (fixed seed) with EOS ignored, so every engine does
exactly the same amount of work. Medians over --repeats.

    python scripts/bench_engine.py                     # bundled SmolLM2 Q4_1
    python scripts/bench_engine.py --model DIR_OR_GGUF --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np


def hardware() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "mlx_device": str(mx.default_device()), "metal": mx.metal.is_available(),
            "blas_preload": os.environ.get("LD_PRELOAD", "")}
    try:
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return info


def save_results(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")


def peak_memory_gb() -> float:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if platform.system() == "Linux" else rss / 2**30


# -- macinfer -------------------------------------------------------------------
class Macinfer:
    name = "macinfer"

    def __init__(self, model: str, max_num_seqs: int, kv_cache_gb: float):
        from macinfer.engine.llm_engine import EngineConfig, LLMEngine

        # Prefix caching off: repeats reuse prompts, and this measures raw compute
        # (scripts/bench_prefix.py measures the cache).
        self.engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, kv_cache_gb=kv_cache_gb,
                                                    max_num_batched_tokens=2048, max_model_len=4096,
                                                    enable_prefix_caching=False,
                                                    model_impl=os.environ.get("MACINFER_MODEL_IMPL", "auto")))

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        """Returns (ttft of the first request, total seconds)."""
        from macinfer.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        for p in prompts:
            self.engine.add_request(p, params)
        ttft = None
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            if ttft is None and outs:
                ttft = time.perf_counter() - start
        return ttft, time.perf_counter() - start


# -- mlx-lm ------------------------------------------------------------------------
class MlxLm:
    name = "mlx-lm"

    def __init__(self, model_dir: str):
        from mlx_lm import load

        self.model, _ = load(model_dir)

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        from mlx_lm.generate import BatchGenerator, generate_step

        start = time.perf_counter()
        ttft = None
        if len(prompts) == 1:  # mlx-lm's own single-stream path
            for _ in generate_step(mx.array(prompts[0]), self.model, max_tokens=max_tokens,
                                   sampler=lambda x: mx.argmax(x, axis=-1)):
                if ttft is None:
                    ttft = time.perf_counter() - start
            return ttft, time.perf_counter() - start
        gen = BatchGenerator(self.model, stop_tokens=[])
        gen.insert(prompts, [max_tokens] * len(prompts))
        while responses := gen.next_generated():
            if ttft is None and responses:
                ttft = time.perf_counter() - start
        gen.close()
        return ttft, time.perf_counter() - start


def measure(engine, prompts, max_tokens, repeats) -> dict:
    runs = [engine.run(prompts, max_tokens) for _ in range(repeats)]
    ttfts, totals = [r[0] for r in runs], [r[1] for r in runs]
    return {"ttft_s": statistics.median(ttfts), "total_s": statistics.median(totals),
            "all_total_s": totals, "all_ttft_s": ttfts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or MLX directory (default: bundled SmolLM2 Q4_1)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--batch-gen-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--out", default="bench_results/bench_engine.json")
    ap.add_argument("--engines", nargs="+", default=["macinfer", "mlx-lm"])
    args = ap.parse_args()

    import macinfer
    import mlx_lm
    from macinfer.convert import convert_gguf
    from macinfer.loader import bundled_test_model

    model = args.model or bundled_test_model()
    mlx_dir = model
    if model.endswith(".gguf"):
        mlx_dir = convert_gguf(model, tempfile.mkdtemp(prefix="macinfer-bench-"))
    engines = []
    if "macinfer" in args.engines:
        engines.append(Macinfer(model, max(args.concurrency), args.kv_cache_gb))
    if "mlx-lm" in args.engines:
        engines.append(MlxLm(mlx_dir))
    with open(os.path.join(mlx_dir, "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg["vocab_size"]
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(100, vocab - 100, size=n).tolist()  # noqa: E731

    results: dict = {"context": {
        "model": os.path.basename(model), "model_type": cfg["model_type"],
        "quantization": cfg.get("quantization"), "macinfer": macinfer.__version__,
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "hardware": hardware(),
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "prefill_len": args.prefill_len,
        "batch_gen_len": args.batch_gen_len, "repeats": args.repeats, "sampling": "greedy, EOS ignored",
    }, "engines": {}}

    for e in engines:
        r: dict = {}
        e.run([prompt(8)], 4)  # warm-up
        m = measure(e, [prompt(args.prompt_len)], args.gen_len, args.repeats)
        r["decode_tok_s"] = (args.gen_len - 1) / (m["total_s"] - m["ttft_s"])
        r["decode_tpot_ms"] = 1000 * (m["total_s"] - m["ttft_s"]) / (args.gen_len - 1)
        m = measure(e, [prompt(args.prefill_len)], 1, args.repeats)
        r["prefill_tok_s"] = args.prefill_len / m["ttft_s"]
        r["prefill_ttft_s"] = m["ttft_s"]
        for c in args.concurrency:
            m = measure(e, [prompt(args.prompt_len) for _ in range(c)], args.batch_gen_len, args.repeats)
            r[f"throughput_c{c}_tok_s"] = c * args.batch_gen_len / m["total_s"]
        r["peak_rss_gb"] = peak_memory_gb()
        results["engines"][e.name] = r
        print(f"done: {e.name}", flush=True)

    names = list(results["engines"])
    metrics = list(results["engines"][names[0]])
    header = f"{'metric':<24}" + "".join(f"{n:>14}" for n in names)
    if len(names) == 2:
        header += f"{'ratio':>10}"
    print("\n" + header)
    for k in metrics:
        vals = [results["engines"][n][k] for n in names]
        line = f"{k:<24}" + "".join(f"{v:>14.2f}" for v in vals)
        if len(names) == 2 and vals[1]:
            line += f"{vals[0] / vals[1]:>10.2f}"
        print(line)
    print("(ratio = macinfer / mlx-lm; peak_rss is the whole process, both engines loaded)")
    ctx = results["context"]
    print(f"model {ctx['model']} ({ctx['model_type']}, {ctx['quantization']}); macinfer {ctx['macinfer']}, "
          f"mlx {ctx['mlx']}, mlx-lm {ctx['mlx_lm']}; {ctx['hardware']['cpu']} x{ctx['hardware']['cores']}, "
          f"device {ctx['hardware']['mlx_device']}")
    save_results(results, args.out)


if __name__ == "__main__":
    main()
