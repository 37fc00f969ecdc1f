"""`macinfer` command line: generate, chat, convert, serve."""

from __future__ import annotations

import logging
import sys
import time

import click

from macinfer import __version__

MODEL_HELP = "A .gguf file, an MLX model directory, a Hugging Face repo id, or 'smollm2' (the bundled test model)."


def _engine_options(f):
    f = click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8"]), default="auto", show_default=True, help="int8: 8-bit affine KV cache (about half the memory of fp16).")(f)
    f = click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True, help="Reuse KV blocks of repeated prompt prefixes.")(f)
    f = click.option("--kv-cache-gb", type=click.FloatRange(min=0, min_open=True), default=None, help="KV cache budget in GiB (default: a share of free memory).")(f)
    f = click.option("--max-num-seqs", type=click.IntRange(min=1), default=32, show_default=True, help="Most sequences in one batch.")(f)
    f = click.option("--max-model-len", type=click.IntRange(min=2), default=None, help="Cap the context length.")(f)
    return f


def _sampling_options(f):
    f = click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")(f)
    f = click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0: off).")(f)
    f = click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass.")(f)
    f = click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=256, show_default=True, help="Most tokens to generate.")(f)
    f = click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 is greedy.")(f)
    return f


def _load_engine(model: str, kv_cache_gb, max_num_seqs, max_model_len, prefix_caching=True, kv_cache_dtype="auto"):
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine

    try:
        return LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, kv_cache_gb=kv_cache_gb, max_model_len=max_model_len,
                                             enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype))
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _params(temperature, max_tokens, top_p, top_k, seed):
    from macinfer.sampling_params import SamplingParams

    try:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, top_p=top_p, top_k=top_k, seed=seed)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _stream(engine, prompt, params) -> tuple[str, int, float, float]:
    """Print tokens as they come; returns (text, tokens, ttft, total seconds)."""
    from macinfer.engine.llm_engine import PromptTooLongError

    start = time.perf_counter()
    try:
        rid = engine.add_request(prompt, params)
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
def main(verbose: bool) -> None:
    """macinfer: run open LLMs locally on Apple Silicon (MLX)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command(help="Generate a completion for one prompt, streamed to stdout.\n\nMODEL: " + MODEL_HELP)
@click.argument("model")
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--chat-template/--no-chat-template", default=True, show_default=True, help="Wrap the prompt as a user message in the model's chat template.")
@_sampling_options
@_engine_options
def generate(model, prompt, chat_template, temperature, max_tokens, top_p, top_k, seed, kv_cache_gb, max_num_seqs, max_model_len, prefix_caching, kv_cache_dtype):
    if prompt == "-":
        prompt = sys.stdin.read()
    params = _params(temperature, max_tokens, top_p, top_k, seed)
    engine = _load_engine(model, kv_cache_gb, max_num_seqs, max_model_len, prefix_caching, kv_cache_dtype)
    if chat_template and engine.tokenizer.chat_template:
        try:
            prompt = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    _, ntok, ttft, total = _stream(engine, prompt, params)
    decode = (ntok - 1) / (total - ttft) if ntok > 1 and total > ttft else 0.0
    click.echo(f"[{ntok} tokens, TTFT {ttft:.2f}s, decode {decode:.1f} tok/s]", err=True)


@main.command(help="Interactive chat in the terminal (Ctrl-D or /exit quits, /reset clears).\n\nMODEL: " + MODEL_HELP)
@click.argument("model")
@click.option("--system", default=None, help="System prompt.")
@_sampling_options
@_engine_options
def chat(model, system, temperature, max_tokens, top_p, top_k, seed, kv_cache_gb, max_num_seqs, max_model_len, prefix_caching, kv_cache_dtype):
    params = _params(temperature, max_tokens, top_p, top_k, seed)
    engine = _load_engine(model, kv_cache_gb, max_num_seqs, max_model_len, prefix_caching, kv_cache_dtype)
    if not engine.tokenizer.chat_template:
        raise click.ClickException("this model has no chat template; use `macinfer generate --no-chat-template`")
    history = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt = engine.tokenizer.encode_chat(history)
        except ValueError as e:
            click.echo(f"error: {e}", err=True)
            history.pop()
            continue
        text, *_ = _stream(engine, prompt, params)
        history.append({"role": "assistant", "content": text})


@main.command()
@click.argument("gguf", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def convert(gguf, out_dir):
    """Convert a GGUF file to an MLX model directory (loads in mlx-lm too)."""
    from macinfer.convert import convert_gguf

    try:
        convert_gguf(gguf, out_dir)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out_dir}")


@main.command(help="Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).\n\nMODEL: " + MODEL_HELP)
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--served-model-name", default=None, help="Model id clients send (default: MODEL).")
@click.option("--api-key", default=None, envvar="MACINFER_API_KEY", help="Require 'Authorization: Bearer KEY' on every endpoint but /health.")
@click.option("--cors-origin", "cors_origins", multiple=True, help="Allow browser requests from this origin (repeatable). No CORS unless given.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True, help="Requests waiting beyond --max-num-seqs before answering 429.")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True, help="Largest request body accepted (413 beyond).")
@_engine_options
def serve(model, host, port, served_model_name, api_key, cors_origins, max_queue, max_body_mb, kv_cache_gb, max_num_seqs, max_model_len, prefix_caching, kv_cache_dtype):
    try:
        from macinfer.server.app import run_server
    except ImportError as e:
        raise click.ClickException(f"the server needs its extra: pip install 'macinfer[server]' ({e.name} missing)") from None
    engine = _load_engine(model, kv_cache_gb, max_num_seqs, max_model_len, prefix_caching, kv_cache_dtype)
    run_server(engine, served_model_name or model, host, port, api_key=api_key, cors_origins=list(cors_origins),
               max_queue=max_queue, max_body_bytes=int(max_body_mb * 2**20))


if __name__ == "__main__":
    main()
