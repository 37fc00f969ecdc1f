"""The language model of a vision checkpoint whose model type mlx-lm does not implement
(LLaVA-NeXT, SmolVLM, InternVL...): mlx-vlm's own loading (its sanitizing, its resolved text
config), the language model's weights taken from it under mlx-lm's names, and mlx-lm's class
for the text model type run by the engine as any other. Whether the names and shapes fit is
checked by mlx-lm's strict load; a family whose language module differs is refused with why."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten


def _flag(v: Any) -> bool:
    """A config flag as mlx-vlm's config classes may hold it: PaddleOCR-VL's `use_bias`
    defaults to the tuple `(False,)` there, which is truthy."""
    if isinstance(v, (list, tuple)):
        v = v[0] if v else False
    return bool(v)


def _deepseek_v2(t: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-OCR's decoder is DeepSeek-V2's config without latent attention (no query or key
    heads of its own width: plain multi-head attention), greedy softmax routing over routed and
    shared experts: DeepSeek-MoE's, mlx-lm's `deepseek`. With latent attention it is mlx-lm's
    `deepseek_v2`."""
    latent = bool(t.get("qk_nope_head_dim") or t.get("kv_lora_rank"))
    methods = ("greedy", "group_limited_greedy") if latent else ("greedy",)
    if t.get("topk_method", "greedy") not in methods or t.get("scoring_func", "softmax") != "softmax" \
            or (not latent and float(t.get("routed_scaling_factor") or 1.0) != 1.0):
        raise ValueError(f"its DeepSeek-V2 decoder routes by {t.get('topk_method')}/{t.get('scoring_func')} x "
                         f"{t.get('routed_scaling_factor')}, which mlx-lm's "
                         f"{'deepseek_v2' if latent else 'deepseek'} class does not")
    return t if latent else {**t, "model_type": "deepseek"}


def _fused_qwen3(t: dict[str, Any]) -> dict[str, Any]:
    """Molmo 2's and Jina-VLM's decoders are Qwen3's (per-head RMS norms on queries and keys, no
    biases) under their own weight names (`_fused_weights`); their embedding has rows past
    the output head's (the image tokens, `additional_vocab_size`): built with the embedding's
    rows, the head narrowed to `vocab_size` (`follow_published`)."""
    if not t.get("use_qk_norm", True) or t.get("qk_norm_type", "qwen3") != "qwen3" or t.get("norm_after") \
            or t.get("qkv_bias"):
        raise ValueError("its decoder is not Qwen3's (qk norms, qk_norm_type/norm_after/qkv_bias), which is the "
                         "one mlx-lm's class runs")
    head = int(t["vocab_size"])
    return {**t, "model_type": "qwen3", "rms_norm_eps": t.get("rms_norm_eps") or t.get("layer_norm_eps", 1e-6),
            "tie_word_embeddings": False, "vocab_size": head + int(t.get("additional_vocab_size") or 0),
            "head_vocab_size": head}


def _molmo(t: dict[str, Any]) -> dict[str, Any]:
    """Molmo 1's decoder (Molmo-7B-D's: Qwen2-7B's) under its own config names and weight names
    (`_fused_weights`): Qwen2's attention (biased query/key/value), SwiGLU, RMS norms; its
    embedding has rows past the head's (the image tokens), as Molmo 2's."""
    if t.get("weight_tying"):
        raise ValueError("its decoder ties the output head to the embedding, which mlx-vlm's Molmo module "
                         "does not run")
    head = int(t["vocab_size"])
    return {"model_type": "qwen2", "hidden_size": t["d_model"], "num_attention_heads": t["n_heads"],
            "num_key_value_heads": t["n_kv_heads"], "num_hidden_layers": t["n_layers"],
            "head_dim": t["d_model"] // t["n_heads"],
            "intermediate_size": int(t["mlp_hidden_size"] * t.get("act_output_multiplier", 0.5)),
            "rms_norm_eps": t["layer_norm_eps"], "rope_theta": t["rope_theta"],
            "max_position_embeddings": t["max_position_embeddings"], "tie_word_embeddings": False,
            "vocab_size": int(t.get("embedding_size") or head) + int(t.get("additional_vocab_size") or 0),
            "head_vocab_size": head}


