"""A GGUF model's vision projector (llama.cpp's `mmproj-*.gguf`: the vision tower and the
projector of a vision checkpoint, `general.architecture = clip`), read back into the
checkpoint layout mlx-vlm loads, so a GGUF vision model takes images through the same
path as an MLX folder (`vision/support.py`).

The tensors are named by llama.cpp's own name map (the `gguf` package's `TensorNameMap`,
which its converter writes them by), undoing what the converter does beyond renaming
(convolutions kept in PyTorch's layout, a fused qkv or a Conv3D split; each family's own
changes and hand-written names are in `mmproj_families.py`).
The processor is built from the file's hyperparameters (image size, mean, std) with the
family's own processor class, and the tokenizer read from the model's GGUF (its files
written into a temporary directory at load, where the processor loading reads them, and
removed after). The weights go straight into the family's mlx-vlm model.

Projector types that run: `PROJECTORS` (others are refused with the type named).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from macinfer.gguf.file import GGUFFile
from macinfer.gguf.mmproj_families import FIXED_SIZE, GEMMA3_TOKENS, MmprojError, Projector, meta_value, projector_kind
from macinfer.gguf.mmproj_native import NATIVE_SIZE

# llama.cpp's projector type -> how it maps back onto its mlx-vlm family
PROJECTORS: dict[str, Projector] = {**FIXED_SIZE, **NATIVE_SIZE}
# the tokens a family's processor finds by name on its tokenizer
NAMED_TOKENS = {"gemma3": GEMMA3_TOKENS, "glm4v": {"image_token": "<|image|>", "video_token": "<|video|>"},
               "dots_ocr": {"image_token": "<|imgpad|>", "video_token": "<|video_pad|>"},
               "gemma4v": {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>"}}


def is_projector_file(name: str) -> bool:
    """A vision projector by its name (llama.cpp's and LM Studio's `mmproj-*.gguf`): never a
    model to list or serve on its own."""
    return name.endswith(".gguf") and "mmproj" in os.path.basename(name).lower()


def find_mmproj(model_path: str, given: str | None) -> str | None:
    """The projector file: `given` (`--mmproj`), else the one `mmproj*.gguf` beside the model
    file (LM Studio's and the GGUF repos' layout); None when there is none."""
    if given:
        if not os.path.isfile(given):
            raise MmprojError(f"--mmproj {given}: no such file")
        return given
    folder = os.path.dirname(os.path.abspath(model_path))
    found = sorted(os.path.join(folder, n) for n in os.listdir(folder) if is_projector_file(n))
    if len(found) > 1:
        names = ", ".join(map(os.path.basename, found))
        raise MmprojError(f"{len(found)} vision projectors beside the model ({names}): name one with --mmproj")
    return found[0] if found else None


def fits(path: str, text_config: dict[str, Any]) -> bool:
    """Whether the projector file at `path` writes rows of the language model's width (a
    projector found beside a model may be another model's, in a folder of several)."""
    width = GGUFFile(path).metadata.get("clip.vision.projection_dim")
    return width is None or int(width) == int(text_config.get("hidden_size", -1))


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


def _lookup(f: GGUFFile, names: Any, key: str, fix: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray],
            given: str | None = None) -> tuple[str | None, np.ndarray | None]:
    """(llama.cpp's name, the tensor as the checkpoint held it) for mlx-vlm's parameter `key`,
    or (the name looked for, None). What the converter renamed or split is undone here: a bare
    `*_weight` is `*.weight`; the checkpoint's own prefix (Idefics3's `model.`, Qwen-VL's
    `visual.` for mlx-vlm's `vision_tower.`, Pixtral's tower without `vision_model.`); a fused
    `qkv` split into q, k, v; a Conv3D split into its two temporal slices (`.weight`, `.weight.1`).
    `given`: the family's own name for it (`Projector.rename`)."""
    suffixes = (".weight", ".bias")
    hf = key[: -len("_weight")] + ".weight" if key.endswith("_weight") else key
    candidates = [hf, "model." + hf]
    if hf.startswith("vision_tower."):  # Qwen-VL's `visual.`; Pixtral's tower without `vision_model.`,
        candidates += [hf.replace("vision_tower.", "visual.", 1),  # LFM2-VL's with it (mlx-vlm drops it)
                       hf.replace("vision_tower.vision_model.", "vision_tower.", 1),
                       hf.replace("vision_tower.", "vision_tower.vision_model.", 1)]
    elif hf.startswith("vision_model."):  # InternViT's, which the converter puts under `vision_tower.`
        candidates.append("vision_tower." + hf)

    def read(name: str) -> np.ndarray:
        return fix(name, np.asarray(f.dequantize(name), dtype=np.float32), f.metadata)

    def found(name: str | None) -> str | None:  # (a bare parameter the converter gave a `.weight`: InternViT's)
        return next((n for n in (name, f"{name}.weight") if name and n in f.tensors), None)

    if given is not None:  # named by the family's own rule
        return given, read(given) if given in f.tensors else None
    first = None
    for cand in candidates:
        name = names.get_name(cand, try_suffixes=suffixes)
        first = first or name
        if found(name):
            x = read(found(name))
            if f"{name}.1" in f.tensors:  # a Conv3D's temporal slices: [out, in, kh, kw] each
                x = np.stack([x, read(f"{name}.1")], axis=2)
            return found(name), x
        if "qkv." in cand:  # split as q, k, v (Qwen-VL's), self_attn.{q,k,v}_proj (InternViT's), wq, wk, wv (MoonViT's)
            for form in (lambda p: cand.replace(".qkv.", f".{p}."),
                         lambda p: cand.replace(".attn.qkv.", f".self_attn.{p}_proj."),
                         lambda p: cand.replace(".wqkv.", f".w{p}.")):
                parts = [names.get_name(form(p), try_suffixes=suffixes) for p in "qkv"]
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
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(int(meta_value(f, "clip.vision.block_count")), 8))
    out, missing = {}, []
    for key, shape in wanted.items():
        name, x = _lookup(f, names, recipe.checkpoint(key), recipe.fix, recipe.rename(key, config))
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
