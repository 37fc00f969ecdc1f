"""`macinfer` command line: generate, chat, convert, serve."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import sys
import time

import click

from macinfer import __version__
from macinfer.cli.options import LOG_LEVELS
from macinfer.cli.options import log_options as _log_options
from macinfer.cli.options import setup_logging as _setup_logging
from macinfer.text.tool_parsers import FORMATS

from macinfer.cli.engine_options import MODEL_HELP, SERVE_PREFILL_WITH_DECODES  # noqa: F401
from macinfer.cli.engine_options import engine_config as _engine_config
from macinfer.cli.engine_options import engine_options as _engine_options
from macinfer.cli.engine_options import model_argument as _model_argument
from macinfer.cli.engine_options import sampling_options as _sampling_options


def _load_engine(model: str, **engine_opts):
    from macinfer.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    click.echo(f"loading {model} ...", err=True)
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if tty and total > 1:  # a live line on a terminal only; logs and pipes get the two lines
            click.echo(f"\rloading {model}: {100 * done // total}% ({done}/{total})", err=True, nl=False)

    try:
        engine = LLMEngine(model, _engine_config(**engine_opts), progress=progress)
    except (FileNotFoundError, ValueError, MemoryError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    if engine.disk is not None and engine.dist is None:
        atexit.register(engine.close)  # the prefix cache to disk (the server closes it itself)
    if engine.dist is not None:
        if not engine.dist.is_driver:  # a worker rank: rank 0's steps until it closes; no output of its own
            engine.run_worker()
            sys.exit(0)
        atexit.register(engine.close)
    click.echo(f"{chr(13) if tty else ''}loaded {model} in {time.perf_counter() - start:.1f}s" + " " * 20, err=True)
    return engine


def _load_loras(engine, loras: dict[str, str]) -> dict[str, str]:
    """Load each named adapter on `engine`; a bad one is a one-line error."""
    from macinfer.lora.adapter import LoraError

    for name, path in loras.items():
        try:
            engine.load_lora(name, path)
        except LoraError as e:
            raise click.ClickException(str(e)) from None
    return loras


def _load_loras_into(engine, loras: dict[str, str]):
    _load_loras(engine, loras)
    return engine


def _lora_pairs(pairs: tuple[str, ...], names: set[str]) -> dict[str, str]:
    """`--lora NAME=PATH` values, checked: a name once, no model's name, the folder there."""
    import os

    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{pair!r}: give NAME=PATH", param_hint="--lora")
        if name in out or name in names:
            raise click.BadParameter(f"{name!r} names " + ("two adapters" if name in out else "a model"),
                                     param_hint="--lora")
        if not os.path.isdir(os.path.expanduser(path)):
            raise click.BadParameter(f"{path}: no such folder", param_hint="--lora")
        out[name] = os.path.expanduser(path)
    return out


def _params(temperature, max_tokens, top_p, top_k, seed):
    from macinfer.sampling_params import SamplingParams

    try:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, top_p=top_p, top_k=top_k, seed=seed)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _stream(engine, prompt, params, images=None, lora=None) -> tuple[str, int, float, float]:
    """Print tokens as they come; returns (text, tokens, ttft, total seconds)."""
    from macinfer.engine.llm_engine import PromptTooLongError

    start = time.perf_counter()
    try:
        rid = engine.add_request(prompt, params, images=images, lora=lora)
    except (PromptTooLongError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    ttft, text, ntok = 0.0, "", 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                if not ttft:
                    ttft = time.perf_counter() - start
                click.echo(out.delta_text, nl=False)
                text, ntok = out.text, len(out.token_ids)
    except KeyboardInterrupt:
        engine.abort_request(rid)
        click.echo("\n[interrupted]", err=True)
    click.echo()
    return text, ntok, ttft, time.perf_counter() - start


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="macinfer")
@click.option("-v", "--verbose", is_flag=True, help="Log engine details (KV budget, kernels).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default=None, help="Logging level.")
def main(verbose: bool, log_level: str | None) -> None:
    """macinfer: run open LLMs locally on Apple Silicon (MLX)."""
    _setup_logging(log_level or ("info" if verbose else "warning"))


@main.command(help="Generate a completion for one prompt, streamed to stdout.\n\nMODEL: " + MODEL_HELP)
@_model_argument
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image file the prompt asks about, before the text (repeatable; vision models).")
@click.option("--no-chat-template", "raw", is_flag=True, help="Send the prompt as it is, not as a user message "
              "in the chat template.")
@click.option("--lora", "lora_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="Generate under this LoRA adapter (a folder: mlx-lm's adapters.safetensors or PEFT's "
                   "adapter_model.safetensors, with adapter_config.json).")
@_sampling_options
@_engine_options
@_log_options
def generate(model, prompt, images, raw, lora_path, temperature, max_tokens, top_p, top_k, seed, **engine_opts):
    if prompt == "-":
        prompt = sys.stdin.read()
    params = _params(temperature, max_tokens, top_p, top_k, seed)
    engine = _load_engine(model, **engine_opts)
    lora = _load_loras(engine, {"adapter": lora_path}) and "adapter" if lora_path else None
    inputs = None
    if images and (raw or not engine.tokenizer.chat_template):
        raise click.ClickException("--image needs the chat template (it places the images in the prompt)")
    if images and engine.vision is None:
        raise click.ClickException(f"{model} takes no images: {engine.vision_refusal or 'it is a text model'}")
    if not raw and engine.tokenizer.chat_template:
        from macinfer.vision.images import decode

        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}] if images else prompt
        try:
            prompt = engine.tokenizer.encode_chat([{"role": "user", "content": content}])
            if images:
                pictures = [decode(p, engine.vision.limits, p, allow_paths=True) for p in images]
                prompt, inputs = engine.prepare_images(prompt, pictures)
        except ValueError as e:  # a template that refuses the conversation; an image that is not one
            raise click.ClickException(str(e)) from None
    _, ntok, ttft, total = _stream(engine, prompt, params, inputs, lora)
    decode = (ntok - 1) / (total - ttft) if ntok > 1 and total > ttft else 0.0
    click.echo(f"[{ntok} tokens, TTFT {ttft:.2f}s, decode {decode:.1f} tok/s]", err=True)