# Each family's names for its decoder's weights: its layers' prefix, its two embedding tables,
# its final norm, its fused query/key/value and up/gate projections (the up half first), its
# names for the other per-layer weights, and its output head's where it is not mlx-lm's.
_FUSED_NAMES = {
    "molmo2": ("model.blocks.", ("model.wte.embedding", "model.wte.new_embedding"), "model.ln_f.weight",
               "self_attn.att_proj", "mlp.ff_proj",
               {"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm",
                "self_attn.attn_out": "self_attn.o_proj", "attn_norm": "input_layernorm",
                "ff_norm": "post_attention_layernorm", "mlp.ff_out": "mlp.down_proj"}),
    "jina_vlm": ("layers.", ("embedding.embedding", "embedding.new_embedding"), "ln_f.weight", "attn.qkv", "ffn.gate_up",
                 {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm", "attn.out": "self_attn.o_proj",
                  "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn.down": "mlp.down_proj"}),
    "molmo": ("model.blocks.", ("model.wte.embedding", "model.wte.new_embedding"), "model.ln_f.weight", "att_proj",
              "ff_proj", {"attn_out": "self_attn.o_proj", "attn_norm": "input_layernorm",
                          "ff_norm": "post_attention_layernorm", "ff_out": "mlp.down_proj"}, "model.ff_out.weight"),
}


def _fused_weights(family: str) -> Callable[[dict[str, mx.array], dict[str, Any]], dict[str, mx.array]]:
    """The family's decoder weights under mlx-lm's names (its text config's: `t`): the fused
    projections split, the two embedding tables joined."""
    blocks, tables, final, qkv, up_gate, names, *head = _FUSED_NAMES[family]

    def rename(w: dict[str, mx.array], t: dict[str, Any]) -> dict[str, mx.array]:
        q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
        w = dict(w)
        out = {"model.embed_tokens.weight": mx.concatenate([w.pop(tables[0]), w.pop(tables[1])]),
               "model.norm.weight": w.pop(final)}
        if head:
            out["lm_head.weight"] = w.pop(head[0])
        for k, v in w.items():
            if not k.startswith(blocks):
                out[k] = v
                continue
            i, rest = k[len(blocks):].split(".", 1)
            at = f"model.layers.{i}."
            if rest in (qkv + ".weight", qkv + ".bias"):
                leaf = rest.rsplit(".", 1)[1]
                out[f"{at}self_attn.q_proj.{leaf}"], out[f"{at}self_attn.k_proj.{leaf}"], \
                    out[f"{at}self_attn.v_proj.{leaf}"] = v[:q], v[q:q + kv], v[q + kv:]
            elif rest == up_gate + ".weight":  # (its first half is multiplied by the gate's SiLU)
                half = v.shape[0] // 2
                out[at + "mlp.up_proj.weight"], out[at + "mlp.gate_proj.weight"] = v[:half], v[half:]
            else:
                module, leaf = rest.rsplit(".", 1)
                if module not in names:
                    raise ValueError(f"its decoder weight {k} is not a {t['model_type']} layer's")
                out[at + names[module] + "." + leaf] = v
        return out
    return rename


def _moondream(t: dict[str, Any]) -> dict[str, Any]:
    """Moondream 2's decoder is Phi-1.5's (parallel attention and MLP after one LayerNorm, partial
    rotary, biased projections, a biased head): mlx-lm's `phi`, under its own weight names
    (`_moondream_weights`)."""
    return {"model_type": "phi", "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
            "num_hidden_layers": t["num_hidden_layers"], "num_attention_heads": t["num_attention_heads"],
            "num_key_value_heads": t["num_key_value_heads"], "partial_rotary_factor": t["partial_rotary_factor"],
            "rope_theta": t["rope_theta"], "layer_norm_eps": t["rms_norm_eps"], "vocab_size": t["vocab_size"],
            "max_position_embeddings": t["max_position_embeddings"]}


