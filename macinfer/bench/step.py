"""One decode step, taken apart: step time against batch size and context length
(macinfer's paged engine against mlx-lm's own model and contiguous KV cache, on the
same weights), macinfer's host time to prepare and build a step, and the MLX graph
nodes a step holds (counted from an export, for both).

The caches are filled with random K/V (attention cost does not depend on the
values), so long contexts need no prefill; contexts past the model's trained
length are fine for timing. Medians over repeats, one run; mlx-lm in a process of
its own (`isolated`).
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from collections import Counter
from typing import Callable

import mlx.core as mx

from macinfer.bench.common import energy, hardware, same_weights_dir, versions
from macinfer.bench.isolated import Isolated

DEFAULT_POINTS = ("1x128", "1x1024", "1x4096", "1x8192", "4x1024", "16x1024", "16x4096", "64x128")
HOST_POINTS = ("4x1024", "4x4096", "4x16384")
NODES_POINT = (4, 64)  # batch, context of the step whose graph is counted


def parse_point(text: str) -> tuple[int, int]:
    """'BATCHxCONTEXT' -> (batch, context)."""
    b, _, l = text.lower().partition("x")
    if not (b.isdigit() and l.isdigit()) or int(b) < 1 or int(l) < 1:
        raise ValueError(f"{text!r}: expected BATCHxCONTEXT, e.g. 16x1024")
    return int(b), int(l)


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    """The median wall time of `fn` (which evaluates what it builds) in ms, after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _count_nodes(outputs: list[mx.array]) -> Counter:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step.dot")
        mx.export_to_dot(path, *outputs)
        text = open(path).read()
    return Counter(re.findall(r'label ?="([A-Za-z]+)', text))


