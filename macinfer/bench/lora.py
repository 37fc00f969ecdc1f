"""`macinfer bench lora`: many adapters in one batch. N concurrent requests spread over K
adapters against the same N on the base model alone (the cost of the gathered low-rank
updates), and against mlx-lm serving the K adapters one after another (its server takes one
`--adapter-path`: load the adapter, fuse it, run its requests with `batch_generate`, next).
Each run in a fresh process, interleaved, repeated; the same weights for both engines
(`same_weights_dir`); the adapters are made with mlx-lm's own LoRA layers (random factors)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from macinfer.bench.common import energy, hardware, same_weights_dir, versions


def make_adapters(model_dir: str, out: str, count: int, rank: int) -> list[str]:
    """`count` adapters of every linear layer of every block, as `mlx_lm.lora` saves them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(model_dir)
    model.freeze()
    params = {"rank": rank, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, -1, params)
    paths = []
    for i in range(count):
        mx.random.seed(100 + i)
        leaves = {k: (0.02 * mx.random.normal(v.shape) if k.endswith("lora_b") else v)
                  for k, v in tree_flatten(model.trainable_parameters())}
        path = os.path.join(out, f"adapter-{i}")
        os.makedirs(path, exist_ok=True)
        mx.save_safetensors(os.path.join(path, "adapters.safetensors"), leaves)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": params}, f)
        paths.append(path)
    return paths


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def _worker(kind: str, model_dir: str, adapters: list[str], requests: int, input_len: int,
            output_len: int) -> dict[str, Any]:
    if kind == "mlx-lm":
        return _worker_mlx_lm(model_dir, adapters, requests, input_len, output_len)
    from macinfer import LLM
    from macinfer.sampling_params import SamplingParams

    llm = LLM(model_dir, max_num_seqs=max(requests, 8), kv_cache_gb=1.0, max_loras=max(len(adapters), 1))
    vocab = llm.engine.model.args.vocab_size
    names = [None] * requests
    if kind == "macinfer-lora":
        for i, path in enumerate(adapters):
            llm.load_lora(f"a{i}", path)
        names = [f"a{i % len(adapters)}" for i in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(_prompts(2, input_len, vocab), params, lora=names[:2])  # warm-up
    prompts = _prompts(requests, input_len, vocab)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=names)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "adapter_bytes": llm.engine.loras.nbytes}


def _worker_mlx_lm(model_dir: str, adapters: list[str], requests: int, input_len: int,
                   output_len: int) -> dict[str, Any]:
    from mlx.utils import tree_unflatten
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    model, tok = load(model_dir)
    vocab = model.args.vocab_size if hasattr(model.args, "vocab_size") else 32000
    batch_generate(model, tok, _prompts(2, input_len, vocab), max_tokens=output_len)  # warm-up
    prompts = _prompts(requests, input_len, vocab)
    per = [prompts[i::len(adapters)] for i in range(len(adapters))]
    start, tokens, generating = time.perf_counter(), 0, 0.0
    for path, group in zip(adapters, per):
        model, tok = load(model_dir, adapter_path=path)  # what switching adapters costs its server
        fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
        model.update_modules(tree_unflatten(fused))
        t = time.perf_counter()
        res = batch_generate(model, tok, group, max_tokens=output_len)
        generating += time.perf_counter() - t
        tokens += int(res.stats.generation_tokens)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "generation_s": generating}


def run(model: str = "smollm2", adapters: int = 8, requests: int = 32, input_len: int = 64, output_len: int = 64,
        rank: int = 8, repeats: int = 3, tick=None) -> dict[str, Any]:
    model_dir, weights = same_weights_dir(model)
    paths = make_adapters(model_dir, tempfile.mkdtemp(prefix="macinfer-bench-lora-"), adapters, rank)
    kinds = ["macinfer-base", "macinfer-lora", "mlx-lm"]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(repeats):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            cmd = [sys.executable, "-m", "macinfer.bench.lora", kind, model_dir, json.dumps(paths), str(requests),
                   str(input_len), str(output_len)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{kind} failed:\n{out.stderr[-3000:]}")
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
            if tick:
                tick(f"{kind} {r + 1}/{repeats}")

    def med(kind: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[kind])

    vs_base = [lo["tok_s"] / b["tok_s"] for lo, b in zip(runs["macinfer-lora"], runs["macinfer-base"])]
    vs_mlx = [lo["tok_s"] / m["tok_s"] for lo, m in zip(runs["macinfer-lora"], runs["mlx-lm"])]
    return {"mode": "lora", "context": {**versions(), "hardware": hardware(), "energy": energy(), "model": model,
                                        "weights": weights,
                                        "adapters": adapters, "rank": rank, "requests": requests,
                                        "input_len": input_len, "output_len": output_len, "repeats": repeats,
                                        "adapted": "every linear layer of every block"},
            "runs": runs, "tok_s": {k: med(k, "tok_s") for k in kinds},
            "ratio_vs_base": statistics.median(vs_base), "ratio_vs_base_each": vs_base,
            "ratio_vs_mlx_lm": statistics.median(vs_mlx), "ratio_vs_mlx_lm_each": vs_mlx,
            "bytes_per_adapter": runs["macinfer-lora"][0]["adapter_bytes"] / adapters}


def table(results: dict[str, Any]) -> str:
    c = results["context"]
    lines = [f"{c['requests']} requests ({c['input_len']} prompt + {c['output_len']} new tokens, greedy), "
             f"{c['adapters']} rank-{c['rank']} adapters of {c['adapted']}; {c['weights']}"]
    for kind, tps in results["tok_s"].items():
        lines.append(f"{kind:>14}: {tps:8.1f} tok/s (median of {c['repeats']})")
    lines.append(f"adapters / base: {results['ratio_vs_base']:.2f}x "
                 f"({', '.join(f'{x:.2f}' for x in results['ratio_vs_base_each'])}; goal >= 0.85)")
    lines.append(f"adapters / mlx-lm one adapter at a time: {results['ratio_vs_mlx_lm']:.2f}x "
                 f"({', '.join(f'{x:.2f}' for x in results['ratio_vs_mlx_lm_each'])}; goal >= 3)")
    lines.append(f"memory per adapter: {results['bytes_per_adapter'] / 2**20:.2f} MiB")
    return "\n".join(lines)


if __name__ == "__main__":
    kind, model_dir, paths, n, ilen, olen = sys.argv[1:7]
    print(json.dumps(_worker(kind, model_dir, json.loads(paths), int(n), int(ilen), int(olen))))
