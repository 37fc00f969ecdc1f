"""A GGUF model's vision projector (llama.cpp's `mmproj-*.gguf`: the vision tower and the
projector of a vision checkpoint, `general.architecture = clip`), read back into the
checkpoint layout mlx-vlm loads, so a GGUF vision model takes images through the same
path as an MLX folder (`vision/support.py`).

The tensors are named by llama.cpp's own name map (the `gguf` package's `TensorNameMap`,
which its converter writes them by), undoing what the converter does beyond renaming
(4D convolution weights kept in PyTorch's layout, Gemma 3's `soft_emb_norm` stored + 1).
The processor is built from the file's hyperparameters (image size, mean, std) with the
family's own processor class, and the tokenizer read from the model's GGUF (its files
written into a temporary directory at load, where the processor loading reads them, and
removed after). The weights go straight into the family's mlx-vlm model.

Projector types that run: `PROJECTORS` (others are refused with the type named).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from macinfer.gguf.file import GGUFFile


class MmprojError(ValueError):
    """Why a GGUF's vision projector cannot be used (a load-time reason)."""


def find_mmproj(model_path: str, given: str | None) -> str | None:
    """The projector file: `given` (`--mmproj`), else the one `mmproj*.gguf` beside the model
    file (LM Studio's and the GGUF repos' layout); None when there is none."""
    if given:
        if not os.path.isfile(given):
            raise MmprojError(f"--mmproj {given}: no such file")
        return given
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(model_path)), "*mmproj*.gguf")))
    if len(found) > 1:
        raise MmprojError(f"{len(found)} vision projectors beside the model ({', '.join(map(os.path.basename, found))}):"
                          " name one with --mmproj")
    return found[0] if found else None


def fits(path: str, text_config: dict[str, Any]) -> bool:
    """Whether the projector file at `path` writes rows of the language model's width (a
    projector found beside a model may be another model's, in a folder of several)."""
    width = GGUFFile(path).metadata.get("clip.vision.projection_dim")
    return width is None or int(width) == int(text_config.get("hidden_size", -1))


def _meta(f: GGUFFile, key: str, default: Any = None) -> Any:
    value = f.metadata.get(key, default)
    if value is None:
        raise MmprojError(f"{os.path.basename(f.path)}: its metadata has no {key}")
    return value