def _moondream_weights(w: dict[str, mx.array], t: dict[str, Any]) -> dict[str, mx.array]:
    """Moondream 2's names -> mlx-lm's Phi's: the fused query/key/value split (biases too)."""
    hd = t["hidden_size"] // t["num_attention_heads"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    names = {"ln": "input_layernorm", "attn.proj": "self_attn.dense", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    out = {}
    for k, v in w.items():
        if k.startswith("model.post_ln."):
            out["model.final_layernorm." + k[len("model.post_ln."):]] = v
        elif not k.startswith("model.layers."):
            out[k] = v  # (the embedding, the head)
        else:
            i, rest = k[len("model.layers."):].split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            at = f"model.layers.{i}."
            if module == "attn.qkv":
                for name, part in zip(("q_proj", "k_proj", "v_proj"), (v[:q], v[q:q + kv], v[q + kv:])):
                    out[f"{at}self_attn.{name}.{leaf}"] = part
            elif module in names:
                out[f"{at}{names[module]}.{leaf}"] = v
            else:
                raise ValueError(f"its decoder weight {k} is not a Phi layer's")
    return out


# The language model's weights under mlx-lm's names, where mlx-vlm's module names them otherwise.
TEXT_WEIGHTS: dict[str, Callable[[dict[str, mx.array], dict[str, Any]], dict[str, mx.array]]] = {
    **{family: _fused_weights(family) for family in _FUSED_NAMES}, "moondream2": _moondream_weights}


# Language models mlx-vlm names its own that are mlx-lm's classes under another name (the
# same modules and weight names; the image side, multimodal RoPE included, is the engine's).
TEXT_ALIASES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "glm4v_text": lambda t: {**t, "model_type": "glm4"},
    # GLM-4.5V's decoder is GLM-4.5's (MoE), mlx-lm's glm4_moe.
    "glm4v_moe_text": lambda t: {**t, "model_type": "glm4_moe"},
    # GLM-OCR's decoder is GLM-4's; its RoPE settings live in `rope_parameters` only.
    "glm_ocr_text": lambda t: {**t, "model_type": "glm4",
                               "rope_theta": (t.get("rope_parameters") or {}).get("rope_theta", 10000),
                               "partial_rotary_factor": (t.get("rope_parameters") or {}).get(
                                   "partial_rotary_factor", 1.0)},
    # PaddleOCR-VL's ERNIE-4.5 decoder rotates half-split pairs (mlx-lm's ernie4_5 rotates
    # even/odd ones): Llama's modules and names, every projection biased as `use_bias` says.
    "paddleocr_vl": lambda t: {**t, "model_type": "llama", "attention_bias": _flag(t.get("use_bias")),
                               "mlp_bias": _flag(t.get("use_bias"))},
    # Mistral Large 3's decoder is DeepSeek-V3's (latent attention, MoE), in mlx-vlm's module of it.
    "mistral_large3": lambda t: {**t, "model_type": "deepseek_v3"},
    # LLaVA-Bunny (nanoLLaVA, Bunny): a Qwen2 or a Llama decoder under the checkpoint's own name.
    "llava-qwen2": lambda t: {**t, "model_type": "qwen2"},
    "llava_qwen2": lambda t: {**t, "model_type": "qwen2"},  # FastVLM's Qwen2 decoder
    "bunny-llama": lambda t: {**t, "model_type": "llama"},
    "dots_ocr": lambda t: {**t, "model_type": "qwen2"},  # dots.ocr's decoder (mlx-vlm: LLaVA-Bunny's Qwen2)
    # Qwen2-VL's and Qwen2.5-VL's decoder is Qwen2's (mlx-lm's wrapper holds `qwen2`)
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl"), lambda t: {**t, "model_type": "qwen2"}),
    "got": lambda t: {**t, "model_type": "qwen2"},  # GOT-OCR's decoder (its config at the root) is Qwen2's
    # HunyuanOCR's decoder is Hunyuan's dense one (NTK-alpha RoPE base, query/key norms after RoPE);
    # its four-axis XD-RoPE is the engine's multimodal RoPE.
    "hunyuan_vl": lambda t: {**t, "model_type": "hunyuan_v1_dense"},
    "phi4mm": lambda t: {**t, "model_type": "phi3"},  # Phi-4 multimodal's decoder is Phi-4-mini's
    "phi4-siglip": lambda t: {**t, "model_type": "phi3"},  # Phi-4-SigLIP's decoder is Phi-4's (fused projections)
    "phi3_v": lambda t: {**t, "model_type": "phi3"},  # Phi-3 Vision's decoder is Phi-3's
    "deepseek_v2": _deepseek_v2,
    # Granite 4 Vision's decoder (mlx-vlm's module: attention layers only, a fused shared MLP)
    # is mlx-lm's `granitemoehybrid` in its dense form, the MLP the shared one's width.
    "granitemoehybrid": lambda t: {**t, "layer_types": ["attention"] * int(t["num_hidden_layers"]),
                                   "num_local_experts": None,
                                   "intermediate_size": t.get("shared_intermediate_size") or t["intermediate_size"]},
    # MiMo-V2's decoder is MiMo-V2-Flash's (mlx-vlm's class for it inherits that one; its
    # checkpoint's fused qkv and MXFP4 experts are undone by mlx-vlm's sanitize). Its unset
    # (None: no shared experts, no routing scale) optional fields are ones mlx-lm requires.
    "mimo_v2": lambda t: {"n_shared_experts": None, "routed_scaling_factor": None, **t,
                          "model_type": "mimo_v2_flash"},
    "molmo2": _fused_qwen3,
    "jina_vlm": _fused_qwen3,
    "molmo": _molmo,
    "moondream2": _moondream,
    # MiniCPM-o 4.5's decoder (its config at the root) is Qwen3-8B's: mlx-vlm runs it by Qwen3-VL's
    # language module with every position equal (plain RoPE), mlx-lm's `qwen3`.
    "minicpmo": lambda t: {**t, "model_type": "qwen3"},
    # Step 3.7's decoder is Step 3.5's; mlx-vlm keeps its MoE layer list as numbers, mlx-lm as text.
    "step3p5": lambda t: {**t, "moe_layers_enum": ",".join(map(str, t["moe_layers_enum"]))
                          if isinstance(t.get("moe_layers_enum"), (list, tuple)) else t.get("moe_layers_enum")},
}
# Text model types mlx-lm runs only inside its wrapper, which takes the text config nested:
# (the wrapper's type, where it wants the decoder's `model.*` weights, or None where its
# sanitize moves them itself). MiniCPM-V 4.6/4.7's Qwen3.5 decoders, Gemma 3n's.
WRAPPED = {"qwen3_5_text": ("qwen3_5", None), "qwen3_5_moe_text": ("qwen3_5_moe", None),
           "gemma3n_text": ("gemma3n", "model.language_model.")}
