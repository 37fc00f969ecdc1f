"""A GGUF vision model: the language model's GGUF and llama.cpp's vision projector file
(`mmproj-*.gguf`) beside it, both written here from a tiny Gemma 3, SmolVLM, Mistral 3,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE), Qwen3.5, LFM2-VL, Kimi-VL, GLM-4.1V, GLM-4.5V, dots.ocr, Gemma 4 or Llama 4 built with mlx-vlm's classes, take
images and give mlx-vlm's tokens on the original checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import pytest

from macinfer import LLM
from macinfer.sampling_params import SamplingParams
from tests.gguf_writer import arch_tensors, write_gguf
from tests.mmproj_writer import hf_tokenizer_meta, write_mmproj
from tests.vision_models import BOTH_WAYS, FIRST, GREEDY, ask, both_ways_greedy, mlx_vlm_greedy, picture, tiny_vlm_dir


def _text_gguf(path: str, family: str, folder: str, cfg: dict, weights: dict, tokenizer) -> None:
    """The checkpoint's language model as llama.cpp's converter writes it (Gemma 3: tied, its
    norms + 1; Llama: Q/K rows permuted), with the checkpoint's tokenizer and template."""
    from tests.gguf_hybrid_writer import hybrid_tensors, write_hybrid_gguf
    from tests.gguf_writer import llama_tensors
    from tests.helpers import make_mlx_lm_model

    text = {**cfg.get("text_config", cfg), **({"tie_word_embeddings": True} if family == "gemma3" else {})}
    text = {k: v for k, v in text.items() if k != "vision_config"}
    lm = make_mlx_lm_model({**text, "model_type": "qwen2"} if family in QWEN_VL[:2] else
                           {**text, "model_type": "qwen3_moe"} if family == "qwen3_vl_moe" else
                           {"rms_norm_eps": 1e-5, **text, "model_type": "glm4"} if family == "glm4v" else
                           {"tie_word_embeddings": False, **text, "model_type": "glm4_moe"} if family == "glm4v_moe" else
                           {**text, "model_type": "qwen2"} if family == "dots_ocr" else
                           {"model_type": "qwen3_5", "text_config": text} if family == "qwen3_5" else
                           {"model_type": "llama4", "text_config": text} if family == "llama4" else text)
    if family in ("qwen3_5", "llama4"):  # mlx-lm's class holds its language model under the same name
        own = {k: v for k, v in weights.items() if k.startswith("language_model.")}
    else:
        own = {k[len("language_model."):]: v for k, v in weights.items() if k.startswith("language_model.")}
        # (Idefics3's language model holds its layers at its top; Gemma's head is its embedding)
        own = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in own.items()}
        own = {k.replace("model.lm_head.", "lm_head.", 1): v for k, v in own.items()}  # (dots.ocr's mlx-vlm names)
    lm.load_weights(list(getattr(lm, "sanitize", lambda w: w)(own).items()))  # (GLM-4 has none)
    if family not in ("qwen3_5", "gemma4", "llama4"):  # (theirs is under rope_parameters or text_config)
        text = {**text, "rope_theta": lm.args.rope_theta}
    if family == "gemma3":
        tensors = {k: v for k, v in arch_tensors("gemma3", text, lm).items() if k != "output.weight"}  # (tied)
        write_gguf(path, text, tensors, arch="gemma3", tokenizer=hf_tokenizer_meta(tokenizer),
                   extra_meta={"gemma3.attention.sliding_window": text["sliding_window"]})
    elif family in QWEN_VL:  # llama.cpp's qwen2vl / qwen3vl: Qwen2's / Qwen3's tensors, the M-RoPE sections beside
        arch = {"qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe"}.get(family, "qwen2vl")
        sections = text["rope_scaling"]["mrope_section"]
        deep = {"qwen3vl.n_deepstack_layers": len(cfg["vision_config"]["deepstack_visual_indexes"])} \
            if arch.startswith("qwen3") else {}
        if arch == "qwen3vlmoe":
            deep.update({f"{arch}.expert_count": text["num_experts"],
                         f"{arch}.expert_used_count": text["num_experts_per_tok"],
                         f"{arch}.expert_feed_forward_length": text["moe_intermediate_size"]})
        write_gguf(path, text, arch_tensors(arch, text, lm), arch=arch, tokenizer=hf_tokenizer_meta(tokenizer),
                   extra_meta={f"{arch}.rope.dimension_sections": sections + [0] * (4 - len(sections)), **deep})
    elif family == "qwen3_5":  # llama.cpp's qwen35: the hybrid's tensors, the M-RoPE sections beside
        rope = text["rope_parameters"]
        flat = {**text, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}
        sections = rope["mrope_section"]
        write_hybrid_gguf(path, "qwen35", flat, hybrid_tensors("qwen35", flat, lm),
                          tokenizer=hf_tokenizer_meta(tokenizer),
                          extra_meta={"qwen35.rope.dimension_sections": sections + [0] * (4 - len(sections))})
    elif family == "glm4v":  # llama.cpp's glm4 with M-RoPE: each head's rotated rows turned NeoX-wise
        import dataclasses

        import numpy as np

        full = {**dataclasses.asdict(lm.args), **text}
        heads, dim = full["num_attention_heads"], full["head_dim"]
        rot = int(dim * full["partial_rotary_factor"])
        tensors = arch_tensors("glm4", full, lm)
        for name, x in tensors.items():  # (the converter's normal_to_neox)
            n = heads if ".attn_q." in name else full["num_key_value_heads"] if ".attn_k." in name else 0
            if n:
                h = x.reshape(n, dim, -1)
                tensors[name] = np.concatenate([h[:, :rot:2], h[:, 1:rot:2], h[:, rot:]], axis=1).reshape(x.shape)
        sections = text["rope_scaling"]["mrope_section"]
        meta = hf_tokenizer_meta(tokenizer)  # (the model's rows only: the processor adds two box tokens past them)
        meta["vocab"] = tuple(part[: full["vocab_size"]] for part in meta["vocab"])
        write_gguf(path, full, tensors, arch="glm4", tokenizer=meta,
                   extra_meta={"glm4.rope.dimension_count": rot,
                               "glm4.rope.dimension_sections": sections + [0] * (4 - len(sections))})
    elif family == "glm4v_moe":  # llama.cpp's glm4moe, the sections beside (its rows NeoX-wise already)
        import dataclasses

        full = {**dataclasses.asdict(lm.args), **text}
        sections = text["rope_scaling"]["mrope_section"]
        meta = hf_tokenizer_meta(tokenizer)  # (the model's rows only, as for GLM-4.1V)
        meta["vocab"] = tuple(part[: full["vocab_size"]] for part in meta["vocab"])
        write_hybrid_gguf(path, "glm4moe", full, hybrid_tensors("glm4moe", full, lm), tokenizer=meta,
                          extra_meta={"glm4moe.rope.dimension_sections": sections + [0] * (4 - len(sections))})
    elif family == "dots_ocr":  # llama.cpp's qwen2 (its config at the checkpoint's root)
        write_gguf(path, {**text, "model_type": "qwen2"}, arch_tensors("qwen2", text, lm), arch="qwen2",
                   tokenizer=hf_tokenizer_meta(tokenizer))
    elif family == "kimi_vl":  # llama.cpp's deepseek2: MLA's kv_b split, the experts stacked
        import dataclasses

        full = {**dataclasses.asdict(lm.args), **text}  # (mlx-lm's defaults for what the tiny config leaves out)
        write_hybrid_gguf(path, "deepseek2", full, hybrid_tensors("deepseek2", full, lm),
                          tokenizer=hf_tokenizer_meta(tokenizer))
    elif family == "lfm2_vl":  # llama.cpp's lfm2: the hybrid's tensors
        write_hybrid_gguf(path, "lfm2", text, hybrid_tensors("lfm2", text, lm), tokenizer=hf_tokenizer_meta(tokenizer))
    elif family == "llama4":  # llama.cpp's llama4 (mlx-lm's class holds it under text_config)
        write_hybrid_gguf(path, "llama4", {"text_config": text}, hybrid_tensors("llama4", {"text_config": text}, lm),
                          tokenizer=hf_tokenizer_meta(tokenizer))
    elif family == "gemma4":  # llama.cpp's gemma4 (its writer: tests/gguf_gemma4.py)
        write_hybrid_gguf(path, "gemma4", text, hybrid_tensors("gemma4", text, lm), tokenizer=hf_tokenizer_meta(tokenizer))
    elif text["model_type"] == "qwen2":  # (InternVL 3's language model)
        write_gguf(path, text, arch_tensors("qwen2", text, lm), arch="qwen2", tokenizer=hf_tokenizer_meta(tokenizer))
    else:
        write_gguf(path, text, llama_tensors(text, lm), tokenizer=hf_tokenizer_meta(tokenizer))


