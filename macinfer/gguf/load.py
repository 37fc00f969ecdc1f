"""Read a GGUF file into an HF-style config and MLX weights.

Files whose tensors are all F32 / F16 / Q4_0 / Q4_1 / Q8_0 go through `mx.load`,
which returns the block formats as MLX affine-quantized triples (`weight`,
`scales`, `biases`, group size 32) exactly. Anything else (K-quants, Q5_0/1,
IQ types, BF16) is dequantized tensor by tensor with llama.cpp's own `gguf`
package and re-quantized to MLX affine at the bits that fit the source type,
so memory stays near the file size. This module also maps llama.cpp names and
metadata (RoPE scaling included) onto the Hugging Face names the models use.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from macinfer.gguf import arch as gguf_arch, hybrid as gguf_hybrid
from macinfer.gguf.hybrid_config import ARCHS as HYBRID_ARCHS, config_for as hybrid_config_for
from macinfer.gguf.tensor_config import ROPE_FREQS_READ, from_tensors
from macinfer.gguf.file import GGUFFile, ModelLoadError

log = logging.getLogger("macinfer")
Progress = Callable[[int, int], None]  # (tensors done, tensors in all)

GGUF_GROUP_SIZE = 32  # every block format mx.load decodes uses 32-element blocks
_MX_LOAD_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}  # mx.load decodes these exactly
# Re-quantization bits per source type. Types whose blocks are affine grids over
# 32 elements (Q4_0/1, Q5_0/1, Q8_0, and Q4_K/Q5_K sub-blocks) keep their own
# scale and offset per group of 32, so the values are unchanged up to float16
# (`_BLOCK_GRIDS`). Q6_K (16-wide sub-blocks) gets 8 bits; the 2-3 bit and IQ
# types get 4 bits from each group's min and max (an approximation, logged).
_REQUANT_BITS = {
    "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4,
    "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 8, "Q8_0": 8, "Q8_K": 8,
    "Q2_K": 4, "Q3_K": 4, "IQ2_XXS": 4, "IQ2_XS": 4, "IQ2_S": 4, "IQ3_XXS": 4, "IQ3_S": 4,
    "IQ1_S": 4, "IQ1_M": 4, "TQ1_0": 4, "TQ2_0": 4,
}


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _kquant_scale_min(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per-32 (scale, min) from the 6-bit packed table (llama.cpp's get_scale_min_k4)."""
    d, dmin, q = _f16(raw, 0), _f16(raw, 2), raw[..., 4:16].astype(np.uint16)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return d[..., None] * sc, -dmin[..., None] * mn


# type -> raw blocks [rows, blocks, bytes] -> (scale, bias) per group of 32 elements.
_BLOCK_GRIDS = {
    "Q4_0": lambda r: (_f16(r, 0)[..., None], -8 * _f16(r, 0)[..., None]),
    "Q4_1": lambda r: (_f16(r, 0)[..., None], _f16(r, 2)[..., None]),
    "Q5_0": lambda r: (_f16(r, 0)[..., None], -16 * _f16(r, 0)[..., None]),
    "Q5_1": lambda r: (_f16(r, 0)[..., None], _f16(r, 2)[..., None]),
    "Q8_0": lambda r: (_f16(r, 0)[..., None], -128 * _f16(r, 0)[..., None]),
    "Q4_K": _kquant_scale_min,
    "Q5_K": _kquant_scale_min,
}
_FLOAT_TYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "F64": mx.float32}
# Block types MLX holds exactly in a mode of its own: MXFP4 (gpt-oss's experts: 4-bit e2m1
# values times a power of two a block of 32) is MLX's `mxfp4` (no biases).
_EXACT_TYPES = {"MXFP4"}

def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, mx.array) else v


SUPPORTED_ARCHS = frozenset({*gguf_arch.ARCHS, *HYBRID_ARCHS})  # llama.cpp's names this loader reads