# Vision families whose decoder is one the engine's own graph runs (`models/llama.py`: Llama,
# Mistral, Qwen2 dense, full attention): their language model alone runs there, as those text
# checkpoints do (fused projections, compiled), with the images' rows spliced in and the
# multimodal RoPE turned by the step's positions. Each is checked against mlx-vlm by the tests.
HAND_WRITTEN_DECODERS = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "llava_onevision", "llava_bunny",
                         "fastvlm", "mistral3", "pixtral", "idefics2", "idefics3", "smolvlm", "internvl",
                         "internvl_chat", "dots_ocr", "got", "mage_vl", "minicpmo", "multi_modality", "paddleocr_vl"}


def hand_written_decoder(config: dict[str, Any]) -> bool:
    """Whether the checkpoint's language model runs on the engine's own graph."""
    from macinfer.vision.families import family

    return family(config) in HAND_WRITTEN_DECODERS


# Vision families whose decoder mlx-lm has no class for, run by mlx-vlm's own language class
# on the engine (as mlx-vlm's text-only models are: `models/mlx_vlm_text.py`), its weights under
# mlx-vlm's names. Moondream 3's (query and value temperatures from the projections and the
# position, `Tau`; MoE layers after the first few).
OWN_LANGUAGE = {"moondream3"}
# Vision model types that are another family's checkpoint under a name of their own (mlx-vlm's
# class is that family's, its weights named alike): the language model is built as that family's.
SAME_AS = {"indic_ocr": "qwen3_5"}
# Vision families whose mlx-lm wrapper cannot load their checkpoints, and why: their language
# model alone, by mlx-lm's class for it (whose sanitize does what the wrapper's leaves out).
LANGUAGE_MODEL_ALONE = {"kimi_vl": "mlx-lm's wrapper leaves DeepSeek-V3's kv_b_proj unsplit",
                        "gemma3n": "mlx-lm's wrapper reads transformers' weight names only (mlx-vlm's conversions "
                                   "hold their own)"}


