"""The engine's settings: decided once, at load, and carried from there (the CLI's
engine options and `LLM(**kwargs)` fill it)."""

from __future__ import annotations

from dataclasses import dataclass

from macinfer.kv.cache import CHANNEL_KEYS, DEFAULT_BLOCK_SIZE


@dataclass
class EngineConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    # Prefill tokens per step while sequences decode (None: the whole budget); bounds the
    # inter-token latency a long prompt inflicts on decoding streams.
    max_prefill_with_decodes: int | None = None
    max_model_len: int | None = None  # default: the model's context length
    block_size: int | None = None  # tokens a KV block (None: 16; 32 for keys stored per channel)
    kv_cache_gb: float | None = None  # explicit KV budget in GiB
    kv_cache_fraction: float = 0.3  # else: this share of free memory after weights
    num_kv_blocks: int | None = None  # else: exactly this many full-attention blocks (tests, tuning)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto": the model's activation dtype; "int8" | "int4" | "int3": N-bit affine
    kv_group_size: int | None = None  # quantized KV: values per scale and bias (None: 64, else 32)
    # Quantized KV: each sequence's first this many tokens kept at full precision in the
    # full-attention caches (0: none; `kv.spec.FirstTokens`).
    kv_quant_start: int = 0
    model_impl: str = "auto"  # "mlx-lm": run even the Llama family through mlx-lm's classes
    # Speculative decoding (0: off): draft tokens per decode step, prompt lookup's
    # n-gram lengths looked up, and the decoding batch above which it pauses (None:
    # measured on the device at load, `engine/spec_batch.py`).
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # With a drafter: prompt lookup first, the drafter only for the sequences it finds nothing for.
    prompt_lookup_first: bool = False
    speculative_max_batch: int | None = None
    # Who drafts: "ngram" (prompt lookup), "draft" (a draft model of the same tokenizer,
    # `engine/drafter.py`) or "mtp" (the checkpoint's own MTP head, `engine/mtp_drafter.py`).
    # None: "draft" when a draft model is named, else "ngram".
    speculative_method: str | None = None
    draft_model: str | None = None
    # Recurrent layers (hybrid models): tokens between state snapshots kept for the prefix
    # cache (None: where a snapshot costs about the K/V of the tokens it spans, 256 to 4096).
    state_snapshot_interval: int | None = None
    # Replaces the model's chat template: a Jinja file, inline Jinja, or a built-in name
    # (`macinfer.text.chat_templates`: chatml, llama3, hermes).
    chat_template: str | None = None
    # Stretch RoPE ("yarn" or "linear") so max_model_len may exceed the trained context.
    rope_scaling: str | None = None
    # Several ranks under mlx.launch ("pipeline" or "tensor"; `macinfer/distributed/`), and
    # how long a collective may take before the group is declared hung.
    distributed: str | None = None
    distributed_timeout: float = 60.0
    pipeline_micro_batches: int = 1  # pipeline mode: a step's sequences in this many overlapping forwards
    # Pipeline mode: steps in flight at once. 2: the running sequences alternate between two
    # steps, a stage computing one while the next takes the other (the bubble filled);
    # 1: one step passes through every rank in turn (docs/distributed.md). None: 2 where it
    # applies (no recurrent state, no micro-batches), else 1.
    pipeline_depth: int | None = None
    # Time the paths a decision may take at load (cached per device); False: the defaults.
    autotune: bool = True
    # The prefix cache's disk tier (`engine/disk_cache.py`): its size in GiB (None: off) and
    # directory (None: ~/.cache/macinfer/kv).
    kv_disk_gb: float | None = None
    kv_disk_dir: str | None = None
    # The most this engine may hold, weights and KV together (None: what the device gives).
    # A multi-model server sets it to the room its memory budget leaves (`model_pool.py`).
    memory_limit_bytes: int | None = None
    # LoRA adapters (`macinfer/lora/`): the most loaded at once (the idle ones evicted first).
    max_loras: int = 8
    # Build the next decode step's graph while this one computes (`engine/lookahead.py`).
    async_scheduling: bool = True
    # A vision checkpoint's image path (`macinfer/vision/`): loaded when its family runs
    # (False: served text-only), with this much memory for encoded images kept by content.
    images: bool = True
    encoder_cache_mb: int = 256
    # A GGUF model's vision projector (llama.cpp's mmproj file; None: the one beside the model, if any).
    mmproj: str | None = None

    def __post_init__(self) -> None:
        if self.block_size is None:
            self.block_size = 32 if self.kv_cache_dtype in CHANNEL_KEYS else DEFAULT_BLOCK_SIZE

    def validate(self) -> None:
        """A ValueError a user can act on for settings that cannot work together (the
        model-dependent checks come at load)."""
        if self.max_prefill_with_decodes is not None and self.max_prefill_with_decodes < 1:
            # 0 would hold every prompt back while anything decodes
            raise ValueError("max_prefill_with_decodes must be at least 1 (None: no separate cap)")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be 0 (off) or more")
        if self.rope_scaling and not self.max_model_len:
            raise ValueError("--rope-scaling needs --max-model-len: the context to stretch RoPE to")
        if self.kv_quant_start < 0:
            raise ValueError("--kv-quant-start must be 0 (off) or more")
        if self.kv_quant_start and self.kv_cache_dtype == "auto":
            raise ValueError("--kv-quant-start keeps a quantized KV cache's first tokens at full precision; "
                             "give --kv-cache-dtype int8/int4/... with it")
        if self.pipeline_micro_batches != 1 and self.distributed != "pipeline":
            raise ValueError("--pipeline-micro-batches applies to --distributed pipeline only")
        if self.pipeline_depth is not None:
            if self.distributed != "pipeline":
                raise ValueError("--pipeline-depth applies to --distributed pipeline only")
            if self.pipeline_depth not in (1, 2):
                raise ValueError(f"--pipeline-depth {self.pipeline_depth}: 1 (one step at a time) or 2 "
                                 "(two in flight)")
            if self.pipeline_depth == 2 and self.pipeline_micro_batches != 1:
                raise ValueError("--pipeline-depth 2 and --pipeline-micro-batches are two ways to overlap the "
                                 "stages; choose one")
