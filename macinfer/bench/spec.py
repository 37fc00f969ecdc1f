"""Single-stream decode on chat tasks, with and without prompt-lookup speculation,
against mlx-lm's own generation on the same weights: one process, one run.

Greedy, ending at EOS or `max_tokens`, so every engine produces the same tokens
(checked and reported) and the comparison is work for work. Tasks span what
speculation helps (answers that repeat their input: code edits, extraction,
reformatting) and what it does not (free writing), so the cost of rejected
drafts shows too. Medians over repeats.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import mlx.core as mx

from macinfer.bench.common import energy, hardware, process_peak_rss_gb, quantized_draft, same_weights_dir, versions
from macinfer.bench.isolated import Isolated

_CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total = total + x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    total = 0
    for x in xs:
        total = total + (x - m) * (x - m)
    return total / len(xs)
'''

_TEXT = ("The river rose for three days. On the first day the farmers moved their animals to the hill. "
         "On the second day the school closed and the children helped fill sandbags along the bank. "
         "On the third day the water stopped one street short of the market, and the town held a dinner "
         "in the square to thank the volunteers.")

# A long file (~2k tokens of context): the verify step's cost grows with context.
_LONG_CODE = "\n\n".join(
    f"def scale_{i}(xs, factor={i + 2}):\n    out = []\n    for x in xs:\n        out.append(x * factor)\n    return out"
    for i in range(40)) + "\n"

TASKS = {
    "code edit": f"Add a docstring to each function below. Return the complete code.\n\n```python\n{_CODE}```",
    "long code edit": "Rename every function below from scale_N to multiply_N and return the complete code."
                      f"\n\n```python\n{_LONG_CODE}```",
    "extract": f"Copy the sentence about the school from this text, word for word:\n\n{_TEXT}",
    "reformat": "Turn this list into a JSON array of objects with keys name and city:\n"
                "Ana - Lisbon\nBen - Leeds\nChloe - Lyon\nDev - Pune\nEmi - Osaka\nFinn - Oslo",
    "free writing": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "JSON schema": "List five famous scientists with their field and birth year.",
}
# Tasks held to a JSON schema (response_format): macinfer only, mlx-lm has no grammar support.
SCHEMAS = {
    "JSON schema": {"type": "object", "properties": {"scientists": {"type": "array", "minItems": 5, "maxItems": 5,
                    "items": {"type": "object", "properties": {
                        "name": {"type": "string"}, "field": {"type": "string"}, "birth_year": {"type": "integer"}},
                        "required": ["name", "field", "birth_year"], "additionalProperties": False}}},
                    "required": ["scientists"], "additionalProperties": False},
}


def _macinfer(engine, prompt: list[int], max_tokens: int, grammar: str | None = None) -> tuple[list[int], float, float]:
    """(tokens, ttft, total seconds) of one greedy request run alone."""
    from macinfer.sampling_params import SamplingParams

    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, grammar=grammar))
    ttft, out = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            ttft = ttft or time.perf_counter() - start
            if o.request_id == rid and o.finished:
                out = o
    return out.token_ids, ttft, time.perf_counter() - start


class MlxLmGreedy:
    """mlx-lm's own single-stream generation (run in its own process: `isolated`)."""

    def __init__(self, model_dir: str):
        from mlx_lm import load

        self.model, _ = load(model_dir)

    def run(self, prompt: list[int], max_tokens: int, eos: set[int]) -> tuple[list[int], float, float]:
        return _mlx_lm(self.model, prompt, max_tokens, eos)


def _mlx_lm(model, prompt: list[int], max_tokens: int, eos: set[int]) -> tuple[list[int], float, float]:
    from mlx_lm.generate import generate_step

    start = time.perf_counter()
    tokens, ttft = [], None
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                sampler=lambda x: mx.argmax(x, axis=-1)):
        ttft = ttft or time.perf_counter() - start
        tokens.append(int(tok))  # macinfer's token_ids hold the EOS too
        if tokens[-1] in eos:
            break
    return tokens, ttft, time.perf_counter() - start