def arch_of(meta: dict[str, Any]) -> str:
    """The file's llama.cpp architecture, refused at load when this loader cannot read it."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        from macinfer.models import UnsupportedArchitectureError

        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r} in GGUF; supported: " + ", ".join(sorted(SUPPORTED_ARCHS)))
    return arch


def gguf_config(meta: dict[str, Any], names: set[str] = frozenset()) -> dict[str, Any]:
    arch = arch_of(meta)
    if arch in HYBRID_ARCHS:
        def need(key: str, default: Any = ...) -> Any:
            value = meta.get(f"{arch}.{key}", None if default is ... else default)
            if value is None and default is ...:
                raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
            return value if hasattr(value, "tolist") and getattr(value, "size", 1) > 1 else _scalar(value)

        config = hybrid_config_for(arch, need, meta, names)
    else:
        config = gguf_arch.config_for(arch, meta, _scalar, names)

    def get(key: str, default: Any = None) -> Any:
        return _scalar(meta.get(f"{arch}.{key}", default))

    config.update(_rope_config(get))
    if arch == "deepseek2" and (log_mul := get("rope.scaling.yarn_log_multiplier")) is not None \
            and "rope_scaling" in config:
        # llama.cpp's DeepSeek files keep 0.1 * mscale_all_dim; the attention mscale is not stored
        # (DeepSeek's configs set both alike), so it is taken as equal.
        config["rope_scaling"].update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)
    return config


def _rope_config(get) -> dict[str, Any]:
    """HF `rope_scaling` from llama.cpp's rope.scaling.* keys; unknown kinds refused."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    factor = float(get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_scaling": {"type": "linear", "factor": factor}}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        orig = get("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (v := get(f"rope.scaling.{gguf_key}")) is not None:
                scaling[hf_key] = float(v)
        return {"rope_scaling": scaling}
    raise ModelLoadError(
        f"unsupported RoPE scaling {kind!r} in GGUF metadata (rope.scaling.type); supported: none, linear, yarn, "
        "and llama3 frequency factors (rope_freqs)"
    )


def _quant_bits(weights: dict[str, mx.array], prefix: str) -> int:
    w, s = weights[f"{prefix}.weight"], weights[f"{prefix}.scales"]
    in_features = s.shape[-1] * GGUF_GROUP_SIZE
    return w.shape[-1] * 32 // in_features


