"""The options that build an engine, shared by `generate`, `chat`, `serve` and `bench`: the
click options and the `EngineConfig` they fill (mlx-lm's and llama.cpp's spellings turned
into it here, once)."""

from __future__ import annotations

import functools

import click


def _model_help() -> str:
    from macinfer.models import ARCHITECTURES, VERDICTS, VLM_VERDICTS

    lm = sum(v == "runs" for v in VERDICTS.values())
    return ("A .gguf file, an MLX model directory, a Hugging Face repo id (org/Model, org/Model-GGUF:Q4_K_M), "
            f"or 'smollm2' (the bundled test model). {lm} of the {len(VERDICTS)} architectures mlx-lm implements "
            f"run, and {len(ARCHITECTURES) - lm} language models only mlx-vlm implements: "
            + ", ".join(ARCHITECTURES) + " (`macinfer models architectures`: why the others are refused).")


MODEL_HELP = _model_help()


# `serve`'s prompt tokens per step while others decode: a long prompt's chunk stalls
# every stream of its step. Measured on the 2-core CPU (docs/benchmarks.md, mixed load); not yet on Metal,
# where prompt tokens are far cheaper and the cap should cost long prompts little.
SERVE_PREFILL_WITH_DECODES = 128


def engine_options(f):
    """The engine's options (`EngineConfig`'s fields, in the CLI's spellings) on a command."""
    f = click.option("--chat-template", "chat_template", default=None, metavar="FILE|NAME",
                     help="Replace the model's chat template: a Jinja file, inline Jinja, or a built-in "
                          "(chatml, llama3, hermes: ChatML with tools and <tool_call> calls).")(f)
    f = click.option("--block-size", type=click.Choice(["8", "16", "32", "64", "128"]), default=None,
                     help="Tokens a KV block: the prefix cache's unit (default 16; 32 with keys stored per "
                          "channel, whose groups are the block's tokens).")(f)
    f = click.option("--kv-group-size", type=click.Choice(["32", "64", "128"]), default=None,
                     help="Quantized KV: values sharing a scale and bias (default: 8 bits the widest that "
                          "divides the head size, a 128-wide head one group; 3 and 4 bits 64 where it divides "
                          "the head size, else 32).")(f)
    f = click.option("--kv-quant-start", "--quantized-kv-start", "kv_quant_start", type=click.IntRange(min=0),
                     default=0, show_default=True, metavar="N",
                     help="Quantized KV: keep each sequence's first N tokens at full precision in its "
                          "full-attention layers (attention sinks; mlx-lm's spelling accepted, though mlx-lm "
                          "instead quantizes a whole cache once it reaches N tokens).")(f)
    f = click.option("--kv-bits", type=click.Choice(["3", "4", "8"]), default=None,
                     help="mlx-lm's spelling of --kv-cache-dtype int3/int4/int8.")(f)
    f = click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8", "int4", "int3", "int4r", "int3r",
                                                         "int4c", "int3c", "k8v4", "k8v4r"]),
                     default="auto", show_default=True,
                     help="Quantized KV cache (group-wise affine, read in place): int8 about half the memory of fp16, "
                          "int4 about a third, int3 about a quarter; k8v4: 8-bit keys, 4-bit values; a trailing r "
                          "rotates each head's K and V first (Hadamard), which keeps outlier channels from spoiling "
                          "their groups; a trailing c quantizes each key channel over a block's tokens (blocks of "
                          "32), the best quality at 4 and 3 bits.")(f)
    f = click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True, help="Reuse KV blocks of repeated prompt prefixes.")(f)
    f = click.option("--kv-cache-gb", type=click.FloatRange(min=0, min_open=True), default=None, help="KV cache budget in GiB (default: a share of free memory).")(f)
    f = click.option("--kv-disk-gb", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Keep the prefix cache on disk too, up to this many GiB: evicted blocks are written by a "
                          "background thread and found again, also after a restart (default: off).")(f)
    f = click.option("--kv-disk-dir", type=click.Path(file_okay=False), default=None,
                     help="Where --kv-disk-gb keeps its files (default: ~/.cache/macinfer/kv; delete it to clear).")(f)
    f = click.option("--max-num-seqs", type=click.IntRange(min=1), default=32, show_default=True, help="Most sequences in one batch.")(f)
    f = click.option("--max-model-len", "-c", "--ctx-size", "max_model_len", type=click.IntRange(min=2), default=None,
                     help="Cap the context length (-c/--ctx-size: llama.cpp's names).")(f)
    f = click.option("--rope-scaling", type=click.Choice(["yarn", "linear"]), default=None,
                     help="Stretch RoPE from the model's trained context to --max-model-len (YaRN or linear "
                          "position interpolation), as llama.cpp's --rope-scaling does.")(f)
    f = click.option("--distributed", type=click.Choice(["pipeline", "tensor"]), default=None,
                     help="Run over the ranks mlx.launch started (one per Mac): pipeline (layers split, any "
                          "model) or tensor (heads split, models with an mlx-lm shard()). Rank 0 serves.")(f)
    f = click.option("--no-autotune", "no_autotune", is_flag=True,
                     help="Skip timing the paths a decision may take at load (Metal kernels or MLX's ops, explicit "
                          "or fused attention, MLA's prompt form); take the defaults. Verdicts are cached per "
                          "device in ~/.cache/macinfer/autotune.json.")(f)
    f = click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True,
                     help="Build the next decode step's graph while this one computes (vLLM's async "
                          "scheduling); off: one step at a time.")(f)
    f = click.option("--pipeline-micro-batches", type=click.IntRange(min=1), default=1, show_default=True,
                     help="--distributed pipeline: run a step's sequences as this many micro-batches, so the "
                          "ranks' stages overlap. Measured with a device per rank, it loses in decode (each "
                          "micro-batch reads the weights again; docs/distributed.md).")(f)
    f = click.option("--pipeline-depth", type=click.IntRange(1, 2), default=None,
                     help="--distributed pipeline: steps in flight at once. 2 (the default): the sequences "
                          "alternate between two steps, so one rank computes a step while the next takes the "
                          "other; 1: a step passes through the ranks in turn (the default with recurrent state "
                          "or micro-batches).")(f)
    f = click.option("--distributed-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
                     help="Seconds a step may wait on the other ranks before the run ends with an error "
                          "(a rank that hangs); a rank that dies ends it at once.")(f)
    f = click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=512, show_default=True,
                     help="Tokens per step (prompts are prefilled in chunks of at most this).")(f)
    f = click.option("--num-speculative-tokens", type=click.IntRange(0, 16), default=0, show_default=True,
                     help="Speculative decoding: draft tokens checked per step while few requests decode (up to a "
                          "batch size measured on the device at load) "
                          "(0: off). Same output. Drafts come from prompt lookup (faster when answers repeat "
                          "their input: edits, quotes, code), from --draft-model, or from the checkpoint's own "
                          "MTP head (--speculative-method mtp).")(f)
    f = click.option("--prompt-lookup-first", is_flag=True, default=False,
                     help="With a drafter (--draft-model, --speculative-method mtp): take prompt lookup's drafts "
                          "where the answer repeats its input, the drafter's only where lookup finds nothing.")(f)
    f = click.option("--speculative-method", type=click.Choice(["ngram", "draft", "eagle3", "mtp"]), default=None,
                     help="Who drafts: ngram (prompt lookup), draft or eagle3 (--draft-model) or mtp (the multi-token "
                          "prediction head Qwen3.5/3.6, Qwen3-Next, DeepSeek V3 and GLM-4.5 checkpoints ship). "
                          "Default: draft with --draft-model, else ngram.")(f)
    f = click.option("--draft-model", default=None, metavar="MODEL",
                     help="A small model of the same tokenizer that drafts the --num-speculative-tokens tokens "
                          "(any model macinfer runs, GGUF included), an EAGLE-3 head trained for the model, or "
                          "Gemma 4's assistant drafter or a DFlash drafter, "
                          "instead of prompt lookup.")(f)
    f = click.option("--mmproj", default=None, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
                     help="A GGUF model's vision projector (llama.cpp's mmproj-*.gguf), for images (default: the "
                          "one mmproj*.gguf beside the model file, if any).")(f)
    f = click.option("--max-loras", type=click.IntRange(min=1), default=8, show_default=True,
                     help="LoRA adapters loaded at once; loading one more evicts the least recently used idle one.")(f)
    f = click.option("--max-prefill-with-decodes", type=click.IntRange(min=0), default=None,
                     help=f"Prompt tokens per step while other requests are decoding, shortest prompt first "
                          f"(default: {SERVE_PREFILL_WITH_DECODES} for `serve`, no separate cap otherwise; 0: no cap). "
                          "Lower: smoother streaming under load, slower first tokens of long prompts.")(f)
    return f


