"""Speculative decoding with a draft model: greedy decode of chat prompts at batch 1, 4
and 16, with and without the draft, against mlx-lm's `speculative_generate_step` (its
one-stream path: mlx-lm's server switches batching off with a draft) on the same weights.

Each engine runs in a process of its own (`isolated.py`) and they take turns, so a drift
in the machine's speed hits all alike. Every run is greedy, so each engine's tokens are
checked to be the plain engine's. Where no smaller model of the same tokenizer is at
hand, `--draft-layers N` makes one from the target: its first N layers with its own
final norm and head (a self-speculative, early-exit draft, as LayerSkip drafts), on the
same float weights mlx-lm gets.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Callable

from macinfer.bench.common import energy, hardware, quantized_draft, same_weights_dir, versions
from macinfer.bench.isolated import Isolated
from macinfer.bench.spec import TASKS


def truncated_draft(model_dir: str, layers: int) -> str:
    """An MLX directory of the model in `model_dir` cut to its first `layers` layers."""
    import mlx.core as mx

    out = tempfile.mkdtemp(prefix=f"macinfer-draft-{layers}l-")
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if not 1 <= layers < config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers {layers}: the target has {config['num_hidden_layers']} layers; "
                         "take fewer")
    config["num_hidden_layers"] = layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    weights = {}
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if name.endswith(".safetensors"):
            weights.update(mx.load(path))
        elif not name.startswith("model") and os.path.isfile(path) and name != "config.json":
            with open(path, "rb") as src, open(os.path.join(out, name), "wb") as dst:
                dst.write(src.read())  # tokenizer files
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.")
            or int(k.split(".")[2]) < layers}
    mx.save_safetensors(os.path.join(out, "model.safetensors"), keep)
    return out


class MlxLmSpeculative:
    """mlx-lm's `speculative_generate_step` (one stream) on the same weights."""

    def __init__(self, model_dir: str, draft_dir: str):
        from mlx_lm import load

        self.model, _ = load(model_dir)
        self.draft, _ = load(draft_dir)

    def run(self, prompt: list[int], max_tokens: int, k: int, eos: list[int], temperature: float = 0.0) -> dict:
        import mlx.core as mx
        from mlx_lm.generate import speculative_generate_step
        from mlx_lm.sample_utils import make_sampler

        mx.random.seed(0)
        start, first, tokens, from_draft = time.perf_counter(), None, [], 0
        for tok, _, drafted in speculative_generate_step(mx.array(prompt), self.model, self.draft, num_draft_tokens=k,
                                                         max_tokens=max_tokens, sampler=make_sampler(temperature)):
            first = first or time.perf_counter()
            tokens.append(int(tok))
            from_draft += bool(drafted)
            if tokens[-1] in eos:
                break
        end = time.perf_counter()
        return {"tokens": tokens, "seconds": end - start, "decode_seconds": end - first,
                "decode_tokens": len(tokens) - 1, "from_draft": from_draft}