@dataclass(frozen=True)
class Projector:
    """How one llama.cpp projector type maps back onto an mlx-vlm family."""
    config: Callable[[GGUFFile, dict[str, Any], Any], dict[str, Any]]  # (mmproj, text config, tokenizer) -> config
    processor: Callable[[GGUFFile, dict[str, Any], Any], Any]  # (mmproj, config, HF tokenizer) -> processor
    fix: Callable[[str, np.ndarray], np.ndarray] = lambda name, x: x  # a tensor as the checkpoint holds it
    # mlx-vlm's parameter -> the file's name, where the converter names it by hand (None: by the map)
    rename: Callable[[str, dict[str, Any]], str | None] = lambda key, config: None


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def _token_id(tokenizer: Any, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise MmprojError(f"the model's vocabulary has no {token} token, which its projector's prompts need")
    return int(tid)


def _gemma3_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    size, patch = int(_meta(f, "clip.vision.image_size")), int(_meta(f, "clip.vision.patch_size"))
    scale = int(f.metadata.get("clip.vision.projector.scale_factor", 4))  # (the converter writes it when not 4)
    tokens = (size // patch // scale) ** 2
    vision = {"model_type": "siglip_vision_model", "image_size": size, "patch_size": patch,
              "hidden_size": int(_meta(f, "clip.vision.embedding_length")),
              "intermediate_size": int(_meta(f, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(_meta(f, "clip.vision.block_count")),
              "num_attention_heads": int(_meta(f, "clip.vision.attention.head_count")),
              "layer_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6))}
    ids = {k.replace("_token", "_token_index"): _token_id(tokenizer, t) for k, t in GEMMA3_TOKENS.items()}
    # (transformers' Gemma3TextConfig, which the processor's loading builds, takes the scalar as an int)
    text = {**text, "query_pre_attn_scalar": int(text["query_pre_attn_scalar"]), "mm_tokens_per_image": tokens}
    return {"model_type": "gemma3", "text_config": text, "vision_config": vision,
            "mm_tokens_per_image": tokens, **ids, "hidden_size": text["hidden_size"],
            "vocab_size": text["vocab_size"], "eos_token_id": text.get("eos_token_id")}


def _gemma3_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor
    from transformers import Gemma3ImageProcessor

    size = config["vision_config"]["image_size"]
    images = Gemma3ImageProcessor(size={"height": size, "width": size},
                                  image_mean=[float(x) for x in _meta(f, "clip.vision.image_mean")],
                                  image_std=[float(x) for x in _meta(f, "clip.vision.image_std")])
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=config["mm_tokens_per_image"],
                           chat_template=tokenizer.chat_template)


def _gemma3_fix(name: str, x: np.ndarray) -> np.ndarray:
    # llama.cpp's converter stores the projector's RMSNorm as 1 + w (Gemma's rule); the tower's are plain.
    return x - 1 if name.endswith("soft_emb_norm.weight") else x


def _idefics3_type(f: GGUFFile) -> str:
    """SmolVLM and Idefics3 share llama.cpp's projector type; the file's name tells them apart."""
    name = f"{f.metadata.get('general.name', '')} {f.metadata.get('general.basename', '')}".lower()
    return "smolvlm" if "smolvlm" in name else "idefics3"


def _idefics3_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    kind = _idefics3_type(f)
    vision = {"model_type": f"{kind}_vision", "image_size": int(_meta(f, "clip.vision.image_size")),
              "patch_size": int(_meta(f, "clip.vision.patch_size")),
              "hidden_size": int(_meta(f, "clip.vision.embedding_length")),
              "intermediate_size": int(_meta(f, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(_meta(f, "clip.vision.block_count")),
              "num_attention_heads": int(_meta(f, "clip.vision.attention.head_count")),
              "layer_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-5))}
    return {"model_type": kind, "text_config": text, "vision_config": vision,
            "scale_factor": int(f.metadata.get("clip.vision.projector.scale_factor", 2)),
            "image_token_id": _token_id(tokenizer, "<image>"), "vocab_size": text["vocab_size"],
            "eos_token_id": text.get("eos_token_id")}


def _idefics3_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.idefics3.processing_idefics3 import Idefics3Processor
    from mlx_vlm.models.smolvlm.processing_smolvlm import SmolVLMProcessor
    from transformers import Idefics3ImageProcessor, SmolVLMImageProcessor

    vision = config["vision_config"]
    size = vision["image_size"]
    longest = int(f.metadata.get("clip.vision.preproc_image_size", size))
    image_class, processor_class = ((SmolVLMImageProcessor, SmolVLMProcessor) if config["model_type"] == "smolvlm"
                                    else (Idefics3ImageProcessor, Idefics3Processor))
    # Split into tiles when the preprocessor's edge is past the tower's, as llama.cpp does.
    images = image_class(do_image_splitting=longest > size, size={"longest_edge": longest},
                         max_image_size={"longest_edge": size},
                         image_mean=[float(x) for x in _meta(f, "clip.vision.image_mean")],
                         image_std=[float(x) for x in _meta(f, "clip.vision.image_std")])
    tokens = (size // vision["patch_size"]) ** 2 // config["scale_factor"] ** 2
    return processor_class(image_processor=images, tokenizer=tokenizer, image_seq_len=tokens,
                           chat_template=tokenizer.chat_template)


def _qwen_vl_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Qwen2-VL's (`qwen2vl_merger`) or Qwen2.5-VL's (`qwen2.5vl_merger`) checkpoint config."""
    kind = projector_kind(f)
    if "mrope_section" not in text:
        raise MmprojError(f"its language model's GGUF names no multimodal RoPE sections (a qwen2vl architecture's "
                          f"rope.dimension_sections): it is not the model of a {kind} projector")
    depth, width = int(_meta(f, "clip.vision.block_count")), int(_meta(f, "clip.vision.embedding_length"))
    vision = {"depth": depth, "num_heads": int(_meta(f, "clip.vision.attention.head_count")),
              "patch_size": int(_meta(f, "clip.vision.patch_size")), "temporal_patch_size": 2,
              # (llama.cpp's default where older converters wrote none)
              "spatial_merge_size": int(f.metadata.get("clip.vision.spatial_merge_size", 2)),
              "layer_norm_eps": float(f.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6))}
    if kind == "qwen2vl_merger":  # its MLP's width is its up projection's rows (the file's ffn length is not)
        up = f.tensors.get("v.blk.0.ffn_up.weight")
        if up is None or up.shape[0] % width:
            raise MmprojError(f"{os.path.basename(f.path)}: no v.blk.0.ffn_up.weight a whole multiple of the "
                              f"tower's width ({width}) to size its MLP by")
        model_type = "qwen2_vl"
        vision.update(embed_dim=width, hidden_size=int(_meta(f, "clip.vision.projection_dim")),
                      mlp_ratio=up.shape[0] // width)  # (transformers' config takes an int)
    else:
        model_type = "qwen2_5_vl"
        every = int(f.metadata.get("clip.vision.n_wa_pattern", 0))  # windowed blocks but every n-th
        vision.update(hidden_size=width, intermediate_size=int(_meta(f, "clip.vision.feed_forward_length")),
                      out_hidden_size=int(_meta(f, "clip.vision.projection_dim")),
                      window_size=int(f.metadata.get("clip.vision.window_size", 112)),  # (llama.cpp's default)
                      fullatt_block_indexes=list(range(every - 1, depth, every)) if every else list(range(depth)))
    ids = {k: _token_id(tokenizer, t) for k, t in (("image_token_id", "<|image_pad|>"),
                                                    ("video_token_id", "<|video_pad|>"),
                                                    ("vision_start_token_id", "<|vision_start|>"))}
    flat = {k: v for k, v in text.items() if k != "mrope_section"}
    return {**flat, "model_type": model_type, "rope_scaling": {"type": "mrope", "mrope_section": text["mrope_section"]},
            "vision_config": {"model_type": model_type, **vision}, **ids}


def _qwen_vl_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor  # (Qwen2.5-VL's prompts are Qwen2-VL's)
    from transformers import Qwen2VLImageProcessor

    vision = config["vision_config"]
    images = Qwen2VLImageProcessor(
        # (the published preprocessor's range where the file names none)
        min_pixels=int(f.metadata.get("clip.vision.image_min_pixels", 56 * 56)),
        max_pixels=int(f.metadata.get("clip.vision.image_max_pixels", 28 * 28 * 16384)),
        patch_size=vision["patch_size"], temporal_patch_size=2, merge_size=vision["spatial_merge_size"],
        image_mean=[float(x) for x in _meta(f, "clip.vision.image_mean")],
        image_std=[float(x) for x in _meta(f, "clip.vision.image_std")])
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    processor.video_processor = images  # (videos are refused; saving wants one, and torchvision's is absent)
    return processor


# The language models Qwen3-VL's projector type serves: llama.cpp's qwen3vl / qwen3vlmoe (Qwen3-VL)
# and qwen35 / qwen35moe (Qwen3.5 / 3.6, hybrid), as mlx-vlm's model types.
QWEN3_FAMILIES = {"qwen3": "qwen3_vl", "qwen3_moe": "qwen3_vl_moe", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}


def _qwen3vl_config(f: GGUFFile, text: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    family = QWEN3_FAMILIES.get(text.get("model_type"))
    if "mrope_section" not in text or family is None:
        raise MmprojError("its language model is not Qwen3-VL's or Qwen3.5's (llama.cpp's qwen3vl, qwen3vlmoe, "
                          "qwen35 or qwen35moe architecture, with rope.dimension_sections)")
    deep = [i for i, on in enumerate(f.metadata.get("clip.vision.is_deepstack_layers", [])) if on]
    size, patch = int(_meta(f, "clip.vision.image_size")), int(_meta(f, "clip.vision.patch_size"))
    vision = {"model_type": family, "depth": int(_meta(f, "clip.vision.block_count")),
              "num_heads": int(_meta(f, "clip.vision.attention.head_count")),
              "hidden_size": int(_meta(f, "clip.vision.embedding_length")),
              "intermediate_size": int(_meta(f, "clip.vision.feed_forward_length")),
              "out_hidden_size": int(_meta(f, "clip.vision.projection_dim")), "patch_size": patch,
              "spatial_merge_size": int(f.metadata.get("clip.vision.spatial_merge_size", 2)),
              "temporal_patch_size": 2, "num_position_embeddings": (size // patch) ** 2,
              "deepstack_visual_indexes": deep}
    ids = {k: _token_id(tokenizer, t) for k, t in (("image_token_id", "<|image_pad|>"),
                                                    ("video_token_id", "<|video_pad|>"),
                                                    ("vision_start_token_id", "<|vision_start|>"))}
    own = {k: v for k, v in text.items() if k != "mrope_section"}
    mrope = {"mrope_section": text["mrope_section"], "mrope_interleaved": True}
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        own["rope_scaling"] = {"type": "default", **mrope}
        if family == "qwen3_vl_moe":
            own["model_type"] = "qwen3_vl_moe_text"
    else:  # (Qwen3.5's text config: its own model type, RoPE under rope_parameters)
        own.update(model_type=f"{family}_text", rope_parameters={**own["rope_parameters"], **mrope})
    return {"model_type": family, "text_config": own, "vision_config": vision, **ids}


def _qwen3vl_processor(f: GGUFFile, config: dict[str, Any], tokenizer: Any) -> Any:
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, Qwen3VLProcessor

    vision = config["vision_config"]
    images = Qwen3VLImageProcessor(
        patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
        # (the published preprocessor's range where the file names none)
        min_pixels=int(f.metadata.get("clip.vision.image_min_pixels", 56 * 56)),
        max_pixels=int(f.metadata.get("clip.vision.image_max_pixels", 16 * 16 * 4 * 16384)),
        image_mean=[float(x) for x in _meta(f, "clip.vision.image_mean")],
        image_std=[float(x) for x in _meta(f, "clip.vision.image_std")])
    return Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=images,
                            chat_template=tokenizer.chat_template)


def _qwen3vl_rename(key: str, config: dict[str, Any]) -> str | None:
    """The merger's and DeepStack mergers' names, which the converter writes by hand (the
    DeepStack ones by the tower layer each reads)."""
    parts = key.split(".")
    if key.startswith("vision_tower.merger."):
        module, kind = parts[2], parts[-1]
        return {"linear_fc1": f"mm.0.{kind}", "linear_fc2": f"mm.2.{kind}", "norm": f"v.post_ln.{kind}"}.get(module)
    if key.startswith("vision_tower.deepstack_merger_list."):
        layer = config["vision_config"]["deepstack_visual_indexes"][int(parts[2])]
        return {"linear_fc1": f"v.deepstack.{layer}.fc1.{parts[-1]}", "linear_fc2": f"v.deepstack.{layer}.fc2.{parts[-1]}",
                "norm": f"v.deepstack.{layer}.norm.{parts[-1]}"}.get(parts[3])
    return None


PROJECTORS: dict[str, Projector] = {
    "gemma3": Projector(_gemma3_config, _gemma3_processor, _gemma3_fix),
    "idefics3": Projector(_idefics3_config, _idefics3_processor),  # (and SmolVLM)
    "qwen2vl_merger": Projector(_qwen_vl_config, _qwen_vl_processor),
    "qwen2.5vl_merger": Projector(_qwen_vl_config, _qwen_vl_processor),
    "qwen3vl_merger": Projector(_qwen3vl_config, _qwen3vl_processor, rename=_qwen3vl_rename),
}
NAMED_TOKENS = {"gemma3": GEMMA3_TOKENS}  # the tokens a family's processor finds by name on its tokenizer


def projector_kind(f: GGUFFile) -> str | None:
    """The file's projector type as llama.cpp names it."""
    return f.metadata.get("clip.vision.projector_type") or f.metadata.get("clip.projector_type")


def projector_type(f: GGUFFile) -> str:
    if f.metadata.get("general.architecture") != "clip":
        raise MmprojError(f"{os.path.basename(f.path)}: not a vision projector (its architecture is "
                          f"{f.metadata.get('general.architecture')!r}, an mmproj file's is 'clip')")
    if not f.metadata.get("clip.has_vision_encoder", True):
        raise MmprojError(f"{os.path.basename(f.path)}: a projector without a vision encoder (audio only)")
    kind = projector_kind(f)
    if kind not in PROJECTORS:
        raise MmprojError(f"{os.path.basename(f.path)}: its projector type {kind!r} is not read yet (macinfer reads "
                          f"{', '.join(sorted(PROJECTORS))}); the model's text runs without images")
    return kind


def _hf_tokenizer(wrapper: Any, kind: str) -> Any:
    """The model's tokenizer (from its GGUF) with the special tokens the family's processor
    looks up by name."""
    from transformers import PreTrainedTokenizerFast

    hf = wrapper.hf
    special = {k: getattr(hf, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if getattr(hf, k, None)}
    out = PreTrainedTokenizerFast(tokenizer_object=hf.backend_tokenizer, clean_up_tokenization_spaces=False,
                                  extra_special_tokens=NAMED_TOKENS.get(kind, {}), **special)
    out.chat_template = hf.chat_template
    return out


def _lookup(f: GGUFFile, names: Any, key: str, fix: Callable[[str, np.ndarray], np.ndarray],
            given: str | None = None) -> tuple[str | None, np.ndarray | None]:
    """(llama.cpp's name, the tensor as the checkpoint held it) for mlx-vlm's parameter `key`,
    or (the name looked for, None). What the converter renamed or split is undone here: a bare
    `*_weight` is `*.weight`; the checkpoint's own prefix (Idefics3's `model.`, Qwen-VL's
    `visual.` for mlx-vlm's `vision_tower.`); a fused `qkv` split into q, k, v; a Conv3D split
    into its two temporal slices (`.weight` and `.weight.1`)."""
    suffixes = (".weight", ".bias")
    hf = key[: -len("_weight")] + ".weight" if key.endswith("_weight") else key
    candidates = [hf, "model." + hf] + ([hf.replace("vision_tower.", "visual.", 1)]
                                        if hf.startswith("vision_tower.") else [])

    def read(name: str) -> np.ndarray:
        return fix(name, np.asarray(f.dequantize(name), dtype=np.float32))

    if given is not None:  # named by the family's own rule
        return given, read(given) if given in f.tensors else None
    first = None
    for cand in candidates:
        name = names.get_name(cand, try_suffixes=suffixes)
        first = first or name
        if name in f.tensors:
            x = read(name)
            if f"{name}.1" in f.tensors:  # a Conv3D's temporal slices: [out, in, kh, kw] each
                x = np.stack([x, read(f"{name}.1")], axis=2)
            return name, x
        if ".qkv." in cand:
            parts = [names.get_name(cand.replace(".qkv.", f".{p}."), try_suffixes=suffixes) for p in "qkv"]
            if all(p in f.tensors for p in parts):
                return parts[0], np.concatenate([read(p) for p in parts], axis=0)
    return first, None


def vision_model(f: GGUFFile, config: dict[str, Any], recipe: Projector, dtype: mx.Dtype) -> Any:
    """The family's mlx-vlm model (its language model left lazy: never computed, never read)
    with every tower and projector parameter found in the projector file by llama.cpp's name
    map, in mlx-vlm's layout."""
    import gguf
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    module, _ = get_model_and_args(config)
    conf = update_module_configs(module.ModelConfig.from_dict(config), module, config,
                                 ["text", "vision", "perceiver", "projector", "audio"])
    model = module.Model(conf)
    wanted = {k: v.shape for k, v in tree_flatten(model.parameters()) if not k.startswith("language_model.")}
    # (numbered names past the tower's blocks too: Qwen-VL's merger layers `mm.0`, `mm.2` are numbered so)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(int(_meta(f, "clip.vision.block_count")), 8))
    out, missing = {}, []
    for key, shape in wanted.items():
        name, x = _lookup(f, names, key, recipe.fix, recipe.rename(key, config))
        if x is None:
            missing.append(f"{key} ({name or 'no llama.cpp name'})")
            continue
        if x.ndim in (4, 5):  # a convolution in PyTorch's layout [out, in, ...]: MLX's is [out, ..., in]
            x = np.moveaxis(x, 1, -1)
        if tuple(x.shape) != tuple(shape):
            raise MmprojError(f"{os.path.basename(f.path)}: {name} has shape {tuple(x.shape)}, the model's "
                              f"{key} needs {tuple(shape)}")
        out[key] = mx.array(x).astype(dtype)
    if missing:
        raise MmprojError(f"{os.path.basename(f.path)}: {len(missing)} tensor(s) the {config['model_type']} "
                          f"tower needs are not in it: {', '.join(missing[:4])}")
    model.load_weights(list(out.items()), strict=False)  # (the language model's are the GGUF's own)
    return model


def read_projector(mmproj: str, text_config: dict[str, Any], tokenizer: Any, folder: str,
                   dtype: mx.Dtype) -> tuple[dict[str, Any], Any]:
    """(the checkpoint's config, the family's mlx-vlm model holding the tower and projector),
    with the config and the processor's and tokenizer's files written into `folder`, where
    the image path's processor loading reads them. Raises MmprojError with the reason."""
    f = GGUFFile(mmproj)
    kind = projector_type(f)
    recipe = PROJECTORS[kind]
    hf = _hf_tokenizer(tokenizer, kind)
    config = recipe.config(f, text_config, hf)
    model = vision_model(f, config, recipe, dtype)
    with open(os.path.join(folder, "config.json"), "w") as out:
        json.dump(config, out)
    recipe.processor(f, config, hf).save_pretrained(folder)
    return config, model
