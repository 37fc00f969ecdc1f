"""llama.cpp's recurrent, hybrid, MLA and tensor-mapped MoE architectures in GGUF: Mamba-2,
LFM2, Qwen3-Next, Qwen3.5/3.6 (dense and MoE), Nemotron-H (dense and MoE), DeepSeek V2/V3
(`deepseek2`: also Kimi K2 and GLM-4.7-Flash files), GLM-5 (`glm-dsa`: the same MLA with
DeepSeek Sparse Attention's indexer), GLM-4.5/4.6/4.7 and Solar Open (`glm4moe`), MiniMax M2
(`minimax-m2`), gpt-oss (`gpt-oss`; its MXFP4 experts packed in MLX's mxfp4 mode, `load.py`),
Gemma 4 (`gemma4`), Gemma 3n (`gemma3n`), Llama 4 (`llama4`), Granite 4.0 H (`granitehybrid`),
Ling/Ring 2.0 (`bailingmoe2`), OLMoE, Qwen2-MoE.

The config comes from the `{arch}.ssm.*` / `shortconv.*` metadata llama.cpp's
converter writes (`hybrid_config.py`); tensors are renamed onto mlx-lm's parameters with llama.cpp's own
tensor map (the `gguf` package: the same table its converter used, read the other
way), and the converter's value changes are undone:
- `ssm_a` holds A = -exp(A_log): A_log = log(-A);
- convolution kernels were squeezed to [channels, width]: MLX's Conv1d takes
  [channels, width, 1];
- Mamba-2's `ssm_d` / `ssm_a` were given a trailing 1 and its gated norm split per group
  (Nemotron-H's Mamba layers too);
- Nemotron-H's and Granite 4.0 H's attention Q/K rows were permuted as for Llama (undone);
  Granite's shared MLP split into gate and up (fused back as mlx-lm's class holds it);
- Qwen3-Next's `in_proj_qkvz` was split into `attn_qkv` (all q, all k, all v) and
  `attn_gate` (z): the per-key-head [q, k, v, z] rows are put back together;
- Qwen3.5's value heads were reordered from grouped by key head to tiled (for ggml's
  broadcast) wherever they appear: V rows of `attn_qkv`, `attn_gate`, alpha/beta, A,
  dt, the convolution's V channels and `ssm_out`'s columns; put back in mlx-lm's order;
- Gemma 4's experts keep the checkpoint's fused gate_up (split here), its router's scales
  and layer scalar are named by hand (`_DIRECT`); Gemma 3n's AltUp projections are stacked
  into one tensor each (split back a stream each);
- DeepSeek's `kv_b_proj` is stored split as `attn_k_b` (transposed) and `attn_v_b`, which
  are exactly mlx-lm's absorbed-MLA `embed_q` and `unembed_out`; older files keep one
  `attn_kv_b`, split here as mlx-lm splits it.
Norm weights need nothing: llama.cpp stores Qwen3-Next's as 1 + w, which is what
mlx-lm's class holds once its own `sanitize` has run on a Hugging Face checkpoint.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from macinfer.gguf.arch import unpermute_rows
from macinfer.gguf.file import ModelLoadError
from macinfer.kernels.dequantize import dequantize_f32

# mlx-lm parameter (under a layer) -> the name llama.cpp's converter gave it before its tensor map
_ALIASES = {"mixer.switch_mlp.fc1": "mlp.experts.up_proj", "mixer.switch_mlp.fc2": "mlp.experts.down_proj",
            "block_sparse_moe.switch_mlp.gate_proj": "block_sparse_moe.experts.w1",  # MiniMax's w1/w2/w3
            "block_sparse_moe.switch_mlp.down_proj": "block_sparse_moe.experts.w2",
            "block_sparse_moe.switch_mlp.up_proj": "block_sparse_moe.experts.w3",
            "self_attn.embed_q": "self_attn.k_b_proj", "self_attn.unembed_out": "self_attn.v_b_proj"}


def _rows(parts: list[mx.array], per_head: list[int], heads: int) -> mx.array:
    """Interleave row blocks per head: part i holds `heads` blocks of per_head[i] rows each."""
    blocks = [p.reshape(heads, n, *p.shape[1:]) for p, n in zip(parts, per_head)]
    out = mx.concatenate(blocks, axis=1)
    return out.reshape(-1, *out.shape[2:])


def _untile_v_heads(w: mx.array, axis: int, nk: int, per_k: int) -> mx.array:
    """llama.cpp's tiled value-head order [r, k] back to mlx-lm's grouped [k, r] along `axis`,
    whole heads at a time (so a quantized array's packed columns move with their head)."""
    axis %= w.ndim
    shape = w.shape
    if shape[axis] % (per_k * nk):
        raise ModelLoadError(f"a value head of a {shape} tensor does not span whole quantization groups")
    w = w.reshape(*shape[:axis], per_k, nk, shape[axis] // (per_k * nk), *shape[axis + 1 :])
    return mx.swapaxes(w, axis, axis + 1).reshape(shape)


def _untile_qwen35(config: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if nk == nv:
        return tensors
    per_k, qk = nv // nk, 2 * nk * config["linear_key_head_dim"]
    out = dict(tensors)
    for name, w in tensors.items():
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part == "attn_qkv":  # only the V rows
            out[name] = mx.concatenate([w[:qk], _untile_v_heads(w[qk:], 0, nk, per_k)])
        elif part in ("attn_gate", "ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
            out[name] = _untile_v_heads(w, 0, nk, per_k)
        elif part == "ssm_conv1d":  # only the V channels (weight and bias)
            out[name] = mx.concatenate([w[:qk], _untile_v_heads(w[qk:], 0, nk, per_k)])
        elif part == "ssm_out":  # columns; quantized arrays move whole heads of packed columns
            out[name] = _untile_v_heads(w, -1, nk, per_k)
    return out


def _float(out: dict[str, mx.array], prefix: str, width: int) -> mx.array:
    """`prefix`.weight taken out of `out`, dequantized if the file holds it in blocks."""
    w = out.pop(f"{prefix}.weight")
    if f"{prefix}.scales" not in out:
        return w
    return dequantize_f32(w, out.pop(f"{prefix}.scales"), out.pop(f"{prefix}.biases"), 32, w.shape[-1] * 32 // width)


def _kv_b_as_the_model_takes_it(config: dict[str, Any], out: dict[str, mx.array]) -> dict[str, mx.array]:
    """DeepSeek's kv_b_proj: mlx-lm's V3 file takes it absorbed (k_b transposed, v_b: what new
    files hold), its V2 file whole (what older files hold); either file, either model."""
    heads, nope, rank = config["num_attention_heads"], config["qk_nope_head_dim"], config["kv_lora_rank"]
    whole = config["model_type"] == "deepseek_v2"
    for name in [n for n in out if n.endswith((".attn_v_b.weight" if whole else ".attn_kv_b.weight"))]:
        prefix = name.rsplit(".", 2)[0]
        if whole:  # [k_b^T; v_b] a head
            k_b, v_b = _float(out, f"{prefix}.attn_k_b", nope), _float(out, f"{prefix}.attn_v_b", rank)
            out[f"{prefix}.attn_kv_b.weight"] = mx.concatenate([k_b.swapaxes(-1, -2), v_b], axis=1).reshape(-1, rank)
        else:
            kv_b = _float(out, f"{prefix}.attn_kv_b", rank).reshape(heads, -1, rank)
            out[f"{prefix}.attn_k_b.weight"] = mx.contiguous(kv_b[:, :nope].swapaxes(-1, -2))
            out[f"{prefix}.attn_v_b.weight"] = mx.contiguous(kv_b[:, nope:])
    return out


def _gemma4_experts(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Gemma 4's experts: llama.cpp keeps the checkpoint's fused gate_up (gate rows first),
    split here into mlx-lm's gate and up (rows: weights, scales and biases alike)."""
    out = dict(tensors)
    for name in [n for n in tensors if ".ffn_gate_up_exps." in n]:
        gate, up = mx.split(out.pop(name), 2, axis=-2)
        out[name.replace("ffn_gate_up_exps", "ffn_gate_exps")] = mx.contiguous(gate)
        out[name.replace("ffn_gate_up_exps", "ffn_up_exps")] = mx.contiguous(up)
    return out


# Parameters the tensor map has no name for, by architecture: (layer's parameter -> the file's tensor)
_DIRECT = {"gemma3n": {"altup.correct_output_scale": "altup_correct_scale.weight"},
           "bailingmoe2": {"mlp.gate.gate_proj.weight": "ffn_gate_inp.weight",
                           "mlp.gate.expert_bias": "exp_probs_b.bias"},
           "granitehybrid": {"shared_mlp.input_linear.weight": "ffn_gate_up_shexp.weight",
                             "shared_mlp.output_linear.weight": "ffn_down_shexp.weight",
                             "block_sparse_moe.switch_mlp.gate_proj.weight": "ffn_gate_exps.weight",
                             "block_sparse_moe.switch_mlp.up_proj.weight": "ffn_up_exps.weight",
                             "block_sparse_moe.switch_mlp.down_proj.weight": "ffn_down_exps.weight"},
           "gemma4": {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
                      "layer_scalar": "layer_output_scale.weight",
                      "experts.switch_glu.gate_proj.weight": "ffn_gate_exps.weight",
                      "experts.switch_glu.up_proj.weight": "ffn_up_exps.weight",
                      "experts.switch_glu.down_proj.weight": "ffn_down_exps.weight"}}


def _direct(arch: str, param: str) -> tuple[str, str] | None:
    """(tensor base, tensor name) of a layer parameter `_DIRECT` names, else None."""
    layer, _, rest = param.partition(".layers.")[2].partition(".")
    name = _DIRECT.get(arch, {}).get(rest)
    if name is None or not layer.isdigit():
        return None
    return f"blk.{layer}.{name.rsplit('.', 1)[0]}", f"blk.{layer}.{name}"


_ALTUP = re.compile(r"model\.(altup_(?:unembed_)?projections)\.(\d+)")
_ALTUP_NAMES = {"altup_projections": "altup_proj", "altup_unembed_projections": "altup_unembd_proj"}


def _gemma3n_altup(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Gemma 3n's AltUp projections: stacked into one tensor each by the converter (a block format's
    scales and biases alike), one a stream here."""
    out = dict(tensors)
    for name in _ALTUP_NAMES.values():
        for kind in ("weight", "scales", "biases"):
            if f"{name}.{kind}" in out:
                for i, w in enumerate(out.pop(f"{name}.{kind}")):
                    out[f"{name}.{i}.{kind}"] = w
    return out


def _undo_conversion(arch: str, config: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    if arch == "gemma4":
        tensors = _gemma4_experts(tensors)
    if arch == "gemma3n":
        tensors = _gemma3n_altup(tensors)
    if arch.startswith("qwen35"):
        tensors = _untile_qwen35(config, tensors)
    out = dict(tensors)
    if arch in ("deepseek2", "glm-dsa"):
        out = _kv_b_as_the_model_takes_it(config, out)
    for name, w in tensors.items():
        if name.endswith(".ssm_a"):
            out[name] = mx.log(-w.astype(mx.float32)).reshape(-1).astype(w.dtype)
        elif name.endswith(".ssm_d"):
            out[name] = w.reshape(-1)
        elif name.endswith((".ssm_conv1d.weight", ".shortconv.conv.weight")):
            if f"{name[:-len('weight')]}scales" in tensors:
                raise ModelLoadError(f"{name}: a quantized convolution kernel is not supported")
            out[name] = w.reshape(*w.shape, 1)
        elif name.endswith(".ssm_norm.weight") and arch != "qwen3next":
            out[name] = w.reshape(-1)
    if arch == "granitehybrid":  # its MLPs: the shared one fused (gate rows first), as mlx-lm's class holds it
        for name in [n for n in tensors if ".ffn_gate_shexp." in n]:
            out[name.replace(".ffn_gate_shexp.", ".ffn_gate_up_shexp.")] = mx.concatenate(
                [out.pop(name), out.pop(name.replace(".ffn_gate_shexp.", ".ffn_up_shexp."))])
    if arch.startswith("nemotron_h") or arch == "granitehybrid":  # Q/K rows permuted as for Llama
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        for name in tensors:
            part = name.split(".")[2] if name.startswith("blk.") else None
            if part in heads:
                out[name] = unpermute_rows(out[name], heads[part])
    if arch == "qwen3next":
        nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
        vdim = config["linear_num_value_heads"] * config["linear_value_head_dim"] // nk  # v (and z) rows a key head
        for name in [n for n in tensors if ".attn_qkv." in n]:
            kind = name.rsplit(".", 1)[1]  # weight / scales / biases
            qkv, z = out.pop(name), out.pop(name.replace(".attn_qkv.", ".attn_gate."))
            q, k, v = qkv[: nk * dk], qkv[nk * dk : 2 * nk * dk], qkv[2 * nk * dk :]
            out[f"{name.split('.attn_qkv.')[0]}.ssm_in.{kind}"] = _rows([q, k, v, z], [dk, dk, vdim, vdim], nk)
    return out


def model_arch(arch: str) -> Any:
    """The `gguf` package's MODEL_ARCH for a GGUF architecture name ("glm4moe" is GLM4_MOE)."""
    import gguf

    return next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def to_model_names(arch: str, model, tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """GGUF tensors -> mlx-lm parameter names of `model` (values converted back)."""
    import gguf
    from mlx.utils import tree_flatten

    tensors = _undo_conversion(arch, config, tensors)
    tmap = gguf.get_tensor_name_map(model_arch(arch), config["num_hidden_layers"])
    modules = dict(model.named_modules())
    out: dict[str, mx.array] = {}
    for param, _ in tree_flatten(model.parameters()):
        base, kind = param.rsplit(".", 1)
        if kind == "dt_bias":  # the converter renamed it dt_proj.bias
            base, kind = f"{base}.dt_proj", "bias"
        elif kind == "sinks":  # gpt-oss's attention sinks: the converter named them sinks.weight
            base, kind = param, "weight"
        elif kind == "e_score_correction_bias":
            base, kind = f"{base}.e_score_correction", "bias"
        elif kind == "expert_bias":  # LFM2-MoE's: the converter named it expert_bias.bias
            base, kind = f"{base}.expert_bias", "bias"
        rest = base.partition(".layers.")[2]
        if rest and (alias := _ALIASES.get(rest.split(".", 1)[-1])):
            base = f"model.layers.{rest.split('.', 1)[0]}.{alias}"
        base = base.replace(".switch_mlp.", ".experts.")
        if base.startswith("model.language_model."):  # Gemma 3n's text model under its wrapper
            base = "model." + base[len("model.language_model."):]
        if base.startswith("language_model."):  # Qwen3.5's text model (the converter drops the prefix)
            base, full = base[len("language_model."):], param[len("language_model."):]
        else:
            full = param
        gname = tmap.get_name(full) if kind in ("A_log", "D") else tmap.get_name(base)
        key = gname if kind in ("A_log", "D") else f"{gname}.{kind}"
        if (direct := _direct(arch, param)) is not None:
            gname, key = direct
        elif m := _ALTUP.fullmatch(base):  # Gemma 3n's AltUp projections, one a stream (`_gemma3n_altup`)
            gname = f"{_ALTUP_NAMES[m.group(1)]}.{m.group(2)}"
            key = f"{gname}.{kind}"
        if gname is None or key not in tensors:
            raise ModelLoadError(f"GGUF ({arch}) has no tensor for {param}" + (f" ({key})" if gname else ""))
        out[param] = tensors[key]
        if kind == "weight" and f"{gname}.scales" in tensors:  # a quantized weight's companions
            biases = tensors.get(f"{gname}.biases")  # (none: MXFP4, MLX's `mxfp4` mode)
            if hasattr(modules.get(param[: -len(".weight")]), "to_quantized"):
                out[f"{param[: -len('weight')]}scales"] = tensors[f"{gname}.scales"]
                if biases is not None:
                    out[f"{param[: -len('weight')]}biases"] = biases
            else:  # a module MLX cannot quantize (a router held as a bare weight): float values
                w, scales = tensors[key], tensors[f"{gname}.scales"]
                bits = w.shape[-1] // scales.shape[-1]  # a group of 32 values packs into `bits` uint32s
                out[param] = dequantize_f32(w, scales, biases, 32, bits, "affine" if biases is not None else "mxfp4")
    return out