@main.command(help="Interactive chat in the terminal (line editing and history; /help lists the commands). "
                   "`macinfer run` is the same command, as Ollama names it.\n\nMODEL: " + MODEL_HELP)
@_model_argument
@click.option("--system", default=None, help="System prompt.")
@_sampling_options
@_engine_options
@_log_options
def chat(model, system, temperature, max_tokens, top_p, top_k, seed, **engine_opts):
    from macinfer.cli.repl import ChatREPL

    params = _params(temperature, max_tokens, top_p, top_k, seed)
    engine = _load_engine(model, **engine_opts)
    if not engine.tokenizer.chat_template:
        raise click.ClickException("this model has no chat template; use `macinfer generate --no-chat-template`")
    ChatREPL(engine, params, system, lambda prompt: _stream(engine, prompt, params)[0]).run()


main.add_command(chat, name="run")  # Ollama's name for it


@main.command()
@click.argument("gguf", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@_log_options
def convert(gguf, out_dir):
    """Convert a GGUF file to an MLX model directory (loads in mlx-lm too)."""
    from macinfer.loading.convert import convert_gguf

    try:
        convert_gguf(gguf, out_dir)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out_dir}")


@main.command(help="Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                   "/v1/models, /health, /metrics), Anthropic's (/v1/messages) and Ollama's (/api/*). Several "
                   "MODELs (or --models-dir) serve each by name, loaded on demand.\n\nMODEL: " + MODEL_HELP)
@click.argument("models", nargs=-1)
@click.option("-m", "--model", "model_flags", multiple=True, metavar="MODEL",
              help="MODEL as an option, as llama.cpp's tools take it (repeatable).")
@click.option("--models-dir", type=click.Path(file_okay=False), default=None,
              help="Serve every model in this directory (MLX/HF model folders and .gguf files) by its name, "
                   "loaded on the first request that names it; the Hugging Face cache's models too.")
@click.option("--hf-cache/--no-hf-cache", "hf_cache", default=True, show_default=True,
              help="With several models: also serve the supported models in the Hugging Face cache (by repo id).")
@click.option("--idle-ttl", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="With several models: unload a model no request has used for this long (default: never; "
                   "the memory budget still unloads idle models for room). Ollama's keep_alive overrides it.")
@click.option("--pin", "pins", multiple=True, metavar="NAME",
              help="With several models: load this model at start and never unload it (repeatable).")
@click.option("--max-memory-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With several models: memory for weights plus KV caches of the loaded models; loading beyond "
                   "it unloads the least recently used idle model (default: what the machine can give: "
                   "Metal's recommended working set on a Mac, available memory elsewhere).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--served-model-name", "served_model_names", multiple=True, help="The model id /v1/models shows and responses carry (default: MODEL's file or directory name); repeat it for aliases /v1/models/{id} answers too. With one model, generation requests take any `model` value; with several, it names the first MODEL.")
@click.option("--max-tokens-default", type=click.IntRange(min=1), default=4096, show_default=True, help="Output cap of a request that sets no max_tokens (a max_tokens beyond what the context leaves is clamped to it; both say so in an x-macinfer-max-tokens header).")
@click.option("--api-key", "api_keys", multiple=True, envvar="MACINFER_API_KEY", help="Require 'Authorization: Bearer KEY' (or 'x-api-key') on every endpoint but /health. Repeatable: one key per client.")
@click.option("--cache-isolation", type=click.Choice(["key-and-user", "key", "none"]), default="key-and-user", show_default=True, help="Which requests may share prefix-cache entries: same API key and same `user` field (default), same key, or all.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, help="Extra Host header names to answer (repeatable; '*': any). Loopback names, this machine's names and IP addresses are always answered; other names are refused (DNS-rebinding defence).")
@click.option("--no-webui", is_flag=True, help="Do not serve the chat page at /.")
@click.option("--tool-call-parser", type=click.Choice(sorted(FORMATS)), default=None,
              help="Tool-call format for tool_choice 'auto' (default: the one the chat template teaches).")
@click.option("--cors-origin", "cors_origins", multiple=True, help="Allow browser requests from this origin (repeatable). No CORS unless given.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True, help="Requests waiting beyond --max-num-seqs before answering 429.")
@click.option("--allow-image-urls", is_flag=True, help="Fetch http(s) image URLs in requests (public addresses "
              "only, no redirects, 20 MB and 10 s at most); without it they are refused and images come as data URLs.")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=32.0, show_default=True, help="Largest request body accepted (413 beyond): room for a few base64 photos.")
@click.option("--max-connections", type=click.IntRange(min=1), default=None, help="Open connections held at once (503 beyond; default: from the open-file limit, at most 1024).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True, help="Seconds a connection may take to send a request head.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True, help="Seconds a request may take to send its body (408 beyond).")
@click.option("--temperature", "-t", "default_temperature", type=click.FloatRange(0, 2), default=None,
              help="Temperature of requests that set none (default 1.0, as OpenAI's API; 0 is greedy).")
@click.option("--top-p", "default_top_p", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="top_p of requests that set none (default 1.0).")
@click.option("--top-k", "default_top_k", type=click.IntRange(min=0), default=None,
              help="top_k of requests that set none (default 0: off).")
@click.option("--seed", "default_seed", type=int, default=None,
              help="Seed of requests that set none (default: unseeded).")
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH",
              help="Serve a LoRA adapter of the (first) MODEL as NAME: requests whose `model` is NAME run under "
                   "it, batched with the base's and other adapters' (repeatable; more at run time with "
                   "POST /v1/load_lora_adapter when --api-key is set).")
@_engine_options
@_log_options
def serve(models, model_flags, models_dir, hf_cache, idle_ttl, pins, max_memory_gb, host, port, served_model_names, max_tokens_default, api_keys, cache_isolation, allowed_hosts, no_webui, tool_call_parser, cors_origins, max_queue, allow_image_urls, max_body_mb,
          max_connections, header_timeout, body_timeout, default_temperature, default_top_p, default_top_k,
          default_seed, loras, **engine_opts):
    import os

    given = list(models) + list(model_flags)
    if len(set(given)) != len(given):
        raise click.UsageError("give each model once (as MODEL or as -m/--model)")
    several = len(given) > 1 or models_dir is not None
    if not given and not models_dir:
        raise click.UsageError("give a MODEL (or several, or --models-dir DIR)")
    if several and engine_opts.get("distributed"):
        raise click.UsageError("--distributed serves one model; give one MODEL")
    if not several and (idle_ttl or pins or max_memory_gb):
        raise click.UsageError("--idle-ttl, --pin and --max-memory-gb are for several models (MODEL MODEL ... or "
                               "--models-dir); one model stays loaded")
    model = given[0] if given else None
    adapters = _lora_pairs(loras, {*served_model_names, *given, *([_model_name(model)] if model else [])})
    if adapters and not given:
        raise click.UsageError("--lora adapts the first MODEL; give one")
    try:
        from macinfer.server.app import run_server
        from macinfer.server.middleware import allowed_host_names
        from macinfer.server.net import bind_socket
    except ImportError as e:
        raise click.ClickException(f"the server needs its extra: pip install 'macinfer[server]' ({e.name} missing)") from None
    # Before the model loads: a busy port fails in a second. Over several ranks only rank 0
    # serves (mlx.launch numbers the ranks in MLX_RANK); the others never reach run_server.
    worker = engine_opts.get("distributed") and os.environ.get("MLX_RANK", "0") != "0"
    try:
        sock = None if worker else bind_socket(host, port)
    except OSError as e:
        raise click.ClickException(str(e)) from None
    if engine_opts["max_prefill_with_decodes"] is None:
        engine_opts["max_prefill_with_decodes"] = SERVE_PREFILL_WITH_DECODES
    names = list(served_model_names) or ([_model_name(model)] if model else [])
    if several:
        engine, name = _model_pool(given, models_dir, hf_cache, idle_ttl, pins, max_memory_gb, names, engine_opts,
                                   adapters), None
    else:
        engine, name = _load_engine(model, **engine_opts), names[0]
        _load_loras(engine, adapters)
    hosts = allowed_host_names(host, tuple(allowed_hosts))
    code = run_server(engine, name, sock, header_timeout=header_timeout, max_connections=max_connections,
                      log_requests=logging.getLogger().level <= logging.INFO, api_keys=list(api_keys),
                      cors_origins=list(cors_origins), max_queue=max_queue, max_body_bytes=int(max_body_mb * 2**20),
                      allowed_hosts=hosts, cache_isolation=cache_isolation, model_aliases=(model, *names[1:]),
                      webui=not no_webui, tool_parser=tool_call_parser, body_timeout=body_timeout,
                      default_max_tokens=max_tokens_default, allow_image_urls=allow_image_urls,
                      sampling_defaults={k: v for k, v in (("temperature", default_temperature), ("top_p", default_top_p),
                                                           ("top_k", default_top_k), ("seed", default_seed))
                                         if v is not None})
    sys.exit(code)


def _model_name(ref: str) -> str:
    import os

    return os.path.basename(ref.rstrip("/")).removesuffix(".gguf")


def _model_pool(given, models_dir, hf_cache, idle_ttl, pins, max_memory_gb, names, engine_opts, adapters=None):
    """The models of a multi-model server: MODELs first (the first loaded now, named by
    --served-model-name), then --models-dir's and the Hugging Face cache's."""
    import os

    from macinfer.engine.llm_engine import LLMEngine
    from macinfer.kernels.backend import Backend
    from macinfer.loading.loader import ModelNotFoundError, resolve
    from macinfer.server.model_pool import ModelPool
    from macinfer.server.model_sources import ModelSource, discover, disk_bytes, unique

    sources = []
    for i, ref in enumerate(given):
        name = names[0] if i == 0 and names else _model_name(ref)
        aliases = tuple(names[1:]) + (ref,) if i == 0 else (ref,)
        local = ref in ("smollm2", "bundled") or os.path.exists(os.path.expanduser(ref))
        try:
            path = resolve(ref) if local else ref
        except ModelNotFoundError as e:
            raise click.ClickException(str(e)) from None
        sources.append(ModelSource(name, path, aliases, disk_bytes=disk_bytes(path) if local else 0,
                                   loras=dict(adapters or {}) if i == 0 else {}))
    try:
        sources = unique(sources + discover(models_dir, hf_cache))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if not sources:
        raise click.ClickException(f"no servable model in {models_dir}" + (" or the Hugging Face cache" if hf_cache else ""))
    by_name = {n: s for s in sources for n in s.names}
    for pin in pins:
        if pin not in by_name:
            raise click.ClickException(f"--pin {pin}: no such model (served: {', '.join(s.name for s in sources)})")
        by_name[pin].pinned = True
    budget = int(max_memory_gb * 2**30) if max_memory_gb else Backend.detect().available_memory()
    def load(src, limit=None):
        shown = [-1]

        def progress(done: int, total: int) -> None:  # a line at each quarter, in the server's log
            quarter = 4 * done // max(total, 1)
            if quarter > shown[0]:
                shown[0] = quarter
                logging.getLogger("macinfer.server").info("loading model %s: %d%%", src.name, 25 * quarter)

        cfg = dataclasses.replace(_engine_config(**engine_opts), memory_limit_bytes=limit)
        if not (given and src is sources[0]):  # --mmproj is the first MODEL's; the others' lie beside them
            cfg = dataclasses.replace(cfg, mmproj=None)
        engine = LLMEngine(src.path, cfg, progress=progress)
        for lora_name, lora_path in src.loras.items():  # its adapters come with it
            engine.load_lora(lora_name, lora_path)
        return engine

    kv = engine_opts.get("kv_cache_gb")
    pool = ModelPool(sources, load, budget_bytes=budget, idle_ttl=idle_ttl, kv_bytes=int(kv * 2**30) if kv else None)
    for src in sources:  # the first MODEL and the pinned ones load now; the others on demand
        if (given and src is sources[0]) or src.pinned:
            pool.preloaded(src.name, _load_loras_into(_load_engine(src.path, **engine_opts), src.loras))
    return pool


def _add_groups() -> None:
    from macinfer.bench.cli import bench
    from macinfer.cli.models import models

    main.add_command(bench)
    main.add_command(models)


_add_groups()


if __name__ == "__main__":
    main()