def _projector(family: str, cfg: dict, processor) -> dict:
    """write_mmproj's arguments for the family, as llama.cpp's converter writes its file."""
    vision = cfg["vision_config"]
    if family == "qwen2_vl":  # (as its converter renames them: the tower's width, the out width as its "ffn")
        return {"projector": "qwen2vl_merger", "text_hidden": cfg["hidden_size"],
                "vision": {"image_size": 560, "patch_size": vision["patch_size"], "hidden_size": vision["embed_dim"],
                           "intermediate_size": vision["hidden_size"], "num_hidden_layers": vision["depth"],
                           "num_attention_heads": vision["num_heads"]},
                "extra": {"spatial_merge_size": vision["spatial_merge_size"]}}
    if family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5"):  # mergers named by hand, by the tower layer each reads
        deep = vision["deepstack_visual_indexes"]
        renamed = {f"vision_tower.merger.{m}.{k}": f"{g}.{k}" for m, g in
                   (("linear_fc1", "mm.0"), ("linear_fc2", "mm.2"), ("norm", "v.post_ln")) for k in ("weight", "bias")}
        renamed.update({f"vision_tower.deepstack_merger_list.{i}.{m}.{k}": f"v.deepstack.{layer}.{g}.{k}"
                        for i, layer in enumerate(deep) for m, g in (("linear_fc1", "fc1"), ("linear_fc2", "fc2"),
                                                                     ("norm", "norm")) for k in ("weight", "bias")})
        return {"projector": "qwen3vl_merger", "text_hidden": cfg["text_config"]["hidden_size"], "split_qkv": False,
                "renamed": renamed,
                "vision": {"image_size": int(vision["num_position_embeddings"] ** 0.5) * vision["patch_size"],
                           "patch_size": vision["patch_size"], "hidden_size": vision["hidden_size"],
                           "intermediate_size": vision["intermediate_size"], "num_hidden_layers": vision["depth"],
                           "num_attention_heads": vision["num_heads"]},
                "extra": {"spatial_merge_size": vision["spatial_merge_size"],
                          "is_deepstack_layers": [i in deep for i in range(vision["depth"])]}}
    if family == "qwen2_5_vl":  # (its config names the tower's sizes its own way)
        every = vision["fullatt_block_indexes"][0] + 1
        return {"projector": "qwen2.5vl_merger", "text_hidden": cfg["hidden_size"],
                "vision": {"image_size": 560, "patch_size": vision["patch_size"], "hidden_size": vision["hidden_size"],
                           "intermediate_size": vision["intermediate_size"], "num_hidden_layers": vision["depth"],
                           "num_attention_heads": vision["num_heads"]},
                "extra": {"n_wa_pattern": every, "window_size": vision["window_size"],
                          "spatial_merge_size": vision["spatial_merge_size"]}}
    if family == "gemma3":
        tokens = cfg["text_config"]["mm_tokens_per_image"]
        return {"projector": "gemma3", "vision": vision, "text_hidden": cfg["text_config"]["hidden_size"],
                "scale_factor": (vision["image_size"] // vision["patch_size"]) // int(tokens ** 0.5)}
    if family == "internvl_chat":  # its converter: the split qkv as self_attn.*_proj, layer scales as .weight
        return {"projector": "internvl", "vision": vision, "text_hidden": cfg["text_config"]["hidden_size"],
                "scale_factor": int(1 / cfg["downsample_ratio"]), "qkv_form": (".attn.qkv.", ".self_attn.{p}_proj."),
                "bare_weights": ("ls1", "ls2", "position_embd"),
                "extra": {"preproc_max_tiles": cfg["max_dynamic_patch"]}}
    if family == "lfm2_vl":  # its converter: image_size fixed at 256, the linear patch embedding as a conv
        return {"projector": "lfm2", "text_hidden": cfg["text_config"]["hidden_size"],
                "vision": {**vision, "image_size": 256}, "scale_factor": cfg["downsample_factor"],
                "linear_patches": vision["patch_size"]}
    if family in ("glm4v", "glm4v_moe"):  # its converter: Qwen3-VL's rules (a fused qkv kept, the Conv3D in two)
        return {"projector": "glm4v", "text_hidden": cfg["text_config"]["hidden_size"], "split_qkv": False,
                "vision": {"image_size": vision["image_size"], "patch_size": vision["patch_size"],
                           "hidden_size": vision["hidden_size"], "intermediate_size": vision["intermediate_size"],
                           "num_hidden_layers": vision["depth"], "num_attention_heads": vision["num_heads"],
                           "layer_norm_eps": 1e-5}}
    if family == "dots_ocr":  # its converter: the SwiGLU named as Qwen2.5-VL's, the pixel range written
        def swiglu_as_qwen(key: str) -> str:  # (the converter's filter_tensors: fc1 gate, fc2 down, fc3 up)
            if key.startswith("vision_tower.blocks.") and ".mlp." in key:
                key = key.replace("vision_tower.blocks.", "visual.blocks.")
                return key.replace(".fc1", ".gate_proj").replace(".fc2", ".down_proj").replace(".fc3", ".up_proj")
            return key

        return {"projector": "dots_ocr", "text_hidden": cfg["hidden_size"], "split_qkv": False,
                "scale_factor": vision["spatial_merge_size"], "checkpoint": swiglu_as_qwen,
                "vision": {"image_size": 0, "patch_size": vision["patch_size"], "hidden_size": vision["embed_dim"],
                           "intermediate_size": vision["intermediate_size"],
                           "num_hidden_layers": vision["num_hidden_layers"],
                           "num_attention_heads": vision["num_attention_heads"], "layer_norm_eps": 1e-5},
                "extra": {"min_pixels": processor.image_processor.size["shortest_edge"],
                          "max_pixels": processor.image_processor.size["longest_edge"]}}
    if family == "kimi_vl":  # its converter: the fused qkv split as wq/wk/wv, the position table flattened
        def hf_name(key: str) -> str:  # (mlx-vlm's sanitize undone: blocks under encoder., wqkv/wo on the block)
            if key.startswith(("vision_tower.blocks.", "vision_tower.final_layernorm")):
                key = "vision_tower.encoder." + key[len("vision_tower."):]
                return key.replace(".attn.wqkv.", ".wqkv.").replace(".attn.wo.", ".wo.")
            return key

        return {"projector": "kimivl", "text_hidden": cfg["text_config"]["hidden_size"], "scale_factor": 2,
                "vision": {"image_size": 64 * 14, "patch_size": vision["patch_size"],
                           "hidden_size": vision["hidden_size"], "intermediate_size": vision["intermediate_size"],
                           "num_hidden_layers": vision["depth"], "num_attention_heads": vision["num_heads"],
                           "layer_norm_eps": 1e-5},
                "checkpoint": hf_name, "qkv_form": (".wqkv.", ".w{p}."),
                "converted": lambda name, x: x.reshape(-1, x.shape[-1]) if name == "v.position_embd.weight" else x}
    if family == "llama4":  # its converter: the position table given a .weight, the projection named by hand
        return {"projector": "llama4", "text_hidden": cfg["text_config"]["hidden_size"],
                "vision": {**vision, "layer_norm_eps": vision["norm_eps"]}, "scale_factor": 2,
                "bare_weights": ("position_embd",), "renamed": {"multi_modal_projector.linear_1.weight": "mm.model.fc.weight"}}
    if family == "gemma4":  # its converter: the tower under vision_model.model., the linear patches as a conv
        def hf_name(key: str) -> str:
            if key.startswith("vision_tower.encoder."):
                key = "vision_model.model." + key[len("vision_tower.encoder."):]
            return key.replace(".linear.weight", ".weight")

        return {"projector": "gemma4v", "text_hidden": cfg["text_config"]["hidden_size"],
                "vision": {**vision, "image_size": 224}, "scale_factor": vision["pooling_kernel_size"],
                "linear_patches": vision["patch_size"], "checkpoint": hf_name, "bare_weights": ("position_embd",),
                "converted": lambda name, x: x.reshape(1) if x.ndim == 0 else x}  # (scalars stored as [1])
    if family == "mistral3":
        return {"projector": "pixtral", "vision": vision, "text_hidden": cfg["text_config"]["hidden_size"],
                "permute_heads": vision["num_attention_heads"],
                "extra": {"spatial_merge_size": cfg["spatial_merge_size"]}}
    return {"projector": "idefics3", "vision": vision, "text_hidden": cfg["text_config"]["hidden_size"],
            "scale_factor": cfg["scale_factor"], "preproc_image_size": processor.image_processor.size["longest_edge"]}


QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def _published_lfm2_preprocessing(folder: str) -> None:
    """The tiny LFM2-VL folder's processor at LFM2-VL's published settings (what the projector
    file's loader uses), so the folder's mlx-vlm answer is the reference for the GGUF pair."""
    from mlx_vlm.models.lfm2_vl.processing_lfm2_vl import Lfm2VlNumpyImageProcessor
    from mlx_vlm.utils import load_processor
    from transformers import Lfm2VlProcessor

    from macinfer.gguf.mmproj_native import LFM2_PREPROCESSOR

    tiny = load_processor(folder, add_detokenizer=False)
    images = Lfm2VlNumpyImageProcessor(downsample_factor=2, encoder_patch_size=16, **LFM2_PREPROCESSOR)
    Lfm2VlProcessor(image_processor=images, tokenizer=tiny.tokenizer,
                    chat_template=tiny.tokenizer.chat_template).save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**cfg, **LFM2_PREPROCESSOR, "max_num_patches": images.max_num_patches}, f)


