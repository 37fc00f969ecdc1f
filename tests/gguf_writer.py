"""GGUF files written by the tests with llama.cpp's own `gguf` package: the
llama layout (Q/K rows permuted as its converter does), any metadata, and
K-quant tensors made of random blocks laid out by the format's definition
(the package cannot quantize K types, but every byte pattern is a valid block
once the f16 scales are set)."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from mlx.utils import tree_flatten

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}

# Byte offsets of the f16 super-block scales (d, and dmin where the type has one).
_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF half-split RoPE rows -> llama.cpp's interleaved order."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(qtype: Q, rows: int, cols: int, rng: np.random.Generator, scale: float = 2e-4) -> np.ndarray:
    """Raw bytes [rows, cols/256 * type_size] of valid `qtype` blocks with small values."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
    d = (rng.random((rows, cols // block)) * scale + scale / 4).astype(np.float16)
    for off in _SCALE_OFFSETS[qtype]:
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def llama_tensors(config: dict, model) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors of an mlx-lm llama model."""
    tensors = {}
    for name, w in tree_flatten(model.parameters()):
        w = np.array(w.astype(mx.float32), dtype=np.float32)
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            if module == "self_attn.q_proj":
                w = permute_qk(w, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                w = permute_qk(w, config["num_key_value_heads"])
            tensors[f"blk.{i}.{GGUF_NAMES[module]}.{kind}"] = w
        elif name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w
        elif name == "lm_head.weight":
            tensors["output.weight"] = w
    return tensors


def arch_tensors(arch: str, config: dict, model) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors of an mlx-lm model, named by llama.cpp's own
    tensor map (gguf.get_tensor_name_map), with Gemma norms stored as 1 + w."""
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)  # (llama.cpp's name: "command-r")
    tmap = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    out = {}
    for name, w in tree_flatten(model.parameters()):
        base, kind = name.rsplit(".", 1)
        gname = tmap.get_name(base.replace("switch_mlp", "experts"))
        assert gname is not None, f"no GGUF name for {name}"
        w = np.array(w.astype(mx.float32), dtype=np.float32)
        if arch.startswith("gemma") and base.endswith("norm"):
            w = w + 1
        out[f"{gname}.{kind}"] = w
    return out


def spm_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + ["▁"] + [f"▁tok{i}" for i in range(vocab_size - 260)]
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(len(tokens) - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    return tokens, scores, types


def write_gguf(path: str, config: dict, tensors: dict[str, np.ndarray], quant: dict[str, Q] | None = None,
               extra_meta: dict | None = None, tokenizer: dict | None = None, arch: str = "llama") -> None:
    """A GGUF of `arch`. `tensors` are float32 (or raw block bytes for names in `quant`)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    w.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    w.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    if "head_dim" in config:
        w.add_uint32(f"{arch}.attention.key_length", config["head_dim"])
        w.add_uint32(f"{arch}.attention.value_length", config["head_dim"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    w.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    for key, value in (extra_meta or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    write_vocab(w, tokenizer, config["vocab_size"],
                "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    _write_tensors(w, tensors, quant)


def write_vocab(w, tokenizer: dict | None, vocab_size: int, template: str | None = None) -> None:
    """`tokenizer` (model, pre, vocab (tokens, scores, types), merges, chat_template), or a byte
    SentencePiece vocabulary of `vocab_size`; BOS 1, EOS 2; `template` where it gives none."""
    tok = tokenizer or {}
    tokens, scores, types = tok.get("vocab") or spm_vocab(vocab_size)
    w.add_tokenizer_model(tok.get("model", "llama"))
    if "pre" in tok:
        w.add_string("tokenizer.ggml.pre", tok["pre"])
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tok.get("chat_template") or template:
        w.add_string("tokenizer.chat_template", tok.get("chat_template") or template)


def _write_tensors(w, tensors: dict[str, np.ndarray], quant: dict[str, Q] | None, encode: bool = False) -> None:
    """Tensors as float32, or (names in `quant`) as that block type: raw bytes already, or
    float32 encoded by the gguf package when `encode`. Then the file is written and closed."""
    for name, t in tensors.items():
        if quant and name in quant:
            raw = gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32), quant[name]) if encode else t
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=quant[name])
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantized(t: np.ndarray, qtype: Q) -> np.ndarray:
    return dequantize(t, qtype)
