"""`macinfer bench engine|step|spec|serve|prefix`: run a benchmark, print a table, write JSON and PNG plots."""

from __future__ import annotations

import json
import os

import click

VS_HELP = ("Compare with: 'mlx-lm' (given the same weights macinfer runs), "
           "'macinfer-nocache' (prefix caching off), or the URL of any OpenAI-compatible server "
           "(llama-server, mlx_lm.server, vLLM...). Repeatable.")


def _finish(results: dict, out_dir: str, plots: bool, table: str) -> None:
    from macinfer.bench.common import save_json

    os.makedirs(out_dir, exist_ok=True)
    click.echo("\n" + table)
    ctx = results["context"]
    hw = ctx["hardware"]
    click.echo(f"macinfer {ctx['macinfer']}, mlx {ctx['mlx']}, mlx-lm {ctx['mlx_lm']}; {hw['chip']} x{hw['cores']}, "
               f"{hw.get('memory_gb')} GB, device {hw['mlx_device']}; energy: {ctx['energy']['why']}")
    flags = ctx.get("macinfer_flags") or {}
    chosen = {k: flags[k] for k in ("decode_attention", "attention_ops", "qmv_kernel", "mla_prompt_expanded_from",
                                    "decode_partition")
              if k in flags}
    if chosen:  # the paths measured at load (engine/choices.py)
        click.echo("paths: " + ", ".join(f"{k} {v}" for k, v in chosen.items()))
    path = save_json(results, os.path.join(out_dir, f"bench_{results['mode']}.json"))
    click.echo(f"wrote {path}")
    if plots:
        try:
            from macinfer.bench.plots import write
        except ImportError:
            raise click.ClickException("plots need matplotlib: pip install 'macinfer[bench]' (or pass --no-plots)")
        for p in write(results, out_dir):
            click.echo(f"wrote {p}")


