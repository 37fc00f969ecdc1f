"""Tiny random vision-language checkpoints built with mlx-vlm's own classes (a tiny vision
tower, a tiny language model, an offline byte tokenizer and the family's processor: each
family's builder is in `tests/vision_families/`), and mlx-vlm's own greedy generation on
them: the reference for the engine's image path."""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from macinfer.sampling_params import SamplingParams
from macinfer.vision.processor_fixes import mend
from tests.helpers import linear_start, randomize_packs
from tests.vision_families import (ANYRES, BOTH_WAYS, BUILDERS, LEAD_FIRST, PROMPT_ONLY, REFERENCE_TEXT,  # noqa: F401
                                   TEXT_FIXED, TIED, VARIANTS, WEIGHT_LAYOUTS)
from tests.vision_families.gemma import PALIGEMMA_2  # noqa: F401
from tests.vision_families.qwen import MINICPMV_MOE  # noqa: F401


def _off_constant(v: mx.array) -> mx.array:
    """A scale or norm jittered about its value; a matrix or table random, as a Linear's start."""
    return v + 0.1 * mx.random.normal(v.shape) if v.ndim < 2 else linear_start(v.shape)


def tiny_vlm_dir(base: str, family: str, seed: int = 0, text: dict | None = None, vision: dict | None = None,
                 max_pixels: int | None = None, variant: str | None = None) -> str:
    """A checkpoint folder as mlx-community publishes one: config, weights, tokenizer, processor.
    `text`, `vision`: sizes over the tiny ones (benchmarks); `max_pixels`: the processor's cap;
    `variant`: a `VARIANTS` builder of the family's other layout."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    path = os.path.join(str(base), f"{variant or family}-{seed}" + ("-sized" if text or vision or max_pixels else ""))
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    cfg, processor = (VARIANTS[variant] if variant else BUILDERS[family])(path)
    (cfg["text_config"] if "text_config" in cfg else cfg).update(text or {})
    cfg["vision_config"].update(vision or {})
    if max_pixels:
        processor.image_processor.max_pixels = max_pixels
    module, _ = get_model_and_args(cfg)
    loaded = {**cfg, "text_config": cfg.get("text_config", {})}  # as mlx-vlm's load_model sees it
    conf = update_module_configs(module.ModelConfig.from_dict(loaded), module, loaded,
                                 ["text", "vision", "perceiver", "projector", "audio"])  # as its load_model
    mx.random.seed(seed)
    model = module.Model(conf)
    # Norms jittered off 1 so a mix-up shows in the logits.
    params = {k: (v + 0.1 * mx.random.normal(v.shape) if "norm" in k else v)
              for k, v in tree_flatten(model.parameters())}
    # A router initialised to zeros (mlx-vlm's DeepSeek gate) ties every expert, and libraries
    # break ties differently: random rows instead.
    params = {k: (0.5 * mx.random.normal(v.shape) if k.endswith("gate.weight") and not mx.any(v).item() else v)
              for k, v in params.items()}
    # Towers' parameters that start constant (position tables, layer scales, norms not named
    # "norm", class tokens, Gemma 3's projection of ones, MoonViT's position table of ones) set
    # off it too: else a table read transposed, or a scale or norm left out, would pass
    # (MoonViT's transposed did). (Biases keep their zeros: a bias left out reads as zero anyway.)
    params = {k: (_off_constant(v) if not k.startswith("language_model.") and v.size > 1
                  and not k.endswith(".bias") and mx.all(v == v.reshape(-1)[0]).item() else v)
              for k, v in params.items()}
    randomize_packs(params)
    if (variant or family) in WEIGHT_LAYOUTS:
        params = WEIGHT_LAYOUTS[variant or family](params, seed)
    if family in TIED:  # as published: no lm_head (mlx-vlm copies the embedding, mlx-lm ties it)
        params.pop("language_model.lm_head.weight", None)
    mx.eval(params)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), params)
    processor.save_pretrained(path)
    return path


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)


def ask(text: str, *images) -> list[dict]:
    """One user message: the images, then the text."""
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


def as_mlx_vlm(llm: Any, path: str, rendered: str, pictures: list) -> None:
    """The engine's greedy tokens are mlx-vlm's for `pictures` (the prompt as `rendered` for
    mlx-vlm's processor), and its first-token logprobs to float32 rounding."""
    conv = ask("what is it", *pictures)
    ours = llm.chat(conv, GREEDY).token_ids
    first = llm.chat(conv, FIRST).logprobs[0].top
    tokens, logprobs = mlx_vlm_greedy(path, rendered, pictures, 8)
    assert ours == tokens
    assert max(abs(lp - logprobs[t]) for t, lp in first) < 1e-4


def picture(seed: int, size: tuple[int, int] = (40, 50)):
    """A random RGB picture (height, width)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8"))


def _mx(v: Any) -> Any:
    return v if isinstance(v, (list, tuple, dict, str)) else mx.array(v)


def mlx_vlm_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """mlx-vlm's own load, processor and generation loop, greedy: the reference tokens, and
    the log-probabilities of the first."""
    from mlx_vlm import load
    from mlx_vlm.generate.ar import generate_step

    model, processor = load(path)
    # (mlx-vlm's Llama 4 image processor leaves out the global tile its prompt counts: mended as the engine does)
    mend(processor, model.config.model_type)
    from mlx_vlm.models.base import BaseImageProcessor

    if isinstance(getattr(processor, "image_processor", None), BaseImageProcessor):  # a tokenizer and its own
        from mlx_vlm.utils import prepare_inputs

        inputs = {k: np.array(v) for k, v in prepare_inputs(processor, images=images, prompts=prompt,
                                                            image_token_index=model.config.image_token_index).items()}
    else:
        inputs = processor(text=[prompt], images=images, return_tensors="np")
    # (arrays as MLX arrays; lists, MiniCPM-V's per-image pixels and bounds, as they are)
    if "images" in inputs:  # (DeepSeek-OCR's: mlx-vlm's `prepare_inputs` renames it)
        inputs["pixel_values"] = inputs.pop("images")
    extras = {k: _mx(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
    ids, mask = mx.array(inputs["input_ids"]), mx.array(inputs["attention_mask"])
    steps = generate_step(ids, model, _mx(inputs["pixel_values"]), mask, max_tokens=max_tokens,
                          temperature=0.0, **extras)
    tokens, first = [], None
    for (t, logprobs), _ in zip(steps, range(max_tokens)):
        tokens.append(int(t))
        first = np.array(logprobs.astype(mx.float32)).reshape(-1) if first is None else first
    return tokens, first


def mlx_vlm_prompt(path: str, text: str, num_images: int) -> str:
    """The prompt mlx-vlm's own `apply_chat_template` writes for one user message."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_config

    _, processor = load(path)
    return apply_chat_template(processor, load_config(path), text, num_images=num_images)


def _image_id(path: str) -> int:
    """The checkpoint's image placeholder id, as the engine reads it (Moondream's 0, which its
    config does not name)."""
    from macinfer.vision.families import image_token_id

    with open(os.path.join(path, "config.json")) as f:
        return image_token_id(json.load(f))


def _allowed(ids: list[int], image_id: int, both_ways: bool) -> np.ndarray:
    """Causal, and (`both_ways`) each image's run of placeholders attending to itself whole."""
    n = len(ids)
    allowed = np.tril(np.ones((n, n), dtype=bool))
    image = np.flatnonzero(np.asarray(ids) == image_id)
    if both_ways and len(image):
        for block in np.split(image, np.flatnonzero(np.diff(image) > 1) + 1):
            allowed[np.ix_(block, block)] = True
    return allowed


def prompt_logprobs(path: str, prompt: str, images: list, both_ways: bool, prefix: bool = False) -> np.ndarray:
    """mlx-vlm's classes (float32): each prompt token's logprob given the ones before it, under
    the causal mask, transformers' Gemma 3 mask (`both_ways`) or a prefix LM's (`prefix`: the
    whole prompt both ways)."""
    from mlx_vlm import load

    model, processor = load(path)
    inputs = processor(text=[prompt], images=images, return_tensors="np")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    x = mx.array(ids)[None]
    extras = {k: _mx(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
    emb = model.get_input_embeddings(x, mx.array(inputs["pixel_values"]), mask=mx.ones(x.shape, dtype=mx.int32),
                                     **extras)
    allowed = np.ones((len(ids), len(ids)), dtype=bool) if prefix else _allowed(ids, _image_id(path), both_ways)
    mask = mx.array(allowed)[None, None]
    out = model.language_model(x, inputs_embeds=emb.inputs_embeds, mask=mask)
    logits = (out.logits if hasattr(out, "logits") else out)[0].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return logprobs[np.arange(len(ids) - 1), ids[1:]]


def both_ways_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and first logprobs from mlx-vlm's own classes (its vision tower, merge and
    language model, float32) with transformers' mask: causal, but an image's placeholder tokens
    attend to each other both ways. The whole sequence is recomputed for each token (no cache)."""
    from mlx_vlm import load

    model, processor = load(path)
    inputs = processor(text=[prompt], images=images, return_tensors="np")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    image_id = _image_id(path)
    prompt_ids = np.asarray(ids)  # (a generated token with the image's id is text: the mask is the prompt's)
    pixels = mx.array(inputs["pixel_values"])
    extras = {k: _mx(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}

    def forward(x: mx.array, ids: list[int]):
        emb = model.get_input_embeddings(x, pixels, mask=mx.ones(x.shape, dtype=mx.int32), **extras).inputs_embeds
        shown = np.concatenate([prompt_ids, np.full(len(ids) - len(prompt_ids), -1)])
        return model.language_model(x, inputs_embeds=emb, mask=mx.array(_allowed(shown, image_id, True))[None, None])

    return _greedy_whole(forward, ids, max_tokens)


def gemma3n_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Gemma 3n as transformers runs it: mlx-vlm's tower, vision embedding and merge (float32),
    each text row scaled by sqrt(hidden) as transformers' scaled word embedding does (mlx-vlm's
    merge leaves text rows unscaled), into mlx-lm's Gemma 3n language model on the same weights
    (mlx-vlm's turns the queries of its KV-sharing layers by a position read from a cache their
    source layer has already advanced: shifted by the prompt's length). Recomputed whole for
    each token, with a fresh cache (the KV-sharing layers read their source's keys from it)."""
    from mlx_lm.models import gemma3n as lm_gemma3n
    from mlx_vlm import load

    model, processor = load(path)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)["text_config"]
    lm = lm_gemma3n.Model(lm_gemma3n.ModelArgs.from_dict({"model_type": "gemma3n", "text_config": text}))
    lm.load_weights([(f"model.language_model.{k[len('model.'):]}", v)
                     for k, v in tree_flatten(model.language_model.parameters())])
    inputs = processor(text=[prompt], images=images, return_tensors="np")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    pixels = mx.array(inputs["pixel_values"])
    first_own_id, scale = model.config.vision_config.vocab_offset, text["hidden_size"] ** 0.5

    def forward(x: mx.array, ids: list[int]):
        emb = model.get_input_embeddings(x, pixels).inputs_embeds
        emb = mx.where((x < first_own_id)[..., None], emb * scale, emb)
        return lm(x, cache=lm.make_cache(), input_embeddings=emb)

    return _greedy_whole(forward, ids, max_tokens)


def lead_first_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Molmo 1 as its published processor prompts it: BOS (EOS where the tokenizer has none),
    then the images' tokens, then the text (`prompt`, which starts with that token's text);
    mlx-vlm's processor leaves the first token out. mlx-vlm's classes, float32, on its
    processor's image tokens and indices shifted one on; recomputed whole for each token."""
    from mlx_vlm import load

    model, processor = load(path)
    tok = processor.tokenizer
    lead = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    inputs = processor(text=[prompt.removeprefix(tok.decode([lead]))], images=images)
    ids = [lead] + np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    index = np.asarray(inputs["image_input_idx"])
    extras = {"image_input_idx": mx.array(np.where(index < 0, index, index + 1)), "image_masks": inputs["image_masks"]}

    def forward(x: mx.array, ids: list[int]):
        emb = model.get_input_embeddings(x, inputs["pixel_values"], **extras).inputs_embeds
        return model.language_model(x, inputs_embeds=emb)

    return _greedy_whole(forward, ids, max_tokens)


