"""llama.cpp's architectures in GGUF -> Hugging Face / mlx-lm configs and tensor names.

Each architecture maps its `{arch}.*` metadata onto the config fields the
model class reads, and its `blk.N.*` tensor names onto mlx-lm's parameter
names. Conversions llama.cpp's converter applied are undone here: Q/K rows
permuted for the llama arch (see `load.py`), and Gemma's norm weights stored
as (1 + w).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import mlx.core as mx

from macinfer.gguf.file import ModelLoadError

# llama.cpp block tensor name -> HF/mlx-lm name under model.layers.N
_COMMON = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GEMMA = {**_COMMON, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
_MOE = {**_COMMON, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
        "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj"}
_PHI3 = {**_COMMON, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# GLM-4-0414: a norm after attention and after the MLP (sandwich), gate and up fused
_GLM4 = {**_COMMON, "ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
         "post_ffw_norm": "post_mlp_layernorm"}
# OLMo 2: norms after attention and after the MLP only, query/key norms over all heads
_OLMO2 = {**_COMMON, "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# StarCoder2: LayerNorms with biases, a plain GELU MLP
_STARCODER2 = {**_COMMON, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# Hunyuan: query/key norms under their own names
_HUNYUAN = {**_COMMON, "attn_q_norm": "self_attn.query_layernorm", "attn_k_norm": "self_attn.key_layernorm"}
# Seed-OSS: llama.cpp names its pre-MLP norm `post_attention_norm`
_SEED_OSS = {**_COMMON, "post_attention_norm": "post_attention_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _base(get: Callable, meta: dict[str, Any]) -> dict[str, Any]:
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length", 0)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
    }


def _qwen3moe(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    moe = int(get("expert_feed_forward_length"))
    return {"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": moe, "intermediate_size": int(get("feed_forward_length", 0)) or moe,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


def _gemma2(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # GGUF does not store query_pre_attn_scalar; llama.cpp scales by 1/sqrt(head_dim) as this does.
    # Even layers slide, as in llama.cpp and transformers (the adapter's `config_windows`).
    return {"query_pre_attn_scalar": float(int(get("attention.key_length"))),
            "attn_logit_softcapping": float(get("attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": float(get("final_logit_softcapping", 30.0)),
            "sliding_window": int(get("attention.sliding_window", 4096))}


def _gemma3(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # llama.cpp fixes Gemma 3's pattern (every 6th layer global) and local RoPE base (10k).
    return {"query_pre_attn_scalar": float(int(get("attention.key_length"))),
            "sliding_window": int(get("attention.sliding_window", 512)), "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0}


def _phi3(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    head_dim = int(get("attention.key_length", int(get("embedding_length")) // int(get("attention.head_count"))))
    rot = int(get("rope.dimension_count", head_dim))
    window = int(get("attention.sliding_window", 0))  # llama.cpp windows every layer when set
    return {"partial_rotary_factor": rot / head_dim, **({"sliding_window": window} if window else {})}


def _qwen2vl(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # Qwen2/2.5/3-VL's language model: Qwen2's (Qwen3's) whose RoPE turns by (time, height, width)
    # sections over an image's positions (installed with a vision projector file, `gguf/mmproj.py`,
    # `engine/images.py`); over text the three positions are equal and it is plain RoPE.
    sections = [int(x) for x in get("rope.dimension_sections", [])]
    return {"mrope_section": [s for s in sections if s]} if any(sections) else {}


def _glm4(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # GLM-4-0414 (`glm4`): RoPE on the first `rope.dimension_count` of each head, in pairs
    # (llama.cpp's "norm" rope, mlx-lm's traditional; the converter keeps Q/K rows as they are);
    # Q/K/V biases where the file holds them. GLM-4.1V's language model (the same arch with
    # M-RoPE sections): its Q/K rows were turned NeoX-wise by the converter (`pairs_from_neox`).
    head_dim = int(get("attention.key_length", int(get("embedding_length")) // int(get("attention.head_count"))))
    return {"partial_rotary_factor": int(get("rope.dimension_count", head_dim // 2)) / head_dim,
            "rope_traditional": True, "attention_bias": "blk.0.attn_q.bias" in names, **_qwen2vl(get, meta)}


def pairs_from_neox(w: mx.array, n_heads: int, rotated: int) -> mx.array:
    """Undo llama.cpp's GLM-4.1V Q/K permutation: each head's first `rotated` rows put in
    NeoX order (the even rows, then the odd ones) back into pairs (rows only, as for
    `unpermute_rows`: weights, scales, biases alike)."""
    head = w.reshape(n_heads, w.shape[0] // n_heads, *w.shape[1:])
    half = rotated // 2
    pairs = mx.stack([head[:, :half], head[:, half:rotated]], axis=2).reshape(n_heads, rotated, *w.shape[1:])
    return mx.concatenate([pairs, head[:, rotated:]], axis=1).reshape(w.shape)


def _granite(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # Granite 3.x: Llama's layers (its converter is Llama's: Q/K rows permuted) with four scales
    return {"attention_multiplier": float(get("attention.scale")), "embedding_multiplier": float(get("embedding_scale")),
            "residual_multiplier": float(get("residual_scale")), "logits_scaling": float(get("logit_scale")),
            "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": "blk.0.ffn_up.bias" in names}


def _command_r(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # Command R: one LayerNorm before attention and MLP in parallel, pairwise RoPE (llama.cpp's
    # "norm" rope, no row permutation), its logit scale; query/key norms where held (R+)
    return {"layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
            "logit_scale": float(get("logit_scale", 0.0625)), "attention_bias": "blk.0.attn_q.bias" in names,
            "layer_norm_bias": "blk.0.attn_norm.bias" in names, "use_qk_norm": "blk.0.attn_q_norm.weight" in names}


def _cohere2(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # Command R7B / Command A: Command R's layers, three sliding layers (RoPE) to one global
    # (no positions); llama.cpp fixes the pattern at 4
    return {**_command_r(get, meta, names), "sliding_window": int(get("attention.sliding_window")),
            "sliding_window_pattern": 4}


def _olmo2(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # OLMo 3 is converted as `olmo2` with a window: sliding layers as its pattern marks them (three
    # in four, the converter's default), which mlx-lm's `olmo3` class runs (RoPE scaling, where the
    # file has it, on the global layers only, as transformers' Olmo 3)
    window = get("attention.sliding_window", 0)
    if not window:
        return {}
    n = int(get("block_count"))
    pattern = get("attention.sliding_window_pattern", [(i + 1) % 4 != 0 for i in range(n)])
    pattern = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern)]
    return {"model_type": "olmo3", "sliding_window": int(window),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in pattern[:n]]}


def _exaone4(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # EXAONE 4.0: norms after attention and after the MLP, query/key norms; where the file has a
    # window, its sliding layers (RoPE) as the pattern marks them, the others global without RoPE.
    # Llama 3 RoPE scaling, where held, comes back from `rope_freqs` (`tensor_config.from_tensors`).
    window = get("attention.sliding_window", 0)
    n = int(get("block_count"))
    pattern = get("attention.sliding_window_pattern", [])
    pattern = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern)][:n]
    if window and len(pattern) != n:
        raise ModelLoadError("exaone4 GGUF: a window without attention.sliding_window_pattern marking every layer")
    return {"sliding_window": int(window) or None, "rope_scaling": None,
            "sliding_window_pattern": "".join("L" if s else "G" for s in pattern) if window else None}


def _mistral3(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # Ministral 3 (`mistral3`): Llama's layers (Q/K rows permuted by its converter) under YaRN, whose
    # mscale the converter writes as the log multiplier (the attention's taken as equal, as its
    # configs set both), and Llama 4's query temperature past the original context
    if get("rope.scaling.type", "none") != "yarn":
        raise ModelLoadError("mistral3 GGUF without YaRN RoPE scaling: not Ministral 3's form")
    mscale = float(get("rope.scaling.yarn_log_multiplier", 1.0))
    return {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": float(get("rope.freq_base")), "factor": float(get("rope.scaling.factor")),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)), "mscale": mscale, "mscale_all_dim": mscale,
        "llama_4_scaling_beta": float(get("attention.temperature_scale", 0.0))}}


def _hunyuan_dense(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # Hunyuan dense (`hunyuan-dense`): NeoX RoPE whose NTK alpha the converter folds into the base
    # (so the file's base is the one to turn by), query/key norms after it, biases where held
    return {"use_qk_norm": "blk.0.attn_q_norm.weight" in names, "attention_bias": "blk.0.attn_q.bias" in names,
            "rope_scaling": None}


def _seed_oss(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # Seed-OSS: Q/K/V biases (and an output bias) where the file holds them; Q/K rows as they are
    return {"attention_bias": "blk.0.attn_q.bias" in names, "attention_out_bias": "blk.0.attn_output.bias" in names}


def _starcoder2(get: Callable, meta: dict[str, Any], names: frozenset = frozenset()) -> dict[str, Any]:
    # LayerNorm's epsilon (llama.cpp keeps no sliding window for it, as mlx-lm applies none)
    return {"norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5))}


# arch -> (model_type, tensor names, extra config, norms stored as 1 + w, Q/K rows permuted)
ARCHS: dict[str, tuple[str, dict[str, str], Callable | None, bool, bool]] = {
    "llama": ("llama", _COMMON, None, False, True),
    "mistral": ("llama", _COMMON, None, False, True),
    "qwen2": ("qwen2", _COMMON, None, False, False),
    "qwen2vl": ("qwen2", _COMMON, _qwen2vl, False, False),
    "qwen3": ("qwen3", _COMMON, None, False, False),
    "qwen3vl": ("qwen3", _COMMON, _qwen2vl, False, False),  # (Qwen3-VL's: Qwen3 with M-RoPE sections too)
    "qwen3moe": ("qwen3_moe", _MOE, _qwen3moe, False, False),
    "qwen3vlmoe": ("qwen3_moe", _MOE, lambda get, meta, names: {**_qwen3moe(get, meta), **_qwen2vl(get, meta)},
                   False, False),
    "gemma2": ("gemma2", _GEMMA, _gemma2, True, False),
    "gemma3": ("gemma3_text", _GEMMA, _gemma3, True, False),
    "phi3": ("phi3", _PHI3, _phi3, False, False),
    "glm4": ("glm4", _GLM4, _glm4, False, False),
    "gemma": ("gemma", _COMMON, None, True, False),  # (Gemma 1)
    "olmo2": ("olmo2", _OLMO2, _olmo2, False, False),  # (and OLMo 3: `olmo3` where the file has a window)
    "smollm3": ("smollm3", _COMMON, None, False, True),  # (llama.cpp's fixed NoPE every fourth layer: mlx-lm's too)
    "seed_oss": ("seed_oss", _SEED_OSS, _seed_oss, False, False),
    "exaone4": ("exaone4", _OLMO2, _exaone4, False, False),
    "mistral3": ("ministral3", _COMMON, _mistral3, False, True),  # (Ministral 3)
    "hunyuan-dense": ("hunyuan_v1_dense", _HUNYUAN, _hunyuan_dense, False, False),
    "starcoder2": ("starcoder2", _STARCODER2, _starcoder2, False, False),
    "granite": ("granite", _COMMON, _granite, False, True),
    "command-r": ("cohere", _COMMON, _command_r, False, False),
    "cohere2": ("cohere2", _COMMON, _cohere2, False, False),
}


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (HF half-split RoPE -> interleaved).

    Rows are output features; quantization groups run along columns, so the
    same row permutation applies to weight, scales and biases alike.
    """
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def config_for(arch: str, meta: dict[str, Any], scalar: Callable[[Any], Any],
               names: frozenset = frozenset()) -> dict[str, Any]:
    """The HF-style config of one of these architectures from GGUF metadata (and the file's
    tensor names, where a config field is told by which tensors it holds)."""

    def get(key: str, default: Any = None) -> Any:
        value = scalar(meta.get(f"{arch}.{key}", default))
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    model_type, _, extra, _, _ = ARCHS[arch]
    config = {"model_type": model_type, **_base(get, meta)}
    if extra is not None:
        config.update(extra(get, meta, frozenset(names)))
    return config


def hf_name(arch: str, name: str) -> str | None:
    """mlx-lm's name for a GGUF tensor (None: not a model weight, e.g. rope_freqs)."""
    names = ARCHS[arch][1]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)", name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    m = re.fullmatch(r"(\w+)\.(weight|bias|scales|biases)", name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    return None


def norms_stored_plus_one(arch: str) -> bool:
    return arch in ARCHS and ARCHS[arch][3]


def qk_permuted(arch: str) -> bool:
    return arch in ARCHS and ARCHS[arch][4]


def qk_rows_undone(arch: str, config: dict[str, Any]) -> Callable[[mx.array, int], mx.array] | None:
    """How to put back the Q/K rows llama.cpp's converter reordered for this architecture
    ((rows, heads) -> rows), or None where it stored them as they are: Llama's interleaved
    RoPE rows, GLM-4.1V's rotated rows turned NeoX-wise for its M-RoPE."""
    if qk_permuted(arch):
        return unpermute_rows
    if arch == "glm4" and config.get("mrope_section"):
        rotated = int(config["head_dim"] * config["partial_rotary_factor"])
        return lambda w, n: pairs_from_neox(w, n, rotated)
    return None