def run(model: str, vs: list[str], num_speculative_tokens: int = 4, max_tokens: int = 160, repeats: int = 3,
        tick: Callable[[str], None] = lambda _: None, draft: str | None = None, draft_bits: int | None = None) -> dict:
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.engine.structured import json_schema_grammar
    from macinfer.loading.loader import resolve

    base = dict(max_num_seqs=4, kv_cache_gb=0.5, enable_prefix_caching=False)  # the model's own context
    plain = LLMEngine(model, EngineConfig(**base))
    spec = LLMEngine(plain.loaded, EngineConfig(**base, num_speculative_tokens=num_speculative_tokens))
    tok = plain.tokenizer
    eos = set(tok.eos_token_ids)
    spec_name = f"macinfer spec k={num_speculative_tokens}"
    engines: dict[str, Callable] = {
        "macinfer": lambda p, g=None: _macinfer(plain, p, max_tokens, g),
        spec_name: lambda p, g=None: _macinfer(spec, p, max_tokens, g),
    }
    draft_what = None
    if draft or draft_bits:  # a draft model alone, and behind prompt lookup (--prompt-lookup-first)
        draft_dir = same_weights_dir(draft)[0] if draft else quantized_draft(same_weights_dir(model)[0], draft_bits)
        draft_what = draft or f"the target quantized to {draft_bits} bits"
        for first in (False, True):
            eng = LLMEngine(plain.loaded, EngineConfig(**base, num_speculative_tokens=num_speculative_tokens,
                                                       draft_model=draft_dir, prompt_lookup_first=first,
                                                       speculative_max_batch=1))
            name = f"macinfer {'lookup+' if first else ''}draft k={num_speculative_tokens}"
            engines[name] = lambda p, g=None, e=eng: _macinfer(e, p, max_tokens, g)
    weights = None
    if "mlx-lm" in vs:
        model_dir, weights = same_weights_dir(model)
        lm = Isolated("macinfer.bench.spec:MlxLmGreedy", model_dir, name="mlx-lm")
        engines["mlx-lm"] = lambda p, g=None: lm.run(p, max_tokens, eos)
    sc = spec.config
    results: dict = {"mode": "spec", "context": {
        "model": os.path.basename(resolve(model).rstrip("/")), "model_type": plain.loaded.config.get("model_type"),
        "quantization": plain.loaded.config.get("quantization"), "mlx_lm_weights": weights, **versions(),
        "macinfer_flags": {"num_speculative_tokens": num_speculative_tokens, "prompt_lookup_min": sc.prompt_lookup_min,
                           "prompt_lookup_max": sc.prompt_lookup_max, "prefix_caching": False,
                           "draft_model": draft_what},
        "hardware": hardware(), "energy": energy(),
        "workload": {"tasks": TASKS, "json_schemas": SCHEMAS, "max_tokens": max_tokens, "repeats": repeats, "concurrency": 1,
                     "sampling": "greedy, stops at EOS", "prompts": "the model's chat template, one user turn"},
    }, "tasks": {}, "skipped": {}}

    for f in engines.values():  # warm-up
        f(tok.encode("Hi"))
    for task, text in TASKS.items():
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        if len(prompt) + max_tokens > plain.max_model_len:
            results["skipped"][task] = f"prompt of {len(prompt)} tokens + {max_tokens} exceeds the context"
            tick(f"skipped {task}")
            continue
        grammar = json_schema_grammar(SCHEMAS[task]) if task in SCHEMAS else None
        names = [n for n in engines if grammar is None or n.startswith("macinfer")]
        runs: dict[str, list] = {name: [] for name in names}
        drafted = spec.stats["spec_draft_tokens"], spec.stats["spec_accepted_tokens"]
        for _ in range(repeats):  # engines interleaved, so drift in machine speed hits all alike
            for name in names:
                runs[name].append(engines[name](prompt, grammar))
        row: dict = {"prompt_tokens": len(prompt), "engines": {}}
        reference = runs["macinfer"][0][0]
        for name, rs in runs.items():
            tokens = rs[0][0]
            decode = statistics.median(total - ttft for _, ttft, total in rs)
            row["engines"][name] = {
                "output_tokens": len(tokens), "same_tokens": all(r[0] == reference for r in rs),
                "ttft_s": statistics.median(r[1] for r in rs),
                "decode_tok_s": (len(tokens) - 1) / decode if len(tokens) > 1 and decode > 0 else 0.0}
            tick(f"{name} {task}")
        d = spec.stats["spec_draft_tokens"] - drafted[0]
        a = spec.stats["spec_accepted_tokens"] - drafted[1]
        row["engines"][spec_name].update(draft_tokens=d // repeats, accepted_tokens=a // repeats,
                                         acceptance_rate=a / d if d else 0.0)
        results["tasks"][task] = row
    results["peak_rss_gb_process"] = process_peak_rss_gb()  # macinfer's engines share this process
    if "mlx-lm" in vs:
        results["peak_rss_gb_mlx_lm_process"] = lm.peak_rss_gb()
        lm.close()
    return results


def table(results: dict) -> str:
    tasks = results["tasks"]
    names = list(max((row["engines"] for row in tasks.values()), key=len))
    base = "mlx-lm" if "mlx-lm" in names else names[0]
    head = f"{'task':<14}{'tokens':>7}" + "".join(f"{n:>26}" for n in names) + f"{'accepted':>10}"
    lines = [f"single-stream decode tok/s (ratio to {base}, else to macinfer); same tokens in every engine "
             "unless marked *; n/a: the engine cannot hold output to a schema", head]
    for task, row in tasks.items():
        e = row["engines"]
        ref = e[base] if base in e else e["macinfer"]
        cells = ""
        for n in names:
            if n not in e:
                cells += f"{'n/a':>26}"
                continue
            v = e[n]["decode_tok_s"]
            ratio = v / ref["decode_tok_s"] if ref["decode_tok_s"] else 0.0
            cells += f"{f'{v:.1f} ({ratio:.2f}x)' + ('' if e[n]['same_tokens'] else '*'):>26}"
        spec = next((e[n] for n in names if n.startswith("macinfer spec") and n in e), {})
        lines.append(f"{task:<14}{e['macinfer']['output_tokens']:>7}{cells}{spec.get('acceptance_rate', 0):>10.0%}")
    lines += [f"{task}: skipped, {why}" for task, why in results.get("skipped", {}).items()]
    return "\n".join(lines)