def follow_published(model: Any, text: dict[str, Any]) -> None:
    """Where mlx-lm's class departs from the checkpoint's published model, it is made to follow
    it (once, at load, before the weights): an output head narrower than the embedding (Molmo
    2's image tokens are input rows only: the logits are the head's rows, `args.vocab_size`);
    mlx-lm's Gemma (1) MLP runs the exact GELU, where transformers' Gemma always runs the tanh
    approximation (its config's legacy "gelu" included), which PaliGemma's config names and
    mlx-vlm follows (the layers' classes swapped, parameters untouched)."""
    import mlx.nn as nn

    if text.get("head_vocab_size"):
        lm, head = model.lm, int(text["head_vocab_size"])
        rows, dims = lm.lm_head.weight.shape
        lm.lm_head = nn.Linear(dims, head, bias=False)
        model.args.vocab_size, model.args.input_vocab_size = head, rows
    if text.get("model_type") != "gemma":
        return
    from mlx_lm.models import gemma

    class TanhGeluMLP(gemma.MLP):
        def __call__(self, x: mx.array) -> mx.array:
            return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))

    for _, module in model.named_modules():
        if type(module) is gemma.MLP:
            module.__class__ = TanhGeluMLP


def language_model(path: str) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """(text config for mlx-lm, the language model's weights) of the checkpoint at `path`,
    the weights lazy (read when the engine evaluates them). Raises ValueError with the reason."""
    try:
        from mlx_vlm.utils import load_model
    except ImportError:
        raise ValueError("mlx-vlm is not installed (pip install 'macinfer[vision]')") from None
    vlm = load_model(Path(path), lazy=True)
    lm = getattr(vlm, "language_model", None)
    args = getattr(lm, "args", None) or getattr(lm, "config", None) or getattr(vlm.config, "text_config", None)
    if args is not None and not (getattr(args, "hidden_size", None) or getattr(args, "d_model", None)):
        # a stub (Phi-4 multimodal's): the root's (Molmo 1's names its width `d_model`)
        args = vlm.config
    if lm is None or args is None or not dataclasses.is_dataclass(args):
        raise ValueError("mlx-vlm's model has no separate language model to run")
    # None is mlx-vlm's "unset" (mlx-lm's default then applies), unless the checkpoint's own
    # config says null (DeepSeek-V3's `q_lora_rank: null`: no query compression).
    nulls = {k for k, v in _raw_text_config(path).items() if v is None}
    text = {k: v for k, v in dataclasses.asdict(args).items() if v is not None or k in nulls}
    raw_type = text.get("model_type")
    if vlm.config.model_type in OWN_LANGUAGE:
        text["mlx_vlm_language"] = vlm.config.model_type
    elif raw_type == "molmo":
        _molmo_variant(path)
    alias = None if text.get("mlx_vlm_language") else TEXT_ALIASES.get(raw_type)
    text = alias(text) if alias is not None else text
    from macinfer.vision.families import PROMPT_AND_WINDOW, family

    if family({"model_type": vlm.config.model_type}) in PROMPT_AND_WINDOW:  # its window after the prompt (the cache kind's)
        text["prompt_window"] = int(text.get("sliding_window_size") or text["sliding_window"])
    if "head_dim" not in text and text.get("hidden_size") and text.get("num_attention_heads"):
        text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]  # transformers' default
    top = vlm.config
    for key in ("vocab_size", "tie_word_embeddings", "eos_token_id"):  # set on the wrapper in some configs
        if key not in text and getattr(top, key, None) is not None:
            text[key] = getattr(top, key)
    # (Phi-3 Vision keeps its tower inside the decoder's module: not the language model's)
    weights = {k: v for k, v in tree_flatten(lm.parameters()) if ".vision_embed_tokens." not in f".{k}"}
    if raw_type in TEXT_WEIGHTS:
        weights = TEXT_WEIGHTS[raw_type](weights, text)
    # Layers whose checkpoint keeps a modality's LoRA beside them (Phi-4 multimodal): mlx-vlm
    # merges the vision LoRA in at load; the engine runs the base weights and serves the LoRA
    # per row, for the prompts with images (`vision/modality_lora.py`).
    for k, v in (getattr(vlm, "_base_weights", None) or {}).items():
        if k.startswith("language_model.") and k[len("language_model."):] in weights:
            weights[k[len("language_model."):]] = v
    if "model.lm_head.weight" in weights:  # a head kept inside the decoder module (LLaVA-Bunny's): the model's
        weights["lm_head.weight"] = weights.pop("model.lm_head.weight")
    # The decoder at the top (Idefics3's): mlx-lm's names (Nemotron-H's is `backbone.` in both)
    if not any(k.startswith(("model.", "backbone.")) for k in weights):
        weights = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in weights.items()}
    # Tied or not is what the module holds (mlx-vlm's config classes may not carry the flag,
    # and mlx-lm's default, tied, is not transformers' for most families).
    text["tie_word_embeddings"] = "lm_head.weight" not in weights
    if "quantization" in getattr(top, "__dict__", {}) and getattr(top, "quantization", None):
        text["quantization"] = top.quantization
    if text.get("model_type") in WRAPPED:
        wrapper, prefix = WRAPPED[text["model_type"]]
        text = {"model_type": wrapper, "text_config": text,
                **{k: text[k] for k in ("quantization", "tie_word_embeddings", "vocab_size", "eos_token_id") if k in text}}
        if prefix is not None:
            weights = {prefix + k[len("model."):] if k.startswith("model.") else k: v for k, v in weights.items()}
    return text, weights