class MacinferStep:
    """Decode steps of `batch` sequences at `context` tokens, straight on the engine's runner."""

    def __init__(self, model: str, points: list[tuple[int, int]]):
        from macinfer.engine.llm_engine import EngineConfig, LLMEngine

        need = max(b * (l + 16) for b, l in points)
        self.config = EngineConfig(max_num_seqs=max(b for b, _ in points), kv_cache_gb=None,
                                   enable_prefix_caching=False, num_kv_blocks=need // 16 + 64)
        self.engine = LLMEngine(model, self.config)

    def _seqs(self, batch: int, context: int) -> list:
        from macinfer.engine.sequence import Sequence
        from macinfer.sampling_params import SamplingParams

        seqs = [Sequence(f"s{i}", [5] * context, SamplingParams(temperature=0), 0) for i in range(batch)]
        for s in seqs:
            self.engine.block_manager.allocate(s, context + 1)
            s.num_computed_tokens = context
            s.output_token_ids.append(7)
        mx.eval(self.engine.kv_cache.state())  # (recurrent states moved when slots were freed)
        return seqs

    def _graph(self, seqs: list) -> list[mx.array]:
        e = self.engine
        ids, meta, rows, _ = e.runner.prepare([(s, 1) for s in seqs])
        logits = e.model.logits(e.model(ids, meta)[mx.array(rows)])
        return [mx.argmax(logits, axis=-1), *e.kv_cache.state()]

    def measure(self, batch: int, context: int, repeats: int) -> tuple[float, float]:
        """(step ms, host ms to prepare the inputs and build the graph), medians."""
        seqs = self._seqs(batch, context)
        host: list[float] = []

        def step() -> None:
            t = time.perf_counter()
            outputs = self._graph(seqs)
            host.append(time.perf_counter() - t)
            mx.eval(*outputs)

        try:
            ms = median_ms(step, repeats)
            return ms, 1000 * statistics.median(host[2:])  # not the two warm-up builds
        finally:
            for s in seqs:
                self.engine.block_manager.free(s)

    def nodes(self, batch: int, context: int) -> Counter:
        seqs = self._seqs(batch, context)
        try:
            return _count_nodes(self._graph(seqs)[:1])
        finally:
            for s in seqs:
                self.engine.block_manager.free(s)


class MlxLmStep:
    """mlx-lm's own model call with its KV cache, held at a fixed context."""

    def __init__(self, model_dir: str):
        from mlx_lm import load

        self.model, _ = load(model_dir)

    def _cache(self, batch: int, context: int) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        if not all(type(c).__name__ == "KVCache" and hasattr(getattr(layer, "self_attn", None), "n_kv_heads")
                   for c, layer in zip(cache, self.model.layers)):
            # Recurrent state (hybrid models), MLA latents: fill by prefilling the context, 512 tokens a call.
            for start in range(0, context, 512):
                self.model(mx.full((batch, min(512, context - start)), 7, dtype=mx.int32), cache=cache)
                mx.eval([c.state for c in cache])
            return cache
        for c, layer in zip(cache, self.model.layers):
            attn = layer.self_attn
            kvh = attn.n_kv_heads
            d = getattr(attn, "head_dim", None) or self.model.args.head_dim
            c.update_and_fetch(mx.random.normal((batch, kvh, context, d)), mx.random.normal((batch, kvh, context, d)))
        mx.eval([c.state for c in cache])
        return cache

    def measure(self, batch: int, context: int, repeats: int) -> float:
        cache = self._cache(batch, context)
        tokens = mx.full((batch, 1), 7, dtype=mx.int32)

        def step() -> None:
            logits = self.model(tokens, cache=cache)
            mx.eval(mx.argmax(logits[:, -1], axis=-1), [c.state for c in cache])
            for c in cache:  # stay at context L (K/V; a recurrent state just moves on)
                if isinstance(getattr(c, "offset", None), int):
                    c.offset -= 1

        return median_ms(step, repeats)

    def nodes(self, batch: int, context: int) -> Counter:
        cache = self._cache(batch, context)
        logits = self.model(mx.full((batch, 1), 7, dtype=mx.int32), cache=cache)
        return _count_nodes([mx.argmax(logits[:, -1], axis=-1)])


def run(model: str, vs: list[str], points: list[tuple[int, int]], host_points: list[tuple[int, int]],
        repeats: int = 5, tick: Callable[[str], None] = lambda _: None) -> dict:
    """Results for macinfer and each of `vs` ("mlx-lm"); `tick(label)` after each measurement."""
    from macinfer.loading.loader import resolve

    ours = MacinferStep(model, points + host_points + [NODES_POINT])
    theirs, weights = None, None
    if "mlx-lm" in vs:
        model_dir, weights = same_weights_dir(model)
        theirs = Isolated("macinfer.bench.step:MlxLmStep", model_dir, name="mlx-lm")
    layers = ours.engine.model.args.num_hidden_layers
    loaded = ours.engine.loaded
    results: dict = {"mode": "step", "context": {
        "model": os.path.basename(resolve(model).rstrip("/")), "model_type": loaded.config.get("model_type"),
        "quantization": loaded.config.get("quantization"), "mlx_lm_weights": weights, **versions(),
        "macinfer_flags": {"block_size": ours.config.block_size, "prefix_caching": False,
                           **ours.engine.paths.describe()},  # the paths chosen at load (engine/choices.py)
        "hardware": hardware(), "energy": energy(),
        "workload": {"points": [f"{b}x{l}" for b, l in points], "host_points": [f"{b}x{l}" for b, l in host_points],
                     "repeats": repeats, "kv": "random K/V at the given context, one new token per sequence"},
    }, "steps": [], "host": [], "nodes": {}}
    for b, l in points:
        ms, host = ours.measure(b, l, repeats)
        row = {"batch": b, "context": l, "macinfer_ms": ms, "macinfer_host_ms": host}
        if theirs is not None:
            row["mlx_lm_ms"] = theirs.measure(b, l, repeats)
            row["ratio"] = ms / row["mlx_lm_ms"]
        results["steps"].append(row)
        tick(f"{b}x{l}")
    for b, l in host_points:
        ms, host = ours.measure(b, l, repeats)
        results["host"].append({"batch": b, "context": l, "host_ms": host, "step_ms": ms})
        tick(f"host {b}x{l}")
    engines = [("macinfer", ours)] + ([("mlx-lm", theirs)] if theirs is not None else [])
    for name, eng in engines:
        c = eng.nodes(*NODES_POINT)
        total = sum(c.values())
        results["nodes"][name] = {"batch": NODES_POINT[0], "context": NODES_POINT[1], "total": total,
                                  "per_layer": total / layers, "top": dict(c.most_common(8))}
    tick("nodes")
    if theirs is not None:
        theirs.close()
    return results


def table(results: dict) -> str:
    lines = [f"{'batch':>6}{'context':>9}{'macinfer ms':>13}{'host ms':>9}{'mlx-lm ms':>11}{'ratio':>7}"]
    for r in results["steps"]:
        theirs = f"{r['mlx_lm_ms']:>11.1f}{r['ratio']:>7.2f}" if "mlx_lm_ms" in r else ""
        lines.append(f"{r['batch']:>6}{r['context']:>9}{r['macinfer_ms']:>13.1f}{r['macinfer_host_ms']:>9.2f}{theirs}")
    if results["host"]:
        lines.append("\nmacinfer host time per step (prepare inputs + build the graph):")
        lines += [f"  batch {h['batch']} context {h['context']:>6}: {h['host_ms']:.2f} ms (step {h['step_ms']:.0f} ms)"
                  for h in results["host"]]
    for name, n in results["nodes"].items():
        lines.append(f"graph nodes, {name} (batch {n['batch']}, context {n['context']}): {n['total']} "
                     f"({n['per_layer']:.1f} per layer)")
    return "\n".join(lines)
