"""Tiny random targets with an MTP head in each published layout (Qwen3.5/Qwen3-Next `mtp.*`,
DeepSeek V3 / GLM-4.5 `model.layers.{N}.*`, MiMo, Nemotron-H, LongCat-Flash, Step 3.5, ERNIE
4.5 `model.mtp_*.0.*`, Mellum, K-EXAONE, Bailing v2.5,
MiMo-V2-Flash `model.mtp.layers.*`), written as the checkpoints hold them, for `test_mtp.py` and the
speculation tests."""

from __future__ import annotations

import dataclasses
import os

import mlx.core as mx
from mlx.utils import tree_flatten

from tests.helpers import make_mlx_lm_model, save_model_dir
from tests.zoo import tiny_config

DAMPED = ("o_proj", "out_proj", "down_proj")
ROWS = 32


def mtp_engine(path: str, **kw):
    """An engine for `path` sized for `ROWS` speculating rows (`kw`: EngineConfig's fields)."""
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine

    kw = {"num_kv_blocks": 160, "block_size": 16, "max_num_seqs": ROWS, "speculative_max_batch": ROWS, **kw}
    return LLMEngine(path, EngineConfig(**kw))


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def _text(model):
    return model.language_model if hasattr(model, "language_model") else model


def declare(config: dict) -> dict:
    if "text_config" in config:
        config["text_config"]["mtp_num_hidden_layers"] = 1
    else:
        config["num_nextn_predict_layers"] = 1
    return config