def _published_kimi_preprocessing(folder: str) -> None:
    """The tiny Kimi-VL folder's processor at the published token limit (the class default)."""
    from mlx_vlm.models.kimi_vl.processing_kimi_vl import KimiVLImageProcessor, KimiVLProcessor
    from mlx_vlm.utils import load_processor

    tiny = load_processor(folder, add_detokenizer=False)
    images = KimiVLImageProcessor(patch_size=14, merge_kernel_size=[2, 2])
    KimiVLProcessor(image_processor=images, tokenizer=tiny.tokenizer,
                    chat_template=tiny.tokenizer.chat_template).save_pretrained(folder)


def _published_glm4v_preprocessing(folder: str) -> None:
    """The tiny GLM-4.1V folder's image processor at the published pixel range (the class
    default; its tokenizer files left as they are)."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    path = os.path.join(folder, "processor_config.json")
    with open(path) as fh:
        saved = json.load(fh)
    saved["image_processor"]["size"] = dict(Glm4vImageProcessorPil.size)
    with open(path, "w") as fh:
        json.dump(saved, fh)


def _published_llama4_preprocessing(folder: str) -> None:
    """The tiny Llama 4 folder at the published 16 tiles at most (its tile size the tiny tower's)."""
    path = os.path.join(folder, "preprocessor_config.json")
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump({**saved, "max_patches": 16}, f)


def _published_gemma4_preprocessing(folder: str) -> None:
    """The tiny Gemma 4 folder at the published 280 soft tokens a picture (processor and tower)."""
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor, Gemma4Processor
    from mlx_vlm.utils import load_processor

    tiny = load_processor(folder, add_detokenizer=False)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    vision = cfg["vision_config"]
    images = Gemma4ImageProcessor(patch_size=vision["patch_size"], max_soft_tokens=280,
                                  pooling_kernel_size=vision["pooling_kernel_size"])
    Gemma4Processor(image_processor=images, tokenizer=tiny.tokenizer, image_seq_length=280,
                    chat_template=tiny.tokenizer.chat_template).save_pretrained(folder)
    cfg["vision_config"]["default_output_length"] = cfg["vision_soft_tokens_per_image"] = 280
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


def _clipped_standardized_gemma4(folder: str) -> None:
    """The tiny Gemma 4 tower with clipped linears (bounds that clip: ±1.5 in, ±1 out) and output
    standardization (a random bias and scale), as its published towers are built."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["vision_config"].update(use_clipped_linears=True, standardize=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    path = os.path.join(folder, "model.safetensors")
    weights = dict(mx.load(path))
    for key in [k for k in weights if k.startswith("vision_tower.encoder.") and k.endswith(".linear.weight")]:
        base = key[: -len(".linear.weight")]
        weights.update({f"{base}.input_min": mx.array(-1.5), f"{base}.input_max": mx.array(1.5),
                        f"{base}.output_min": mx.array(-1.0), f"{base}.output_max": mx.array(1.0)})
    width = cfg["vision_config"]["hidden_size"]
    weights["vision_tower.std_bias"] = 0.1 * mx.random.normal((width,), key=mx.random.key(1))
    weights["vision_tower.std_scale"] = 1 + 0.2 * mx.random.normal((width,), key=mx.random.key(2))
    mx.save_safetensors(path, weights)


def build_vision_gguf(family: str, base) -> tuple[str, object]:
    """(the checkpoint folder, a folder holding its text GGUF and mmproj GGUF) of a tiny `family`."""
    from pathlib import Path

    from mlx_vlm.utils import load_processor

    base = Path(base)
    # Gemma 3 in six layers: llama.cpp fixes its pattern (every 6th global), and mlx-lm's class
    # reads layer 6's cache.
    folder = tiny_vlm_dir(base, family, text={"num_hidden_layers": 6, "sliding_window_pattern": 6}
                          if family == "gemma3" else None)
    if family == "lfm2_vl":  # the published preprocessing, which a projector file does not carry
        _published_lfm2_preprocessing(folder)
    if family == "kimi_vl":  # (the same: its published token limit)
        _published_kimi_preprocessing(folder)
    if family in ("glm4v", "glm4v_moe"):  # (the same: its published pixel range)
        _published_glm4v_preprocessing(folder)
    if family == "llama4":  # (the same: its published tile count)
        _published_llama4_preprocessing(folder)
    if family == "gemma4":  # (the same: its published 280 tokens a picture; clipped, standardized)
        _published_gemma4_preprocessing(folder)
        _clipped_standardized_gemma4(folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    weights = mx.load(os.path.join(folder, "model.safetensors"))
    processor = load_processor(folder, add_detokenizer=False)  # (mlx-vlm's: InternVL's is its own class)
    out = base / "gguf"
    out.mkdir()
    _text_gguf(str(out / f"{family}-tiny-F32.gguf"), family, folder, cfg, weights, processor.tokenizer)
    write_mmproj(str(out / f"mmproj-{family}-tiny-F32.gguf"),
                 weights={k: v for k, v in weights.items() if not k.startswith("language_model.")},
                 image_mean=[float(x) for x in processor.image_processor.image_mean],
                 image_std=[float(x) for x in processor.image_processor.image_std],
                 name=f"{family} tiny", **_projector(family, cfg, processor))
    return folder, out


@pytest.fixture(scope="module", params=["gemma3", "smolvlm", "mistral3", "internvl_chat", *QWEN_VL, "qwen3_5",
                                        "lfm2_vl", "kimi_vl", "glm4v", "glm4v_moe", "dots_ocr", "gemma4", "llama4"])
def vision_gguf(tmp_path_factory, request):
    """(family, the checkpoint folder, a folder holding its text GGUF and mmproj GGUF)."""
    family = request.param
    return (family, *build_vision_gguf(family, tmp_path_factory.mktemp("gguf-vision")))


def test_a_gguf_with_its_mmproj_beside_it_gives_mlx_vlm_tokens(vision_gguf, tmp_path):
    family, folder, out = vision_gguf
    llm = LLM(str(out / f"{family}-tiny-F32.gguf"), kv_cache_gb=0.01, max_model_len=512)
    try:
        rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "what is it"}]}])
        reference = both_ways_greedy if family in BOTH_WAYS else mlx_vlm_greedy
        tokens, logprobs = reference(folder, rendered, [picture(0)], 8)
        assert llm.chat(ask("what is it", picture(0)), GREEDY).token_ids == tokens
        first = [llm.chat(ask("what is it", picture(i)), FIRST).logprobs[0].top for i in (0, 1)]
        assert first[0] != first[1]  # the image is used
        assert max(abs(lp - logprobs[t]) for t, lp in first[0]) < 1e-4
        expected = llm.chat(ask("what is it", picture(0)), SamplingParams(temperature=0, max_tokens=8)).text
    finally:
        llm.close()
    # The CLI, the projector named (llama.cpp's flag)
    from click.testing import CliRunner

    from macinfer.cli.main import main

    png = tmp_path / "p.png"
    picture(0).save(png)
    r = CliRunner().invoke(main, ["generate", str(out / f"{family}-tiny-F32.gguf"), "--mmproj",
                                  str(out / f"mmproj-{family}-tiny-F32.gguf"), "-p", "what is it", "--image", str(png),
                                  "--temperature", "0", "-n", "8", "--kv-cache-gb", "0.01", "--max-model-len", "512"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(expected)


@pytest.mark.parametrize("vision_gguf", ["gemma3"], indirect=True)  # (checked on one family's files)
def test_mmproj_problems_are_load_errors_or_reasons(vision_gguf, tmp_path):
    import gguf

    from macinfer.gguf.file import GGUFFile

    family, folder, out = vision_gguf
    model, mmproj = str(out / "gemma3-tiny-F32.gguf"), str(out / "mmproj-gemma3-tiny-F32.gguf")
    # A projector type not read yet: named in the error when asked for, a reason beside the model.
    other = tmp_path / "beside"
    other.mkdir()
    shutil.copy(model, other / "m.gguf")
    f = GGUFFile(mmproj)
    w = gguf.GGUFWriter(str(other / "mmproj-m.gguf"), "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("minicpmv")
    w.add_tensor("v.post_ln.weight", f.dequantize("v.post_ln.weight").copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    llm = LLM(str(other / "m.gguf"), kv_cache_gb=0.01, max_model_len=512)
    try:
        assert "minicpmv" in llm.engine.vision_refusal
        with pytest.raises(ValueError, match="minicpmv"):
            llm.chat(ask("what is it", picture(0)), GREEDY)
        assert llm.generate("hello", GREEDY)[0].token_ids  # the text still runs
    finally:
        llm.close()
    with pytest.raises(ValueError, match="--mmproj .*minicpmv"):
        LLM(model, kv_cache_gb=0.01, max_model_len=512, mmproj=str(other / "mmproj-m.gguf"))
    from click.testing import CliRunner

    from macinfer.cli.main import main

    r = CliRunner().invoke(main, ["generate", model, "--mmproj", str(other / "mmproj-m.gguf"), "-p", "hi", "-n", "2",
                                  "--kv-cache-gb", "0.01", "--max-model-len", "512"])
    assert r.exit_code == 1 and "minicpmv" in r.output and "Traceback" not in r.output, r.output
    # --mmproj beside a checkpoint folder (its tower is its own): refused, not ignored.
    with pytest.raises(ValueError, match="--mmproj is a GGUF model's vision projector"):
        LLM(folder, kv_cache_gb=0.01, max_model_len=512, mmproj=mmproj)
    # The language model's GGUF given as the projector; a projector missing a tower tensor.
    with pytest.raises(ValueError, match="not a vision projector"):
        LLM(model, kv_cache_gb=0.01, max_model_len=512, mmproj=model)
    with open(os.path.join(folder, "config.json")) as fh:
        vision = json.load(fh)["vision_config"]
    weights = {k: v for k, v in mx.load(os.path.join(folder, "model.safetensors")).items()
               if not k.startswith("language_model.") and "post_layernorm.weight" not in k}
    write_mmproj(str(tmp_path / "short.gguf"), "gemma3", vision, weights, 64, [0.5] * 3, [0.5] * 3, scale_factor=2)
    with pytest.raises(ValueError, match=r"needs are not in it: .*post_layernorm.weight \(v.post_ln.weight\)"):
        LLM(model, kv_cache_gb=0.01, max_model_len=512, mmproj=str(tmp_path / "short.gguf"))
    # Another model's projector beside it (rows of another width): left alone, a text model.
    alone = tmp_path / "another"
    alone.mkdir()
    shutil.copy(model, alone / "m.gguf")
    write_mmproj(str(alone / "mmproj-other.gguf"), "gemma3", vision, weights, 128, [0.5] * 3, [0.5] * 3, scale_factor=2)
    llm = LLM(str(alone / "m.gguf"), kv_cache_gb=0.01, max_model_len=512)
    try:
        assert llm.engine.vision is None and llm.engine.vision_refusal is None
    finally:
        llm.close()
    # Two projectors beside the model: ambiguous, name one.
    shutil.copy(mmproj, other / "mmproj-m-2.gguf")
    with pytest.raises(ValueError, match="name one with --mmproj"):
        LLM(str(other / "m.gguf"), kv_cache_gb=0.01, max_model_len=512)


@pytest.mark.parametrize("vision_gguf", ["gemma3"], indirect=True)
def test_f16_and_q8_0_projector_files_load(vision_gguf, tmp_path):
    """Projector files as they are published: matrices in F16 (the converter's default) or
    Q8_0, dequantized at load; the first token's distribution stays the F32 file's."""
    from gguf import GGMLQuantizationType as Q

    family, folder, out = vision_gguf
    with open(os.path.join(folder, "config.json")) as fh:
        vision = json.load(fh)["vision_config"]
    weights = {k: v for k, v in mx.load(os.path.join(folder, "model.safetensors")).items()
               if not k.startswith("language_model.")}
    model = str(out / "gemma3-tiny-F32.gguf")
    first = {}
    for quant in (None, Q.F16, Q.Q8_0):
        path = str(out / "mmproj-gemma3-tiny-F32.gguf" if quant is None else tmp_path / f"mmproj-{quant.name}.gguf")
        if quant is not None:
            write_mmproj(path, "gemma3", vision, weights, 64, [0.5] * 3, [0.5] * 3, scale_factor=2, quant=quant)
        llm = LLM(model, kv_cache_gb=0.01, max_model_len=512, mmproj=path)
        try:
            first[quant] = dict(llm.chat(ask("what is it", picture(0)), FIRST).logprobs[0].top)
        finally:
            llm.close()
    for quant, tol in ((Q.F16, 1e-2), (Q.Q8_0, 5e-2)):  # (measured 2.6e-3 and 1.9e-2 on this tiny tower)
        # (the same best token; the last of the top few may swap with a near-tie)
        assert max(first[quant], key=first[quant].get) == max(first[None], key=first[None].get)
        common = first[quant].keys() & first[None].keys()
        assert len(common) >= len(first[None]) - 1, (quant, first)
        assert max(abs(first[quant][t] - first[None][t]) for t in common) < tol, (quant, first)


@pytest.mark.parametrize("vision_gguf", ["gemma3"], indirect=True)
def test_a_models_folder_lists_projectors_with_their_models_not_as_models(vision_gguf, tmp_path):
    """LM Studio's layout (a folder per model, its projector beside it) under --models-dir: the
    folder serves the model file, whatever the names sort as; a projector alone is no model."""
    from macinfer.server.model_sources import discover

    family, folder, out = vision_gguf
    (tmp_path / "gemma-vision").mkdir()
    shutil.copy(out / "gemma3-tiny-F32.gguf", tmp_path / "gemma-vision" / "tiny-F32.gguf")  # ("mmproj" sorts first)
    shutil.copy(out / "mmproj-gemma3-tiny-F32.gguf", tmp_path / "gemma-vision" / "mmproj-tiny-F32.gguf")
    shutil.copy(out / "mmproj-gemma3-tiny-F32.gguf", tmp_path / "mmproj-stray-F16.gguf")
    sources = discover(str(tmp_path), False)
    assert [(s.name, os.path.basename(s.path)) for s in sources] == [("gemma-vision", "tiny-F32.gguf")]
    llm = LLM(sources[0].path, kv_cache_gb=0.01, max_model_len=512)
    try:
        assert llm.engine.vision is not None and llm.engine.vision.projector.endswith("mmproj-tiny-F32.gguf")
    finally:
        llm.close()