def model_argument(f):
    """MODEL as the first argument, or as `-m/--model` (llama.cpp's habit): one of the two."""
    @functools.wraps(f)
    def command(*args, model=None, model_flag=None, **kwargs):
        if (model is None) == (model_flag is None):
            raise click.UsageError("give the model once: as MODEL or as -m/--model")
        return f(*args, model=model or model_flag, **kwargs)

    command = click.option("-m", "--model", "model_flag", default=None, metavar="MODEL",
                           help="MODEL as an option, as llama.cpp's tools take it.")(command)
    return click.argument("model", required=False)(command)


def sampling_options(f):
    f = click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")(f)
    f = click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0: off).")(f)
    f = click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass.")(f)
    f = click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=256, show_default=True, help="Most tokens to generate.")(f)
    f = click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 is greedy.")(f)
    return f


def engine_config(*, kv_cache_gb=None, max_num_seqs=32, max_model_len=None, prefix_caching=True,
                   kv_cache_dtype="auto", kv_bits=None, kv_group_size=None, kv_quant_start=0, block_size=None,
                   max_num_batched_tokens=512,
                   max_prefill_with_decodes=None,
                   num_speculative_tokens=0, draft_model=None, speculative_method=None, prompt_lookup_first=False,
                   chat_template=None, rope_scaling=None, distributed=None,
                   distributed_timeout=60.0, pipeline_micro_batches=1, pipeline_depth=None, no_autotune=False,
                   kv_disk_gb=None, kv_disk_dir=None, async_scheduling=True, max_loras=8, mmproj=None):
    from macinfer.engine.llm_engine import EngineConfig

    if kv_bits is not None:
        if kv_cache_dtype not in ("auto", f"int{kv_bits}"):
            raise click.UsageError(f"--kv-bits {kv_bits} and --kv-cache-dtype {kv_cache_dtype} disagree; give one")
        kv_cache_dtype = f"int{kv_bits}"
    return EngineConfig(max_num_seqs=max_num_seqs, kv_cache_gb=kv_cache_gb, max_model_len=max_model_len,
                        enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype,
                        kv_group_size=int(kv_group_size) if kv_group_size else None,
                        kv_quant_start=kv_quant_start, block_size=int(block_size) if block_size else None,
                        max_num_batched_tokens=max_num_batched_tokens,
                        max_prefill_with_decodes=max_prefill_with_decodes or None,  # 0: no separate cap
                        num_speculative_tokens=num_speculative_tokens, draft_model=draft_model,
                        speculative_method=speculative_method, prompt_lookup_first=prompt_lookup_first,
                        chat_template=chat_template, rope_scaling=rope_scaling,
                        distributed=distributed, distributed_timeout=distributed_timeout,
                        pipeline_micro_batches=pipeline_micro_batches, pipeline_depth=pipeline_depth,
                        autotune=not no_autotune,
                        kv_disk_gb=kv_disk_gb, kv_disk_dir=kv_disk_dir, async_scheduling=async_scheduling,
                        max_loras=max_loras, mmproj=mmproj)