def affine_quantize(w: np.ndarray, bits: int, grid: tuple[np.ndarray, np.ndarray] | None = None,
                    group_size: int = GGUF_GROUP_SIZE) -> tuple[mx.array, mx.array, mx.array]:
    """Affine quantization in MLX's layout (LSB-first bit stream in uint32, float16
    scales and biases per group). `grid` gives each group's (scale, bias) when the
    source format has them; otherwise the group's min and max are grid points."""
    rows, cols = w.shape
    levels = 2**bits - 1
    g = np.asarray(w, dtype=np.float32).reshape(rows, cols // group_size, group_size)
    if grid is None:
        lo, hi = g.min(-1), g.max(-1)
        grid = (np.where(hi > lo, (hi - lo) / levels, 1.0), lo)
    s16 = np.where(grid[0] != 0, grid[0], 1.0).reshape(rows, -1).astype(np.float16)
    b16 = grid[1].reshape(rows, -1).astype(np.float16)
    q = np.rint((g - b16[..., None].astype(np.float32)) / s16[..., None].astype(np.float32))
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(rows, cols)
    bit_planes = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = np.packbits(bit_planes.reshape(rows, cols * bits), axis=-1, bitorder="little")
    return mx.array(stream.view(np.uint32)), mx.array(s16), mx.array(b16)


def _requantize_tensor(f: GGUFFile, name: str, kind: str, rows_per_chunk: int = 1024):
    """One quantized tensor to MLX affine, a chunk of rows at a time: only one chunk is
    ever held as float32 (a 128k-row embedding would otherwise be GBs)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    t = f.tensors[name]
    qtype = GGMLQuantizationType[kind]
    type_size = GGML_QUANT_SIZES[qtype][1]
    rows = int(np.prod(t.shape[:-1]))  # MoE experts [E, out, in] are quantized row by row too
    raw = f.raw(name).reshape(rows, -1)
    parts = []
    for r in range(0, rows, rows_per_chunk):
        chunk = raw[r : r + rows_per_chunk]
        grid = _BLOCK_GRIDS[kind](chunk.reshape(chunk.shape[0], -1, type_size)) if kind in _BLOCK_GRIDS else None
        parts.append(affine_quantize(dequantize(chunk, qtype), _REQUANT_BITS[kind], grid))
        mx.eval(*parts[-1])
    return tuple(mx.concatenate([p[i] for p in parts]).reshape(*t.shape[:-1], -1) for i in range(3))


def _as_mxfp4(name: str, values: mx.array) -> dict[str, mx.array]:
    """An MXFP4 tensor's values packed in MLX's `mxfp4` mode, checked to give them back
    exactly (else kept as float32, which holds them exactly too)."""
    if values.shape[-1] % 32 == 0:
        packed, scales = mx.quantize(values, group_size=32, bits=4, mode="mxfp4")
        if mx.array_equal(mx.dequantize(packed, scales, None, 32, 4, mode="mxfp4"), values).item():
            return {name: packed, f"{name.rsplit('.', 1)[0]}.scales": scales}
    return {name: values}


def _requantize(f: GGUFFile, progress: Progress | None = None, keep: Any = None) -> dict[str, mx.array]:
    """Every tensor (those `keep` accepts) via the gguf package: quantized ones to MLX affine
    (group 32)."""
    out: dict[str, mx.array] = {}
    counts: dict[str, int] = {}
    tensors = {n: t for n, t in f.tensors.items() if keep is None or keep(n)}
    for done, (name, t) in enumerate(tensors.items()):
        if progress is not None:
            progress(done, len(tensors))
        kind = t.type_name
        if kind in _FLOAT_TYPES:
            out[name] = mx.array(f.dequantize(name)).astype(_FLOAT_TYPES[kind])
        elif kind in _EXACT_TYPES:
            out.update(_as_mxfp4(name, mx.array(f.dequantize(name).astype(np.float32))))
        elif kind in _REQUANT_BITS and len(t.shape) in (2, 3) and t.shape[-1] % GGUF_GROUP_SIZE == 0:
            base = name.rsplit(".", 1)[0]
            q = _requantize_tensor(f, name, kind)
            mx.eval(*q)
            out[name], out[f"{base}.scales"], out[f"{base}.biases"] = q
            counts[kind] = counts.get(kind, 0) + 1
        elif kind in _REQUANT_BITS:
            out[name] = mx.array(f.dequantize(name)).astype(mx.float16)
        else:
            raise ModelLoadError(f"{f.path}: tensor {name} uses quantization type {kind}, which macinfer cannot read")
    total = sum(v.nbytes for v in out.values())
    if not counts:
        return out
    log.warning(
        "%s: re-quantized %s to MLX affine group %d (%s); %.2f GiB in memory for a %.2f GiB file",
        os.path.basename(f.path), ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), GGUF_GROUP_SIZE,
        ", ".join(f"{k}->{_REQUANT_BITS[k]}-bit" for k in sorted(counts)), total / 2**30,
        os.path.getsize(f.path) / 2**30,
    )
    return out


def load_gguf(path: str, progress: Progress | None = None) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any]]:
    """Returns (HF-style config, HF-named weights, raw GGUF metadata).
    Raises ModelLoadError (one line, naming the file) for broken files."""
    f = GGUFFile(path)
    meta = f.metadata
    config = gguf_config(meta, set(f.tensors))
    from_tensors(meta.get("general.architecture"), config, {n: t.shape for n, t in f.tensors.items()}, f.dequantize)
    if any(n.startswith("rope_factors_") for n in f.tensors):
        raise ModelLoadError(f"{os.path.basename(path)}: LongRoPE factors (rope_factors_long/short) are not supported")
    unknown = f.types() - set(_FLOAT_TYPES) - set(_REQUANT_BITS) - _EXACT_TYPES
    if unknown:
        raise ModelLoadError(
            f"{os.path.basename(path)}: unsupported quantization type(s) {', '.join(sorted(unknown))}"
        )
    if f.types() <= _MX_LOAD_TYPES:
        try:
            raw = mx.load(path)
        except Exception as e:
            raise ModelLoadError(f"{os.path.basename(path)}: could not read tensors ({e})") from None
    else:
        raw = _requantize(f, progress)
    arch = arch_of(meta)
    if arch in HYBRID_ARCHS:  # named by the model class's own parameters (lazy: nothing allocated)
        from macinfer.models.mlx_lm_classes import instantiate

        weights = gguf_hybrid.to_model_names(arch, instantiate(config), raw, config.get("text_config", config))
    else:
        weights = {hf: value for name, value in raw.items() if (hf := gguf_arch.hf_name(arch, name)) is not None}
    if "rope_freqs.weight" in f.tensors and arch not in ROPE_FREQS_READ:  # (theirs are read above)
        # llama3-style scaling baked into per-pair period factors (Llama 3.1+ files).
        config["rope_freq_factors"] = f.dequantize("rope_freqs.weight").astype(np.float32).ravel().tolist()
    if gguf_arch.norms_stored_plus_one(arch):  # llama.cpp stores Gemma's RMSNorm weights as 1 + w
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name] - 1
    rows = gguf_arch.qk_rows_undone(arch, config)  # (how the converter reordered Q/K rows, undone)
    if rows is not None:
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        for name in list(weights):
            for proj, n in heads.items():
                if f"self_attn.{proj}." in name:
                    weights[name] = rows(weights[name], n)

    config.setdefault("tie_word_embeddings", "lm_head.weight" not in weights)  # (hybrids: set from the file)
    quant: dict[str, Any] = {}
    for name in weights:
        if name.endswith(".scales"):
            prefix = name[: -len(".scales")]
            quant[prefix] = {"group_size": GGUF_GROUP_SIZE, "bits": _quant_bits(weights, prefix)}
            if f"{prefix}.biases" not in weights:  # MXFP4 blocks, as MLX's mxfp4 mode holds them
                quant[prefix]["mode"] = "mxfp4"
    if quant:
        bits = sorted({q["bits"] for q in quant.values()})
        # mlx-lm's convention: a default plus per-layer overrides.
        default_bits = max(bits, key=lambda b: sum(q["bits"] == b for q in quant.values()))
        config["quantization"] = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
        for prefix, q in quant.items():
            if q["bits"] != default_bits or "mode" in q:
                config["quantization"][prefix] = q
    return config, weights, meta


def read_block(path: str, first: int, names_for: Callable[[set[str]], Any], config: dict[str, Any]) -> dict[str, mx.array]:
    """Block `first` of a GGUF file (a multi-token-prediction layer llama.cpp's converter keeps
    as one more `blk.N`, with its `nextn.*` tensors), under the names of the parameters of
    `names_for(the file's tensor names)` (a module tree whose parameters are
    `model.layers.{first}.*`), converted as the model's are."""
    f = GGUFFile(path)
    arch = arch_of(f.metadata)
    if arch not in HYBRID_ARCHS:
        raise ModelLoadError(f"{os.path.basename(path)}: {arch} files keep no multi-token-prediction block here")
    model = names_for(set(f.tensors))
    raw = _requantize(f, keep=lambda n: n.startswith(f"blk.{first}."))
    return gguf_hybrid.to_model_names(arch, model, raw, {**config, "num_hidden_layers": first + 1})