def _greedy_whole(forward, ids: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens, recomputing the whole sequence each time (`forward(x, ids)` -> logits),
    and the first token's logprobs."""
    tokens, first = [], None
    for _ in range(max_tokens):
        out = forward(mx.array(ids)[None], ids)
        logits = (out.logits if hasattr(out, "logits") else out)[0, -1].astype(mx.float32)
        logprobs = np.array(logits - mx.logsumexp(logits))
        first = logprobs if first is None else first
        tokens.append(int(np.argmax(logprobs)))
        ids.append(tokens[-1])
    return tokens, first


def _pack_anyres(feats: np.ndarray, newline: np.ndarray, size: tuple[int, int], pinpoints: list,
                 tile: int, side: int) -> np.ndarray:
    """transformers' LLaVA-NeXT `pack_image_features` for one image, in NumPy: feats [tiles, side*side, D]."""
    from transformers.image_processing_utils import select_best_resolution

    base, rest = feats[0], feats[1:]
    best_h, best_w = select_best_resolution(list(size), pinpoints)
    gh, gw = best_h // tile, best_w // tile
    x = rest[: gh * gw].reshape(gh, gw, side, side, -1)
    x = np.transpose(x, (4, 0, 2, 1, 3)).reshape(x.shape[-1], gh * side, gw * side)  # permute(4,0,2,1,3), flatten
    (oh, ow), (ch, cw) = size, x.shape[1:]
    if ow / oh > cw / ch:
        pad = (ch - int(round(oh * (cw / ow), 7))) // 2
        x = x[:, pad: ch - pad, :]
    else:
        pad = (cw - int(round(ow * (ch / oh), 7))) // 2
        x = x[:, :, pad: cw - pad]
    x = np.concatenate([x, np.broadcast_to(newline[:, None, None], (x.shape[0], x.shape[1], 1))], axis=-1)
    return np.concatenate([base, x.reshape(x.shape[0], -1).T], axis=0)


def anyres_greedy(path: str, prompt: str, images: list, max_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and first logprobs from mlx-vlm's own LLaVA-NeXT classes (tower, projector,
    newline, language model; float32) with the image packed as transformers packs it. The whole
    sequence is recomputed for each token (no cache)."""
    from mlx_vlm import load

    model, processor = load(path)
    cfg = model.config
    inputs = processor(text=[prompt], images=images, return_tensors="np")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    pixel_values = mx.array(np.asarray(inputs["pixel_values"]))[0]
    size = tuple(int(v) for v in np.asarray(inputs["image_sizes"]).reshape(-1)[:2])
    *_, hidden = model.vision_tower(pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    layers = raw["vision_feature_layer"] if isinstance(raw["vision_feature_layer"], list) else [raw["vision_feature_layer"]]
    skip = 1 if raw["vision_feature_select_strategy"] == "default" else 0
    feats = model.multi_modal_projector(mx.concatenate([hidden[i][:, skip:] for i in layers], axis=-1))
    pinpoints = raw["image_grid_pinpoints"]
    rows = _pack_anyres(np.array(feats, dtype=np.float64), np.array(model.image_newline, dtype=np.float64), size,
                        pinpoints, cfg.vision_config.image_size,
                        cfg.vision_config.image_size // cfg.vision_config.patch_size)
    at = np.flatnonzero(np.asarray(ids) == cfg.image_token_index)
    assert len(at) == len(rows), (len(at), len(rows))  # transformers' processor counted the same rows

    def forward(x: mx.array, ids: list[int]):
        emb = np.array(model.language_model.model.embed_tokens(x)[0], dtype=np.float32)
        emb[at] = rows
        return model.language_model(x, inputs_embeds=mx.array(emb)[None])

    return _greedy_whole(forward, ids, max_tokens)