def run(model: str, draft: str | None, draft_layers: int, draft_bits: int | None = None, k: int = 4, batches: tuple[int, ...] = (1, 4, 16),
        max_tokens: int = 64, repeats: int = 2, temperature: float = 0.0,
        tick: Callable[[str], None] = lambda _: None) -> dict:
    from macinfer.loading.loader import load

    target_dir, weights = same_weights_dir(model)
    if draft:
        draft_dir, what = same_weights_dir(draft)[0], draft
    elif draft_bits:
        draft_dir, what = quantized_draft(target_dir, draft_bits), f"the target quantized to {draft_bits} bits"
    else:
        draft_dir, what = truncated_draft(target_dir, draft_layers), f"the target's first {draft_layers} layers"
    tok = load(target_dir).tokenizer
    texts = [t for name, t in TASKS.items() if name != "long code edit"]  # its 2k-token prefill
    prompts = [tok.encode_chat([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(max(batches))]
    results: dict = {"mode": "draft", "context": {
        "model": model, "mlx_lm_weights": weights, "draft": what,
        "num_speculative_tokens": k, "max_tokens": max_tokens, "repeats": repeats,
        "sampling": "greedy" if not temperature else f"temperature {temperature}, request i seeded i (macinfer); "
                    "mlx-lm's own sampler (its tokens differ)",
        "prompts": "bench spec's short tasks in the chat template, cycled; decode tok/s from the step every "
                   "request had its first token", "hardware": hardware(), "energy": energy(), **versions()},
        "batches": {}}
    base = {"max_num_seqs": max(batches), "kv_cache_gb": 0.5, "enable_prefix_caching": False}
    plain = Isolated("macinfer.bench.batch:MacinferBatch", target_dir, base, name="macinfer")
    spec = Isolated("macinfer.bench.batch:MacinferBatch", target_dir,
                    {**base, "num_speculative_tokens": k, "draft_model": draft_dir, "speculative_max_batch": max(batches)},
                    name="macinfer draft")
    lm = Isolated("macinfer.bench.draft:MlxLmSpeculative", target_dir, draft_dir, name="mlx-lm speculative")
    eos = list(tok.eos_token_ids)
    try:
        plain.run(prompts[:1], 4), spec.run(prompts[:1], 4), lm.run(prompts[0], 4, k, eos)  # warm-up
        t = temperature
        for b in batches:
            runs: dict[str, list] = {"macinfer": [], "macinfer + draft": []}
            if b == 1:
                runs["mlx-lm speculative"] = []
            for _ in range(repeats):
                runs["macinfer"].append(plain.run(prompts[:b], max_tokens, t))
                runs["macinfer + draft"].append(spec.run(prompts[:b], max_tokens, t))
                if b == 1:
                    runs["mlx-lm speculative"].append(lm.run(prompts[0], max_tokens, k, eos, t))
            want = runs["macinfer"][0]["tokens"]
            row = {}
            for name, rs in runs.items():
                got = [rs[0]["tokens"]] if name.startswith("mlx-lm") else rs[0]["tokens"]
                n = sum(len(t) for t in got)
                row[name] = {"output_tokens": n, "same_tokens": got == want[: len(got)],
                             "decode_tok_s": statistics.median(r["decode_tokens"] / r["decode_seconds"] for r in rs)}
            s = runs["macinfer + draft"][0]
            row["macinfer + draft"].update(
                acceptance=s["accepted"] / s["drafted"] if s["drafted"] else 0.0,
                tokens_per_target_forward=(s["accepted"] + s["verify_steps"]) / s["verify_steps"]
                if s["verify_steps"] else 1.0)
            for name in row:
                row[name]["vs_macinfer"] = row[name]["decode_tok_s"] / row["macinfer"]["decode_tok_s"]
            results["batches"][str(b)] = row
            tick(f"batch {b}")
    finally:
        for p in (plain, spec, lm):
            p.close()
    return results


def table(results: dict) -> str:
    c = results["context"]
    lines = [f"{c['sampling']}: decode tok/s, {c['max_tokens']} new tokens a request, k={c['num_speculative_tokens']}, "
             f"draft: {c['draft']} (ratio to macinfer without a draft; * tokens differ)",
             f"{'batch':>5}{'macinfer':>20}{'macinfer + draft':>22}{'mlx-lm speculative':>22}{'accepted':>10}"
             f"{'tok/fwd':>9}"]
    for b, row in results["batches"].items():
        cells = ""
        for name in ("macinfer", "macinfer + draft", "mlx-lm speculative"):
            r = row.get(name)
            if r is None:
                cells += f"{'-':>22}"
                continue
            cell = f"{r['decode_tok_s']:.1f} ({r['vs_macinfer']:.2f}x)" + ("" if r["same_tokens"] else "*")
            cells += f"{cell:>22}"
        d = row["macinfer + draft"]
        lines.append(f"{b:>5}{cells[2:]}{d['acceptance']:>10.0%}{d['tokens_per_target_forward']:>9.2f}")
    return "\n".join(lines)