def _raw_config(path: str) -> dict[str, Any]:
    import json

    with open(Path(path) / "config.json", encoding="utf-8") as f:
        return json.load(f)


def _raw_text_config(path: str) -> dict[str, Any]:
    text = _raw_config(path).get("text_config")
    return text if isinstance(text, dict) else {}


def _molmo_variant(path: str) -> None:
    """Molmo 1's other decoders (Molmo-7B-O's OLMo: query/key norms, norms after; MolmoE's
    experts; clipped query/key/value) are set by config fields mlx-vlm's module does not read:
    refused by them rather than run without them."""
    raw = {**_raw_config(path), **_raw_text_config(path)}
    odd = [k for k, plain in (("attention_layer_norm", False), ("norm_after", False), ("clip_qkv", None),
                              ("qkv_bias", True), ("moe_num_experts", 0)) if k in raw and raw[k] not in (plain, None)]
    if odd:
        raise ValueError(f"its decoder sets {', '.join(odd)}, which mlx-vlm's Molmo module does not run "
                         "(it runs Molmo-7B-D's Qwen2 decoder)")


def language_model_alone(path: str, config: dict[str, Any], context: tuple[int, str] | None, impl: str,
                         why: Exception | None) -> tuple[Any, dict[str, Any], dict[str, mx.array]]:
    """A vision checkpoint's language model alone (`language_model`): mlx-lm's class for its
    text model type (the one that takes image embeddings), or with impl "auto" the engine's own
    graph where it runs it; its config stays the checkpoint's. `why`: why the checkpoint's own
    class did not serve it (None: the engine's graph was chosen)."""
    from macinfer.models import UnsupportedArchitectureError, build_model
    from macinfer.models.rope import extend_context

    try:
        text, weights = language_model(path)
        text = extend_context(text, *context) if context is not None else text
        model = build_model(text, impl)
        follow_published(model, text)
    except (ValueError, KeyError, TypeError, UnsupportedArchitectureError) as inner:
        raise UnsupportedArchitectureError(f"{why}; its language model alone: {inner}" if why is not None
                                           else f"its language model: {inner}") from None
    return model, {**config, **{k: v for k, v in text.items() if k != "model_type"}}, weights
