"""Offline engine benchmark: macinfer's engine against mlx-lm's own generation on
the same weights, one run, mlx-lm in a process of its own (`isolated`). Random-token prompts (fixed seed),
greedy, EOS ignored, so both do exactly the same work. Medians over repeats, the
engines taking turns within each measurement."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from macinfer.bench.isolated import Isolated
from macinfer.bench.common import energy, hardware, process_peak_rss_gb, same_weights_dir, versions


class MacinferRunner:
    name = "macinfer"

    def __init__(self, model: str, max_num_seqs: int, kv_cache_gb: float, needed_len: int):
        from macinfer.engine.llm_engine import EngineConfig, LLMEngine

        # Prefix caching off: repeats reuse prompts; this measures compute (`bench prefix` measures the cache).
        # The model's own context (the KV budget is --kv-cache-gb either way).
        self.config = EngineConfig(max_num_seqs=max_num_seqs, kv_cache_gb=kv_cache_gb, max_num_batched_tokens=2048,
                                   enable_prefix_caching=False)
        self.engine = LLMEngine(model, self.config)
        if self.engine.max_model_len < needed_len:
            raise ValueError(f"this run needs {needed_len} tokens of context; the model has {self.engine.max_model_len}")

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        """(time to the first token of any request, total seconds)."""
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


class MlxLmRunner:
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


def run(model: str, vs: list[str], prompt_len: int = 32, gen_len: int = 64, prefill_len: int = 512,
        concurrency: tuple[int, ...] = (1, 8, 32), batch_gen_len: int = 32, repeats: int = 3,
        kv_cache_gb: float = 1.0, tick: Callable[[str], None] = lambda _: None) -> dict:
    """Results for macinfer and each of `vs` ("mlx-lm"); `tick(label)` after each measurement."""
    from macinfer.loading.loader import resolve

    runners: list = [MacinferRunner(model, max(concurrency), kv_cache_gb, prefill_len + gen_len + 8)]
    weights = None
    if "mlx-lm" in vs:
        model_dir, weights = same_weights_dir(model)
        runners.append(Isolated("macinfer.bench.engine:MlxLmRunner", model_dir, name="mlx-lm"))
    loaded = runners[0].engine.loaded
    vocab = runners[0].engine.model.args.vocab_size
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return rng.integers(100, vocab - 100, size=n).tolist()

    cfg = runners[0].config
    results: dict = {"mode": "engine", "context": {
        "model": os.path.basename(resolve(model).rstrip("/")), "model_type": loaded.config.get("model_type"),
        "quantization": loaded.config.get("quantization"), "mlx_lm_weights": weights, **versions(),
        "macinfer_flags": {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                           "kv_cache_gb": cfg.kv_cache_gb, "prefix_caching": False},
        "hardware": hardware(), "energy": energy(),
        "workload": {"prompt_len": prompt_len, "gen_len": gen_len, "prefill_len": prefill_len,
                     "batch_gen_len": batch_gen_len, "concurrency": list(concurrency), "repeats": repeats,
                     "prompts": "random token ids (fixed seed)", "sampling": "greedy, EOS ignored"},
    }, "engines": {}}

    spreads: dict[str, dict] = {}

    def measure(prompts, max_tokens, label, rate) -> dict[str, tuple[float, float]]:
        """Median (ttft, total) per engine; repeats interleaved across engines, so a
        drift in this machine's speed hits every engine alike. Each repeat also times a
        fixed matmul (the machine's own speed, `machine_gflops`), and the figure's spread is
        kept per engine, for the paired ratio and for the machine (`spread`)."""
        runs: dict[str, list] = {r.name: [] for r in runners}
        machine = []
        for _ in range(repeats):
            machine.append(machine_gflops())
            for r in runners:
                runs[r.name].append(r.run(prompts, max_tokens))
        tick(label)
        spreads[label] = spread({name: [rate(x) for x in rs] for name, rs in runs.items()}, machine)
        return {name: (statistics.median(x[0] for x in rs), statistics.median(x[1] for x in rs))
                for name, rs in runs.items()}

    out: dict[str, dict] = {r.name: {"throughput": {}} for r in runners}
    for r in runners:
        r.run([prompt(8)], 4)  # warm-up
    for name, (ttft, total) in measure([prompt(prompt_len)], gen_len, "decode",
                                       lambda x: (gen_len - 1) / (x[1] - x[0])).items():
        out[name]["decode_tok_s"] = (gen_len - 1) / (total - ttft)
        out[name]["tpot_ms"] = 1000 * (total - ttft) / (gen_len - 1)
    for name, (ttft, _) in measure([prompt(prefill_len)], 1, "prefill", lambda x: prefill_len / x[0]).items():
        out[name]["prefill_tok_s"] = prefill_len / ttft
        out[name]["ttft_s"] = ttft
    for c in concurrency:
        for name, (_, total) in measure([prompt(prompt_len) for _ in range(c)], batch_gen_len, f"c={c}",
                                        lambda x, c=c: c * batch_gen_len / x[1]).items():
            out[name]["throughput"][str(c)] = c * batch_gen_len / total
    for r in runners:
        out[r.name]["peak_rss_gb_process"] = r.peak_rss_gb() if isinstance(r, Isolated) else process_peak_rss_gb()
        results["engines"][r.name] = out[r.name]
        if isinstance(r, Isolated):
            r.close()
    results["spread"] = spreads
    return results


WIDE = 0.10  # a spread (max - min over the median) wider than this is flagged


def machine_gflops(n: int = 512, calls: int = 8, reps: int = 5) -> float:
    """This machine's speed right now: a fixed float32 matmul's GFLOPS (what a decode step
    mostly is on the CPU), timed where the engines' repeats run, between them; the median of
    `reps` timings after a warm-up (a lone first timing reads 30% low: BLAS threads waking)."""
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a @ b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval([a @ b + i for i in range(calls)])
        times.append(time.perf_counter() - start)
    return 2 * n**3 * calls / statistics.median(times) / 1e9


def _rel(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def spread(rates: dict[str, list[float]], machine: list[float]) -> dict:
    """Per engine and for the machine: (max - min) / median over the repeats; with two
    engines, the per-repeat ratio's min / median / max. Where the ratio is steadier than
    either engine the two moved together: the machine, not an engine."""
    out: dict = {name: round(_rel(v), 3) for name, v in rates.items()}
    out["machine"] = round(_rel(machine), 3)
    names = list(rates)
    if len(names) == 2:
        ratios = [a / b for a, b in zip(rates[names[0]], rates[names[1]]) if b]
        out["ratio"] = [round(min(ratios), 3), round(statistics.median(ratios), 3), round(max(ratios), 3)]
    return out


def spread_note(results: dict) -> str:
    """One line per figure whose spread is wide, saying where it came from."""
    lines = []
    for label, sp in results.get("spread", {}).items():
        engines = {k: v for k, v in sp.items() if k not in ("machine", "ratio")}
        worst = max(engines.values(), default=0.0)
        if worst <= WIDE:
            continue
        ratio = sp.get("ratio")
        ratio_rel = (ratio[2] - ratio[0]) / ratio[1] if ratio and ratio[1] else None
        held = ratio_rel is not None and ratio_rel <= WIDE
        if sp["machine"] > WIDE:
            where = f"the machine (its matmul speed varied {sp['machine']:.0%}" + (
                "; the ratio held)" if held else f"; the ratio moved {ratio_rel:.0%} too: the load hit the engines "
                "unevenly)" if ratio_rel is not None else ")")
        elif held or (ratio_rel is not None and ratio_rel < worst / 2):
            where = f"the machine (the engines moved together: the ratio varied {ratio_rel:.0%})"
        else:
            where = "the engines ({}), not the machine (matmul speed varied {:.0%})".format(
                ", ".join(f"{k} {v:.0%}" for k, v in engines.items()), sp["machine"])
        lines.append(f"warning: {label} spread {worst:.0%} over {results['context']['workload']['repeats']} repeats"
                     + (f", ratio {ratio[0]:.2f}-{ratio[2]:.2f}" if ratio else "") + f": {where}; "
                     "more --repeats, or a quieter machine, narrow it")
    return "\n".join(lines)


def table(results: dict) -> str:
    names = list(results["engines"])
    rows = [("decode tok/s", lambda e: e["decode_tok_s"]), ("TPOT ms", lambda e: e["tpot_ms"]),
            (f"prefill tok/s ({results['context']['workload']['prefill_len']})", lambda e: e["prefill_tok_s"])]
    rows += [(f"throughput c={c} tok/s", lambda e, c=c: e["throughput"][c]) for c in results["engines"][names[0]]["throughput"]]
    lines = [f"{'metric':<28}" + "".join(f"{n:>12}" for n in names) + ("   ratio" if len(names) == 2 else "")]
    spreads = list(results.get("spread", {}).values())  # decode, prefill, then each concurrency (the rows' order)
    spreads = [spreads[0], spreads[0], *spreads[1:]] if spreads else []
    if spreads:
        lines[0] += "  (range over repeats)  machine"
    for i, (label, get) in enumerate(rows):
        vals = [get(results["engines"][n]) for n in names]
        line = f"{label:<28}" + "".join(f"{v:>12.2f}" for v in vals)
        if len(vals) == 2 and vals[1]:
            line += f"{vals[0] / vals[1]:>8.2f}"
            sp = spreads[i] if i < len(spreads) else None
            if sp and "ratio" in sp and i != 1:  # (TPOT shares decode's repeats)
                line += f"  ({sp['ratio'][0]:.2f}-{sp['ratio'][2]:.2f}){'':>12}{sp['machine']:>6.0%}"
        lines.append(line)
    note = spread_note(results)
    return "\n".join(lines + ([note] if note else []))


def profile(model: str, concurrency: int = 32, prompt_len: int = 32, gen_len: int = 64,
            kv_cache_gb: float = 1.0, async_scheduling: bool = True, through_server: bool = False) -> dict:
    """Host time per step by phase (`engine/profile.py`) for `concurrency` greedy requests
    run to completion, after one untimed warm-up run; `through_server`: submitted to the
    server's engine thread and read as streams on an event loop, as `serve` runs them."""
    from macinfer.engine.profile import StepProfile

    runner = MacinferRunner(model, max(concurrency, 1), kv_cache_gb, prompt_len + gen_len + 1)
    runner.engine.config.async_scheduling = async_scheduling
    rng = np.random.default_rng(0)
    vocab = runner.engine.model.args.vocab_size
    prompts = [rng.integers(10, vocab - 10, size=prompt_len).tolist() for _ in range(concurrency)]
    runner.run(prompts, gen_len)  # warm-up: graphs, buffers
    prof = StepProfile()
    engine = runner.engine
    engine.runner.profile = prof
    rows = engine.stats["generation_tokens"], engine.runner.ahead_rows
    try:
        total = _through_server(engine, prompts, gen_len) if through_server else runner.run(prompts, gen_len)[1]
    finally:
        engine.runner.profile = None
    ahead = (engine.runner.ahead_rows - rows[1]) / max(engine.stats["generation_tokens"] - rows[0], 1)
    split = device_split(runner, prompts, gen_len)
    loaded = runner.engine.loaded
    return {"mode": "profile", "context": {
        "model": os.path.basename(str(loaded.source).rstrip("/")), "model_type": loaded.config.get("model_type"),
        "quantization": loaded.config.get("quantization"), **versions(),
        "macinfer_flags": {"max_num_seqs": runner.config.max_num_seqs, **runner.engine.paths.describe()},
        "hardware": hardware(), "energy": energy(),
        "workload": {"concurrency": concurrency, "prompt_len": prompt_len, "gen_len": gen_len, "greedy": True,
                     "through_server": through_server}},
        "tok_s": concurrency * gen_len / total, "steps": prof.steps, "ms_per_step": prof.per_step_ms(),
        "async_scheduling": engine.config.async_scheduling, "tokens_from_lookahead": ahead,
        "device_split_ms_per_step": split,
        "table": prof.table() + f"\ntokens whose forward was built a step ahead (async scheduling): {ahead:.0%}"
                 + "\n" + _split_table(split, prof.per_step_ms())}


def _through_server(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds for `prompts` through the server's engine thread (`server/async_engine.py`),
    each read as a stream on an asyncio loop."""
    import asyncio

    from macinfer.sampling_params import SamplingParams
    from macinfer.server.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    async def go() -> float:
        server = AsyncEngine(engine, max_pending=len(prompts))
        try:
            start = time.perf_counter()
            streams = [server.submit(p, [params], f"profile-{i}") for i, p in enumerate(prompts)]
            await asyncio.gather(*(drain(s) for s in streams))
            return time.perf_counter() - start
        finally:
            server.shutdown(leave_thread=True)

    return asyncio.run(go())


def device_split(runner, prompts: list[list[int]], gen_len: int) -> dict[str, float]:
    """The same run again with a barrier around every attention call and matmul
    (`engine/device_split.py`): device ms per step by attention / matmul / rest."""
    from macinfer.engine.device_split import DeviceSplit
    from macinfer.engine.profile import StepProfile

    prof = StepProfile()
    runner.engine.runner.profile = prof
    config = runner.engine.config
    overlap, config.async_scheduling = config.async_scheduling, False  # barriers and a graph built ahead do not mix
    try:
        with DeviceSplit() as split:
            runner.run(prompts, gen_len)
    finally:
        runner.engine.runner.profile = None
        config.async_scheduling = overlap
    ms = split.per_step_ms(prof.steps)
    ms["rest"] += prof.per_step_ms()["device"]  # what the step's final evaluation still had pending
    return ms


def _split_table(split: dict[str, float], plain: dict[str, float]) -> str:
    total = sum(split.values())
    rows = [f"device by kind (a second run, a barrier around each attention call and matmul: "
            f"{total:.2f} ms/step against {plain['device']:.2f} without)"]
    rows += [f"  {k:<10}{v:>8.2f}{100 * v / total:>7.1f}%" for k, v in split.items()]
    return "\n".join(rows)