def _progress(total: int, desc: str, unit: str = "req"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


def _check_plots(plots: bool) -> None:
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("plots need matplotlib: pip install 'macinfer[bench]' (or pass --no-plots)")


def _targets(vs: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    for v in vs:
        if not v.startswith(("http://", "https://")) and v not in allowed:
            raise click.BadParameter(f"{v!r}: expected {', '.join(allowed)} or an http(s) URL", param_hint="--vs")
    return list(vs)


def _in_process(vs: tuple[str, ...], no_plots: bool, mode: str) -> list[str]:
    """Checks for the modes that run the engines themselves: mlx-lm only, no URLs."""
    _check_plots(not no_plots)
    vs = _targets(vs, ("mlx-lm",))
    if any(v.startswith("http") for v in vs):
        raise click.BadParameter(f"{mode} mode compares engines it runs itself (mlx-lm); use `bench serve` for a URL",
                                 param_hint="--vs")
    return vs


_common = [
    click.argument("model", default="smollm2"),
    click.option("--vs", "vs", multiple=True, help=VS_HELP),
    click.option("--out", "out_dir", default="bench_results", show_default=True, help="Directory for JSON and plots."),
    click.option("--no-plots", is_flag=True, help="JSON and table only."),
]


def common(f):
    for opt in reversed(_common):
        f = opt(f)
    return f


@click.group(help="Benchmarks with the full context (model, quantization, versions, flags, hardware, workload), "
                  "written as JSON plus PNG plots. MODEL defaults to the bundled SmolLM2.")
def bench():
    pass


@bench.command(help="Offline engine: single-stream decode, prefill, throughput by concurrency.")
@common
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--gen-len", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--prefill-len", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--concurrency", "-c", type=click.IntRange(min=1), multiple=True, default=(1, 8, 32), show_default=True)
@click.option("--batch-gen-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
def engine(model, vs, out_dir, no_plots, prompt_len, gen_len, prefill_len, concurrency, batch_gen_len, repeats):
    from macinfer.bench import engine as mod

    vs = _in_process(vs, no_plots, "engine")
    steps = 2 + len(concurrency)
    with _progress(steps, "engine", "measurement") as bar:
        results = mod.run(model, vs, prompt_len, gen_len, prefill_len, tuple(sorted(concurrency)), batch_gen_len,
                          repeats, tick=lambda label: (bar.set_postfix_str(label), bar.update()))
    _finish(results, out_dir, not no_plots, mod.table(results))


@bench.command(help="Where a step's time goes (schedule, metadata, graph, device, sampler, outputs) for "
                    "concurrent greedy requests, then the device time by attention / matmul / rest (a second "
                    "run with a barrier around each attention call and matmul).")
@click.argument("model", required=False)
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--gen-len", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--out", "--out-dir", "out_dir", default="bench_results", show_default=True,
              help="Directory for the JSON.")
@click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True,
              help="Build the next decode step while one computes (the engine's default), or not: the "
                   "profile before and after.")
@click.option("--through-server", is_flag=True,
              help="Submit the requests to the server's engine thread and read them as streams, as `serve` "
                   "does: adds the phases of taking requests and delivering outputs.")
def profile(model, concurrency, prompt_len, gen_len, out_dir, async_scheduling, through_server):
    from macinfer.bench import engine as mod
    from macinfer.loading.loader import bundled_test_model

    results = mod.profile(model or bundled_test_model(), concurrency, prompt_len, gen_len,
                          async_scheduling=async_scheduling, through_server=through_server)
    table = (f"{concurrency} concurrent, {prompt_len}-token prompts, {gen_len} new tokens: "
             f"{results['tok_s']:.1f} tok/s\n{results['table']}")
    _finish(results, out_dir, False, table)


def _start_targets(model: str, vs: list[str], first: str, macinfer_args: list[str]):
    from macinfer.bench import targets
    from macinfer.bench.common import same_weights_dir

    mlx_dir = weights = None
    if "mlx-lm" in vs:
        mlx_dir, weights = same_weights_dir(model)
    started = []
    try:
        for spec in [first, *vs]:
            click.echo(f"starting {spec}...", err=True)
            started.append(targets.start(spec, model, mlx_dir, macinfer_args))
    except Exception:
        for t in started:
            t.stop()
        raise
    if weights:
        next(t for t in started if t.name == "mlx-lm").info["weights"] = weights
    return started


@bench.command(help="One decode step: step time by batch x context against mlx-lm (same weights), macinfer's "
                    "host time per step as context grows, and MLX graph nodes per step.")
@common
@click.option("--points", multiple=True, default=None, metavar="BATCHxCONTEXT",
              help="Step-time points (repeatable). Default: 1x128 1x1024 1x4096 1x8192 4x1024 16x1024 16x4096 64x128.")
@click.option("--host-points", multiple=True, default=None, metavar="BATCHxCONTEXT",
              help="Host-time points (repeatable). Default: 4x1024 4x4096 4x16384.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
def step(model, vs, out_dir, no_plots, points, host_points, repeats):
    from macinfer.bench import step as mod

    vs = _in_process(vs, no_plots, "step")
    try:
        pts = [mod.parse_point(p) for p in (points or mod.DEFAULT_POINTS)]
        hosts = [mod.parse_point(p) for p in (host_points or mod.HOST_POINTS)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--points/--host-points")
    with _progress(len(pts) + len(hosts) + 1, "step", "measurement") as bar:
        results = mod.run(model, vs, pts, hosts, repeats, tick=lambda label: (bar.set_postfix_str(label), bar.update()))
    _finish(results, out_dir, not no_plots, mod.table(results))


@bench.command(help="Single-stream decode on chat tasks (code edit, extraction, reformatting, free writing) "
                    "with and without prompt-lookup speculative decoding, against mlx-lm on the same weights.")
@common
@click.option("--num-speculative-tokens", "-k", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=2), default=160, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--draft-model", default=None, metavar="MODEL",
              help="Also a draft model, alone and behind prompt lookup (--prompt-lookup-first).")
@click.option("--draft-bits", type=click.Choice(["3", "4", "8"]), default=None,
              help="As --draft-model: the target itself quantized to this many bits.")
def spec(model, vs, out_dir, no_plots, num_speculative_tokens, max_tokens, repeats, draft_model, draft_bits):
    from macinfer.bench import spec as mod

    vs = _in_process(vs, no_plots, "spec")
    drafts = 2 if draft_model or draft_bits else 0
    with _progress(len(mod.TASKS) * (2 + drafts + len(vs)), "spec", "measurement") as bar:
        results = mod.run(model, vs, num_speculative_tokens, max_tokens, repeats,
                          tick=lambda label: (bar.set_postfix_str(label), bar.update()), draft=draft_model,
                          draft_bits=int(draft_bits) if draft_bits else None)
    _finish(results, out_dir, not no_plots, mod.table(results))


@bench.command(help="Speculative decoding with a draft model: greedy decode at batch 1, 4 and 16 with and without "
                    "it, against mlx-lm's speculative_generate on the same weights. Without --draft-model the draft "
                    "is the target's first --draft-layers layers.")
@click.argument("model", default="smollm2")
@click.option("--out", "out_dir", default="bench_results", show_default=True, help="Directory for JSON.")
@click.option("--draft-model", default=None, metavar="MODEL", help="A smaller model of the same tokenizer.")
@click.option("--draft-layers", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--draft-bits", type=click.Choice(["2", "3", "4", "6", "8"]), default=None,
              help="The draft: the target's weights quantized to this many bits (instead of --draft-layers).")
@click.option("--num-speculative-tokens", "-k", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option("--batch", "batches", type=click.IntRange(min=1), multiple=True, default=(1, 4, 16), show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0: greedy; else seeded sampling (the same tokens with and without the draft).")
def draft(model, out_dir, draft_model, draft_layers, draft_bits, num_speculative_tokens, batches, max_tokens, repeats,
          temperature):
    from macinfer.bench import draft as mod

    with _progress(len(batches), "draft", "batch") as bar:
        results = mod.run(model, draft_model, draft_layers, int(draft_bits) if draft_bits else None,
                          num_speculative_tokens, tuple(batches), max_tokens,
                          repeats, temperature, tick=lambda label: (bar.set_postfix_str(label), bar.update()))
    _finish(results, out_dir, False, mod.table(results))


@bench.command(help="LoRA adapters: N concurrent requests over K adapters vs the same on the base alone, and vs "
                    "mlx-lm serving the adapters one after another (load, fuse, batch_generate).")
@click.argument("model", default="smollm2")
@click.option("--out", "out_dir", default="bench_results", show_default=True, help="Directory for JSON.")
@click.option("--adapters", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--requests", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--rank", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
def lora(model, out_dir, adapters, requests, input_len, output_len, rank, repeats):
    from macinfer.bench import lora as mod

    with _progress(3 * repeats, "lora", "run") as bar:
        results = mod.run(model, adapters, requests, input_len, output_len, rank, repeats,
                          tick=lambda label: (bar.set_postfix_str(label), bar.update()))
    _finish(results, out_dir, False, mod.table(results))


@bench.command(help="Online serving: streaming requests at fixed concurrency and with Poisson arrivals; "
                    "TTFT, TPOT, inter-token latency, end-to-end (p50/p95/p99), tok/s, req/s, memory, KV hit rate.")
@common
@click.option("--concurrency", "-c", type=click.IntRange(min=1), multiple=True, default=(1, 4, 16), show_default=True)
@click.option("--requests", type=click.IntRange(min=1), default=None, help="Per level (default: 2 x concurrency, at least 4).")
@click.option("--rate", type=click.FloatRange(min=0), default=2.0, show_default=True, help="Poisson arrivals per second (0: skip).")
@click.option("--input-len", type=click.IntRange(min=8), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--kv-cache-gb", type=float, default=1.0, show_default=True, help="For the macinfer server started here.")
@click.option("--mixed", nargs=4, type=(int, int, int, float), default=None,
              metavar="STREAMS LONG_TOKENS LONG_PROMPTS RATE",
              help="Add a mixed-load level: STREAMS streams decoding short requests while LONG_PROMPTS prompts of "
                   "LONG_TOKENS tokens arrive at RATE per second. E.g. --mixed 16 1536 4 0.2")
@click.option("--server-arg", "server_args", multiple=True, help="Extra flag for the macinfer server (repeatable).")
@click.option("--structured", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Fraction of requests held to a JSON schema (chat completions with response_format).")
def serve(model, vs, out_dir, no_plots, concurrency, requests, rate, input_len, output_len, kv_cache_gb, mixed,
          server_args, structured):
    from macinfer.bench import serve as mod

    _check_plots(not no_plots)
    vs = _targets(vs, ("mlx-lm", "macinfer-nocache"))
    tokenizer = _tokenizer(model)
    conc = tuple(sorted(concurrency))
    args = ["--kv-cache-gb", str(kv_cache_gb), "--max-num-seqs", str(max(32, max(conc))), "--max-queue", "1024",
            *server_args]
    started = _start_targets(model, vs, "macinfer", args)
    try:
        per_target = sum(requests or max(4, 2 * c) for c in conc) + ((requests or 16) if rate else 0)
        per_target += (3 * mixed[0] + mixed[2]) if mixed else 0
        with _progress(per_target * len(started), "serve") as bar:
            results = mod.run(started, tokenizer, input_len, output_len, conc, requests, rate or None, bar.update,
                              mixed, structured)
    finally:
        for t in started:
            t.stop()
    for t in started:  # samples end with the server
        if t.memory is not None:
            results["servers"][t.name]["memory_gb_over_time"] = list(t.memory.samples)
            results["servers"][t.name]["peak_rss_gb"] = t.memory.peak_gb
    results["context"]["model"] = model
    results["context"]["macinfer_flags"] = args
    _finish(results, out_dir, not no_plots, mod.table(results))


@bench.command(help="Prefix caching: multi-turn TTFT per turn, many clients sharing a system prompt, and a long "
                    "prompt after a restart (macinfer with its disk tier, in a temporary directory).")
@common
@click.option("--turns", type=click.IntRange(min=2), default=5, show_default=True)
@click.option("--clients", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
def prefix(model, vs, out_dir, no_plots, turns, clients, max_tokens):
    from macinfer.bench import prefix as mod

    _check_plots(not no_plots)
    vs = _targets(vs, ("mlx-lm", "macinfer-nocache"))
    import tempfile

    disk = tempfile.mkdtemp(prefix="macinfer-bench-kv-")
    args = ["--kv-cache-gb", "0.5", "--max-num-seqs", str(max(32, clients)), "--kv-disk-gb", "4", "--kv-disk-dir", disk]
    started = _start_targets(model, vs, "macinfer", args)
    try:
        with _progress((turns + clients) * len(started), "prefix") as bar:
            results = mod.run(started, turns, clients, max_tokens, bar.update)
    finally:
        for t in started:
            t.stop()
        import shutil

        shutil.rmtree(disk, ignore_errors=True)
    results["context"]["model"] = model
    results["context"]["macinfer_flags"] = args
    _finish(results, out_dir, not no_plots, mod.table(results))


def _tokenizer(model: str):
    """The model's tokenizer alone (no weights), to size prompts in tokens."""
    from macinfer.loading.loader import resolve
    from macinfer.text.tokenizer import TokenizerWrapper

    path = resolve(model)
    if path.endswith(".gguf"):
        from macinfer.gguf.file import GGUFFile

        return TokenizerWrapper.from_gguf_metadata(GGUFFile(path).metadata)
    with open(os.path.join(path, "config.json")) as f:
        return TokenizerWrapper.from_dir(path, json.load(f))

