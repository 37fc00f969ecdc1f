"""Vision projector files (llama.cpp's `mmproj-*.gguf`) and byte-level tokenizers written by the
tests as llama.cpp's converter writes them, with its own `gguf` package."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q

from tests.gguf_writer import _write_tensors, permute_qk

CLIP_BOUNDS = (".input_min", ".input_max", ".output_min", ".output_max")  # (Gemma 4's clippable linears)


def hf_tokenizer_meta(hf) -> dict:
    """`write_gguf`'s tokenizer for a byte-level BPE `PreTrainedTokenizerFast` (the tests' byte
    tokenizer and its added tokens): llama.cpp's token types (3 control, 4 user-defined, 1 normal)."""
    vocab = hf.get_vocab()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    added = {t.content: t.special for t in hf.added_tokens_decoder.values()}
    types = [(3 if added[t] else 4) if t in added else 1 for t in tokens]
    return {"model": "gpt2", "pre": "default", "vocab": (tokens, [0.0] * len(tokens), types), "merges": [],
            "chat_template": hf.chat_template}


def write_mmproj(path: str, projector: str, vision: dict, weights: dict, text_hidden: int, image_mean: list,
                 image_std: list, scale_factor: int | None = None, name: str | None = None,
                 preproc_image_size: int | None = None, quant: Q | None = None, extra: dict | None = None,
                 split_qkv: bool = True, renamed: dict | None = None, permute_heads: int | None = None,
                 qkv_form: tuple[str, str] = (".qkv.", ".{p}."), bare_weights: tuple[str, ...] = (),
                 linear_patches: int | None = None, checkpoint=None, converted=None) -> None:
    """A vision projector file as llama.cpp's converter writes one (`general.architecture` clip):
    `weights` in mlx-vlm's names and layout, named by llama.cpp's tensor map under the
    checkpoint's names (a bare `*_weight` parameter as `*.weight`; Idefics3's under `model.`,
    Qwen-VL's tower under `visual.`), convolutions in PyTorch's layout, Gemma 3's `soft_emb_norm`
    + 1, a fused `qkv` split into q, k, v and a Conv3D into its two temporal slices (Qwen-VL).
    `vision`: image_size, patch_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads (layer_norm_eps); `extra`: GGUFWriter's `add_vision_*` calls by suffix;
    `split_qkv`: False where the converter keeps a fused qkv (Qwen3-VL); `renamed`: names the
    converter writes by hand (mlx-vlm's parameter -> the file's); `permute_heads`: the tower's
    Q and K rows permuted as llama.cpp does Llama's, over this many heads (Pixtral); `qkv_form`:
    how a split qkv is named (InternViT's `.attn.qkv.` -> `.self_attn.{p}_proj.`); `bare_weights`:
    parameters without a suffix that the converter names `.weight` (InternViT's layer scales and
    position embedding); `linear_patches`: a linear patch embedding over patches of this size,
    stored as a convolution's [out, 3, p, p] (LFM2-VL's); `checkpoint`: mlx-vlm's parameter ->
    the checkpoint's, where mlx-vlm's sanitize moved it; `converted`: (the file's name, tensor) ->
    the tensor as the converter changes it beyond the rules above."""
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision["num_hidden_layers"], 8))
    w = gguf.GGUFWriter(path, "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    if name:
        w.add_name(name)
    if preproc_image_size:
        w.add_vision_preproc_image_size(preproc_image_size)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(projector)
    w.add_vision_projection_dim(text_hidden)
    w.add_vision_image_size(vision["image_size"])
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(vision["num_hidden_layers"])
    w.add_vision_head_count(vision["num_attention_heads"])
    w.add_vision_image_mean(image_mean)
    w.add_vision_image_std(image_std)
    w.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    w.add_vision_use_gelu(True)
    if scale_factor is not None:
        w.add_vision_projector_scale_factor(scale_factor)
    for call, value in (extra or {}).items():
        getattr(w, f"add_vision_{call}")(value)

    def gguf_name(key: str) -> str:
        if renamed and key in renamed:
            return renamed[key]
        hf = key[: -len("_weight")] + ".weight" if key.endswith("_weight") else key
        for cand in (hf, "model." + hf, hf.replace("vision_tower.", "visual.", 1),
                     hf.replace("vision_tower.vision_model.", "vision_tower.", 1), "vision_tower." + hf,
                     hf.replace("vision_tower.", "vision_tower.vision_model.", 1)):
            if (found := tmap.get_name(cand, try_suffixes=(".weight", ".bias", *CLIP_BOUNDS))) is not None:
                bare = not found.endswith((".weight", ".bias")) and any(b in found for b in bare_weights)
                return found + ".weight" if bare else found
        raise AssertionError(f"no llama.cpp name for {key}")

    tensors = {}
    for key, value in weights.items():
        key = checkpoint(key) if checkpoint else key
        x = np.array(value.astype(mx.float32), dtype=np.float32)
        if x.ndim in (4, 5):  # MLX's [out, ..., in] -> PyTorch's [out, in, ...]
            x = np.moveaxis(x, -1, 1)
        if qkv_form[0] in key and split_qkv:
            for part, rows in zip("qkv", np.split(x, 3, axis=0)):
                tensors[gguf_name(key.replace(qkv_form[0], qkv_form[1].format(p=part)))] = rows
            continue
        name = gguf_name(key)
        if linear_patches and name == "v.patch_embd.weight":  # (the converter's view(out, p, p, 3).permute)
            x = x.reshape(x.shape[0], linear_patches, linear_patches, 3).transpose(0, 3, 1, 2)
        if converted:
            x = converted(name, x)
        if name.endswith("soft_emb_norm.weight"):
            x = x + 1
        if permute_heads and name.endswith(("attn_q.weight", "attn_k.weight")):
            x = permute_qk(x, permute_heads)
        if x.ndim == 5:  # Conv3D [out, in, t, kh, kw]: one Conv2D per temporal slice
            tensors[name], tensors[f"{name}.1"] = x[:, :, 0], x[:, :, 1]
            continue
        tensors[name] = x
    # `quant`: the matrices in that type (the converter's F16 default, or Q8_0 where rows are whole blocks)
    types = {n: quant for n, x in tensors.items() if quant is not None and x.ndim >= 2
             and (quant != Q.Q8_0 or x.shape[-1] % 32 == 0)}
    _write_tensors(w, tensors, types, encode=True)