def hf_head(model, config: dict, style: str, agree: bool) -> dict:
    """The MTP tensors as the published checkpoints hold them, for a head built with the
    target's own layer class. `agree`: the head's input projection passes the token's
    embedding through and its layer is damped, so it predicts what the (damped) target
    predicts one token later: drafts accepted often, not always."""
    text = _text(model)
    layers, args = (text.backbone if "backbone" in text else text.model).layers, text.args
    dims = args.hidden_size
    mx.random.seed(11)
    proj = mx.concatenate([mx.eye(dims), mx.zeros((dims, dims))], axis=1) if agree else \
        mx.random.normal((dims, 2 * dims)) / dims**0.5
    if style == "qwen":
        full = max(i for i, layer in enumerate(layers) if not getattr(layer, "is_linear", False))
        layer = type(layers[full])(args, full)
        prefix, own = "mtp.layers.0.", {"mtp.fc.weight": proj}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            own[f"mtp.{name}.weight"] = 0.05 * mx.random.normal((dims,))  # zero-centred: 1 + w
    elif style == "mellum":  # Mellum, K-EXAONE: Qwen's names, plain norms, a layer of `mtp_layer_types`
        n = args.num_hidden_layers
        kind = (config.get("mtp_layer_types") or ["sliding_attention"])[0]
        dense = {"is_moe_layer": args.is_moe_layer + [False]} if hasattr(args, "is_moe_layer") else {}
        layer = type(layers[-1])(dataclasses.replace(args, layer_types=args.layer_types + [kind], **dense), n)
        prefix, own = "mtp.layers.0.", {"mtp.fc.weight": proj}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            own[f"mtp.{name}.weight"] = 1 + 0.05 * mx.random.normal((dims,))
    elif style == "nemotron":  # Nemotron-H: its blocks by pattern, eh_proj on the first, a final norm on the last
        blocks = [type(layers[0])(args, t) for t in config["mtp_hybrid_override_pattern"]]
        own = {"mtp.layers.0.eh_proj.weight": proj}
        for name in ("enorm", "hnorm"):
            own[f"mtp.layers.0.{name}.weight"] = 1 + 0.05 * mx.random.normal((dims,))
        own[f"mtp.layers.{len(blocks) - 1}.final_layernorm.weight"] = 1 + 0.05 * mx.random.normal((dims,))
        for i, block in enumerate(blocks):
            for k, v in tree_flatten(block.parameters()):
                if agree and any(d in k for d in DAMPED):
                    v = v * 0.05
                if ".switch_mlp." in k:  # experts one by one, as transformers writes them
                    proj_name = {"fc1": "up_proj", "fc2": "down_proj"}[k.split(".")[-2]]
                    for e in range(v.shape[0]):
                        own[f"mtp.layers.{i}.mixer.experts.{e}.{proj_name}.weight"] = v[e]
                    continue
                own[f"mtp.layers.{i}.{k}"] = v
        return own
    elif style == "longcat":  # LongCat-Flash: `model.mtp.*`, one latent-attention block with a dense MLP
        from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP

        attn, mlp = LongcatFlashMLA(args), LongcatFlashMLP(args)
        own = {"model.mtp.layers.0.eh_proj.weight": proj, "model.mtp.embed_tokens.weight": text.model.embed_tokens.weight}
        for name, key in (("enorm", "layers.0.enorm.m"), ("hnorm", "layers.0.hnorm.m"), ("final", "norm"),
                          ("in", "layers.0.input_layernorm"), ("post", "layers.0.post_attention_layernorm")):
            own[f"model.mtp.{key}.weight"] = 1 + 0.05 * mx.random.normal((dims,))
        for k, v in tree_flatten(attn.parameters()):
            own[f"model.mtp.layers.0.self_attn.{k}"] = v * 0.05 if agree and "o_proj" in k else v
        for k, v in tree_flatten(mlp.parameters()):
            own[f"model.mtp.layers.0.transformer_layer.mlp.{k}"] = v * 0.05 if agree and "down_proj" in k else v
        wk, wv = own.pop("model.mtp.layers.0.self_attn.embed_q.weight"), own.pop(
            "model.mtp.layers.0.self_attn.unembed_out.weight")
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)  # the checkpoint's kv_b_proj
        own["model.mtp.layers.0.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        return own
    elif style == "ernie":  # ERNIE 4.5: `model.mtp_{part}.0`, its block as layer 0, the model's final norm after it
        layer = type(layers[0])(args, 0)
        prefix = "model.mtp_block.0."
        own = {"model.mtp_linear_proj.0.weight": proj}
        for name in ("mtp_emb_norm", "mtp_hidden_norm"):
            own[f"model.{name}.0.weight"] = 1 + 0.05 * mx.random.normal((dims,))
    elif style == "mimo":  # the hidden state first in its input projection
        layer = type(layers[-1])(args)
        prefix = "model.mtp_layers.0."
        swap = mx.concatenate([proj[:, dims:], proj[:, :dims]], axis=1)
        own = {f"{prefix}input_proj.weight": swap}
        for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            own[f"{prefix}{name}.weight"] = 1 + 0.05 * mx.random.normal((dims,))
    elif style == "mimo_v2":  # MiMo-V2-Flash: `model.mtp.layers.0`, a sliding layer with a dense MLP, a final norm
        layer = type(layers[0])(args, False, True)
        prefix = "model.mtp.layers.0."
        own = {f"{prefix}eh_proj.weight": proj}
        for name in ("enorm", "hnorm", "final_layernorm"):
            own[f"{prefix}{name}.weight"] = 1 + 0.05 * mx.random.normal((dims,))
    elif style == "bailing":  # Bailing v2.5: `model.layers.{N}`, a final norm, no head of its own
        n = args.num_hidden_layers
        layer = type(layers[-1])(args, n)
        prefix = f"model.layers.{n}."
        own = {f"{prefix}eh_proj.weight": proj}
        for name in ("enorm", "hnorm", "final_layernorm"):
            own[f"{prefix}{name}.weight"] = 1 + 0.05 * mx.random.normal((dims,))
    else:
        n = args.num_hidden_layers
        if isinstance(getattr(args, "layer_types", None), list) and len(args.layer_types) <= n:  # Step 3.5's
            args = dataclasses.replace(args, layer_types=args.layer_types + ["sliding_attention"])  # (MTP: sliding)
        layer = type(layers[-1])(args, n)
        prefix = f"model.layers.{n}."
        head = text.lm_head.weight if "lm_head" in text else text.model.embed_tokens.weight
        own = {f"{prefix}eh_proj.weight": proj, f"{prefix}shared_head.head.weight": head,
               f"{prefix}embed_tokens.weight": text.model.embed_tokens.weight}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            own[f"{prefix}{name}.weight"] = 1 + 0.05 * mx.random.normal((dims,))
    flat = dict(tree_flatten(layer.parameters()))
    for k, v in flat.items():
        if agree and any(d in k for d in DAMPED):
            v = v * 0.05
        if style == "qwen" and k.endswith("norm.weight"):
            v = v - 1.0 + 0.05 * mx.random.normal(v.shape)
        if ".switch_mlp." in k:  # experts one by one, as transformers writes them
            for e in range(v.shape[0]):
                own[prefix + k.replace("switch_mlp", f"experts.{e}")] = v[e]
            continue
        if style == "bailing":  # (the gate as published)
            k = k.replace("mlp.gate.gate_proj.", "mlp.gate.")
        if style == "mimo_v2":  # (its norm before the MLP, by its name)
            k = k.replace("post_attention_layernorm.", "pre_mlp_layernorm.")
        own[prefix + k] = v
    if config.get("model_type") == "step3p5":  # StepFun's layout: norms stored w - 1, the head's `output`
        own = {k.replace("shared_head.head.", "shared_head.output."): v - 1.0 if "norm" in k else v
               for k, v in own.items()}
    if "self_attn.embed_q.weight" in flat:  # MLA: the checkpoint's kv_b_proj, split by the target's sanitizer
        wk, wv = flat["self_attn.embed_q.weight"], flat["self_attn.unembed_out.weight"]
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
        own[prefix + "self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        del own[prefix + "self_attn.embed_q.weight"], own[prefix + "self_attn.unembed_out.weight"]
    return own


def mtp_target(root, model_type: str, agree: bool = True, seed: int = 5, with_weights: bool = True) -> str:
    """A tiny random `model_type` target (its layers damped with `agree`) with an MTP head."""
    config = declare(tiny_config(model_type))
    if model_type == "nemotron_h":
        config["mtp_hybrid_override_pattern"] = "*E"
    if model_type == "exaone_moe":  # (as vLLM reads K-EXAONE's: its layer's kind, dense)
        config["mtp_layer_types"] = ["sliding_attention"]
    model = make_mlx_lm_model(config, seed=seed)
    if agree:
        flat = dict(tree_flatten(model.parameters()))
        model.load_weights([(k, v * 0.2 if any(d in k for d in DAMPED) else v) for k, v in flat.items()])
    style = {"mimo": "mimo", "nemotron_h": "nemotron", "longcat_flash": "longcat", "ernie4_5_moe": "ernie",
             "mellum": "mellum", "exaone_moe": "mellum", "bailing_hybrid": "bailing",
             "mimo_v2_flash": "mimo_v2"}.get(
        model_type, "qwen" if model_type.startswith("qwen") else "deepseek")
    path = save_model_dir(str(root / f"{model_type}-{int(agree)}-{int(with_weights)}"), config, model)
    if with_weights:
        head = hf_head(model, config, style, agree)
        mx.save_safetensors(os.path.join(path, "model-mtp.safetensors"), head)
    return path
