"""A vision checkpoint's image side, from mlx-vlm: its own model class, weights and
sanitizing, with the language model taken out (the engine runs that one on the paged
cache); only the vision tower, the projector and what merges them stay in memory. Each
image is encoded on its own into the embedding rows of its placeholder tokens, and kept
in an LRU cache by content (an agent resending a screenshot is not encoded again)."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from macinfer.vision.inputs import ImageSpan, content_digest
from macinfer.vision.merges import Merge, merge_for

log = logging.getLogger(__name__)

# What mlx-vlm's merge may hand back besides the prompt's embeddings: each is a part of the
# model's forward that splicing rows into the embeddings alone would leave out.
_BEYOND_EMBEDDINGS = {
    "deepstack_visual_embeds": "visual features added inside the decoder layers (DeepStack)",
    "per_layer_inputs": "per-layer inputs computed from the image",
    "cross_attention_states": "cross-attention to the image",
    "position_ids": "multimodal RoPE positions",
    "rope_deltas": "multimodal RoPE positions",
    "decoder_inputs_embeds": "an encoder-decoder forward",
}


class _EmbedOnly(nn.Module):
    """Stands in for mlx-vlm's language model inside its wrapper: the engine's own token
    embedding, under the names mlx-vlm's merges call it by, and nothing else."""

    def __init__(self, embed: nn.Module, rope_index: Any = None, numbers: dict[str, Any] | None = None):
        super().__init__()
        self.model = nn.Module()
        # The language model's plain numbers and weightless modules a merge reads (Gemma 4's
        # `embed_scale`, Muse Glimmer's embedding norm); no per-layer inputs: the engine's
        # model computes those from the prompt's ids.
        for k, v in (numbers or {}).items():
            setattr(self.model, k, 0 if k == "hidden_size_per_layer_input" else v)
        self.model.embed_tokens = embed
        self.model.wte = embed  # (Molmo 2's name for it)
        self.model.get_per_layer_inputs = lambda ids: None  # (Gemma 3n's merge asks; the engine's model makes them)
        self.embed_tokens = embed
        self.embedding = embed  # (Jina-VLM's name for it, on the language model itself)
        object.__setattr__(self, "_rope_index", rope_index)  # a plain attribute: not a module child

    def get_rope_index(self, *args: Any, **kwargs: Any) -> Any:
        if self._rope_index is None:
            raise RuntimeError("this model's language model has no multimodal RoPE index")
        return self._rope_index(*args, **kwargs)

    def get_input_embeddings(self, ids: mx.array | None = None) -> Any:
        return self.embed_tokens if ids is None else self.embed_tokens(ids)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this model's image merge runs its language model; the engine cannot split it")


def _strip_inner_decoder(vlm: nn.Module, embed: nn.Module) -> None:
    """A wrapper whose language model is itself (Phi-3 Vision: the tower inside the decoder's
    module, `model.vision_embed_tokens`): its decoder layers, final norm and head dropped
    (never read), its token embedding the engine's, the tower kept."""
    inner = vlm.model
    inner.layers = []
    inner.embed_tokens = embed
    for owner, name in ((inner, "norm"), (vlm, "lm_head")):
        if name in owner:
            del owner[name]


class _ConfigOnly:
    """A class's methods (and properties) run on plain attributes instead of an instance: mlx-vlm's
    multimodal RoPE rule, and the helpers it calls, on the language model's config, no weights."""

    def __init__(self, cls: type, **attrs: Any):
        self.__dict__.update(attrs, _cls=cls)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cls, name)
        return attr.__get__(self, self._cls) if hasattr(attr, "__get__") else attr


class EncoderCache:
    """Encoded images by content hash, least recently used first out past `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._items: OrderedDict[bytes, mx.array] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: bytes) -> mx.array | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: bytes, value: mx.array) -> None:
        if key in self._items or value.nbytes > self.max_bytes:
            return
        self._items[key] = value
        self.nbytes += value.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0


class VisionEncoder:
    def __init__(self, vlm: nn.Module, image_token_id: int, dtype: mx.Dtype, cache_bytes: int,
                 rope_index: Any = None, deepstack: bool = False, text_scale: float = 1.0):
        self.vlm, self.image_token_id, self.dtype = vlm, image_token_id, dtype
        # The family's merge where the engine runs its own (mlx-vlm's departs from the model's)
        self.merge: Merge | None = None
        # What the merge multiplies a text row's embedding by (Gemma 4: sqrt(hidden)); the
        # engine's model applies it to every spliced row, so an image's rows are divided by it.
        self.text_scale = text_scale
        self.deepstack = deepstack  # Qwen3-VL: features added after the first decoder layers too
        self.cache = EncoderCache(cache_bytes)
        self.images_encoded = 0
        self.rope_index = rope_index  # multimodal RoPE families: (ids, spans) -> (positions, shift), mlx-vlm's rule
        self.sentinel = False  # a sentinel family's (`sentinel_rows`): its images encoded a call each
        self.alone = False  # a family whose merge takes one image a prompt (GOT-OCR's): a call each too
        # `sentinel_rows` by the inputs' shapes and every input but the pixels: a family's
        # tower may compute eagerly, in NumPy (DeepSeek-VL's SAM), so counting costs an encode.
        self._rows: dict[bytes, int] = {}

    @classmethod
    def load(cls, path: str, embed: nn.Module, image_token_id: int, dtype: mx.Dtype,
             cache_bytes: int = 256 * 2**20, mrope: bool = False, deepstack: bool = False,
             normed_rows: bool = False, prepared: nn.Module | None = None) -> "VisionEncoder":
        from mlx_vlm.utils import load_model

        # lazy: the language model's weights are never read (`prepared`: a model built elsewhere)
        vlm = prepared if prepared is not None else load_model(Path(path), lazy=True)
        raw = rope_index = None
        if mrope and vlm.config.model_type == "hunyuan_vl":  # HunyuanOCR's XD-RoPE (transformers' rule)
            text = vlm.config.text_config
            rope_index = _xdrope(len(text.rope_scaling["xdrope_section"]), vlm.config.vision_config.spatial_merge_size)
        elif mrope and getattr(vlm.config, "mrope_mode", None) == "canvas":  # MiniCPM-V 4.7's rule
            from mlx_vlm.models.minicpmv4_7.rope import CanvasRoPE

            rope_index = _canvas(CanvasRoPE(vlm.config), image_token_id)
        elif mrope:  # mlx-vlm's own position rule, on its config alone (no weights)
            lm = vlm.language_model
            raw = _ConfigOnly(type(lm), config=lm.config, args=getattr(lm, "args", None)).get_rope_index
            rope_index = _qwen(raw)
        # The language model's own child (`language_model`; Moondream's `text`, under a property)
        held = "language_model"
        if isinstance(getattr(type(vlm), "language_model", None), property):
            lm = vlm.language_model
            held = next((k for k, m in vlm.children().items() if m is lm), None)
        if held is None:  # a wrapper whose language model is itself (Phi-3 Vision)
            _strip_inner_decoder(vlm, embed)
        else:
            inner = getattr(getattr(vlm, held), "model", None)
            numbers = {k: v for k, v in vars(inner).items() if isinstance(v, (int, float))
                       and not isinstance(v, bool) and not k.startswith("_")} if isinstance(inner, nn.Module) else {}
            # (its weightless modules a merge calls too: Muse Glimmer's embedding norm)
            numbers.update({k: m for k, m in inner.children().items() if isinstance(m, nn.Module)
                            and not tree_flatten(m.parameters()) and k != "embed_tokens"}
                           if isinstance(inner, nn.Module) else {})
            setattr(vlm, held, _EmbedOnly(embed, raw, numbers))  # (the merges call the rule as mlx-vlm has it)
        mx.eval(vlm.parameters())
        vlm.eval()
        encoder = cls(vlm, image_token_id, dtype, cache_bytes, rope_index, deepstack,
                      _text_scale(vlm, embed, normed_rows))
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            encoder.merge = merge_for(json.load(f))
        return encoder

    def positions(self, ids: list[int], spans: list[ImageSpan]) -> tuple[np.ndarray, int]:
        """A prompt's multimodal RoPE positions [axes, len(ids)] and the shift after it."""
        pos, delta = self.rope_index(ids, spans)
        pos = np.array(pos)
        return pos.reshape(pos.shape[0], -1).astype(np.int64), int(np.array(delta).reshape(-1)[0])

    @property
    def nbytes(self) -> int:
        own = [v for k, v in tree_flatten(self.vlm.parameters()) if not k.startswith("language_model.")]
        return sum(v.nbytes for v in own)

    def sentinel_rows(self, inputs: dict[str, Any]) -> int:
        """The feature rows the merge grows an image's one sentinel id into: a shape, read from
        the merge's graph unevaluated (where the tower does not compute eagerly), once for
        inputs of the same shapes and extras."""
        pixels = np.asarray(inputs["pixel_values"])
        key = content_digest(inputs["input_ids"], {**{k: v for k, v in inputs.items()
                                                      if k not in ("input_ids", "pixel_values")},
                                                   "pixel_shape": np.asarray(pixels.shape)})
        if key not in self._rows:
            ids = np.asarray(inputs["input_ids"], dtype=np.int32)[None]
            rest = {k: mx.array(np.asarray(v)) if isinstance(v, (np.ndarray, mx.array)) else v
                    for k, v in inputs.items() if k not in ("input_ids", "pixel_values")}  # (NaFlex: sizes, masks)
            merged = self.vlm.get_input_embeddings(mx.array(ids), mx.array(pixels),
                                                   mask=mx.ones(ids.shape, dtype=mx.int32), **rest).inputs_embeds
            if len(self._rows) > 1024:
                self._rows.clear()
            self._rows[key] = int(merged.shape[1] - ids.shape[1] + 1)
        return self._rows[key]

    def encode(self, span: ImageSpan) -> mx.array:
        """The embedding rows of `span`'s placeholders [len(rows), hidden] (DeepStack:
        [1 + early layers, rows, hidden]), from the cache or encoded now."""
        return self.encode_many([span])[0]

    def encode_many(self, spans: list[ImageSpan]) -> list[mx.array]:
        """Each span's rows, as `encode`; images not in the cache whose inputs stack (the same
        arrays, shapes equal but the first axis) are encoded in one call, as one prompt with
        several images (evaluated: an image is its own computation, before the step's)."""
        out: list[mx.array | None] = [self.cache.get(s.digest) for s in spans]
        groups: dict[Any, list[int]] = {}
        for i, s in enumerate(spans):
            if out[i] is None:  # (a sentinel family's merge grows the first sentinel only: a call an image)
                groups.setdefault(object() if self.sentinel or self.alone else _stack_key(s.pixels or {}),
                                  []).append(i)
        for members in groups.values():
            for i, features in zip(members, self._encode_group([spans[i] for i in members])):
                out[i] = features
        return out  # type: ignore[return-value]

    def _encode_group(self, spans: list[ImageSpan]) -> list[mx.array]:
        if self.merge is not None:  # the engine's own merge (`vision/merges.py`), an image at a time
            features = []
            for s in spans:
                f = self.merge(self.vlm, s.pixels or {})  # [rows, hidden] or [1 + layers, rows, hidden]
                if f.shape[-2] != len(s.rows):
                    raise RuntimeError(f"the image's merge gave {f.shape[-2]} rows for {len(s.rows)} placeholders")
                features.append(f.astype(self.dtype))
            return self._keep(spans, features)
        inputs = [dict(s.pixels or {}) for s in spans]
        ids = [np.asarray(x.pop("input_ids"), dtype=np.int32) for x in inputs]
        prompt = np.concatenate(ids)[None]
        kwargs = {k: (mx.array(np.concatenate([np.asarray(x[k]) for x in inputs]))
                      if isinstance(v, np.ndarray) else v) for k, v in inputs[0].items()}
        pixel_values = kwargs.pop("pixel_values", None)
        result = self.vlm.get_input_embeddings(mx.array(prompt), pixel_values,
                                               mask=mx.ones(prompt.shape, dtype=mx.int32), **kwargs)
        for name, why in _BEYOND_EMBEDDINGS.items():
            if self.rope_index is not None and name in ("position_ids", "rope_deltas"):
                continue  # the engine carries these (`positions`, `models/mrope.py`)
            if self.deepstack and name == "deepstack_visual_embeds":
                continue  # added after the first decoder layers (`models/deepstack.py`)
            if getattr(result, name, None) is not None:
                raise RuntimeError(f"this model's image path needs {why} ({name}), which the engine does not run")
        stack = getattr(result, "deepstack_visual_embeds", None) if self.deepstack else None
        if stack is not None and any(e.shape[0] != sum(len(s.rows) for s in spans) for e in stack):
            raise RuntimeError("DeepStack features do not match the images' placeholders")
        features, base, first = [], 0, 0
        for s, x in zip(spans, ids):
            rows = mx.array(np.asarray(s.rows, dtype=np.int32) + base)
            f = result.inputs_embeds[0][rows]
            f = (f / self.text_scale if self.text_scale != 1.0 else f).astype(self.dtype)
            if stack is not None:  # [1 + layers, rows, hidden]: the input rows, then one per early layer
                part = mx.stack([e[first: first + len(s.rows)] for e in stack]).astype(self.dtype)
                f = mx.concatenate([f[None], part])
            features.append(f)
            base, first = base + len(x), first + len(s.rows)
        return self._keep(spans, features)

    def _keep(self, spans: list[ImageSpan], features: list[mx.array]) -> list[mx.array]:
        mx.eval(features)
        for s, f in zip(spans, features):
            self.images_encoded += 1
            self.cache.put(s.digest, f)
        return features


def _qwen(rope_index: Any) -> Any:
    """The Qwen-VL families' rule: the prompt and its images' (t, h, w) patch grids."""
    def positions(ids: list[int], spans: list[ImageSpan]) -> tuple[Any, Any]:
        grids = [np.asarray(s.pixels["image_grid_thw"]).reshape(-1, 3) for s in spans]
        prompt = mx.array(np.asarray(ids, dtype=np.int32))[None]
        return rope_index(prompt, mx.array(np.concatenate(grids).astype(np.int32)), None,
                          mx.ones(prompt.shape, dtype=mx.int32))
    return positions


def _xdrope(axes: int, merge: int) -> Any:
    """HunyuanOCR's rule (transformers' `HunYuanVLModel.get_rope_index`): every axis the token's
    index, but inside each image's grid (its run less the begin and end rows) the last three
    axes are the column (each row closed by a newline row), the row and the image's ordinal."""
    def positions(ids: list[int], spans: list[ImageSpan]) -> tuple[Any, Any]:
        pos = np.broadcast_to(np.arange(len(ids)), (axes, len(ids))).copy()
        for index, span in enumerate(spans):
            _, h, w = (int(v) for v in np.asarray(span.pixels["image_grid_thw"]).reshape(-1))
            rows, cols = h // merge, w // merge + 1
            start = span.offset + (1 if span.length == rows * cols + 2 else 0)
            if span.length not in (rows * cols, rows * cols + 2):
                raise ValueError(f"an image's {span.length} placeholders do not fit its {rows} x {cols} grid")
            grid = slice(start, start + rows * cols)
            pos[axes - 3, grid] = np.tile(np.arange(cols), rows)
            pos[axes - 2, grid] = np.repeat(np.arange(rows), cols)
            pos[axes - 1, grid] = index
        return pos, pos.max() + 1 - len(ids)
    return positions


def _canvas(rule: Any, image_token_id: int) -> Any:
    """MiniCPM-V 4.7's rule: each image's whole view and slices laid on a canvas, from the
    prompt, its placeholders and each view's patch grid (as its merge computes them)."""
    def positions(ids: list[int], spans: list[ImageSpan]) -> tuple[Any, Any]:
        prompt = np.asarray(ids, dtype=np.int64)[None]
        sizes = np.concatenate([np.asarray(s.pixels["tgt_sizes"][0]).reshape(-1, 2) for s in spans])
        return rule.get_rope_index(prompt, mm_token_type_ids=(prompt == image_token_id).astype(np.int32),
                                   target_sizes=sizes, downsample_mode=spans[0].pixels.get("downsample_mode"))
    return positions


def _text_scale(vlm: nn.Module, embed: nn.Module, normed_rows: bool = False) -> float:
    """The factor the family's merge puts on a text token's embedding (a prompt with no image);
    refused when the merge does more to it than a scale. `normed_rows`: the family's merge
    RMS-norms every row (no scale) and the engine's decoder norms every row it is given, so a
    normed text row is its own (Muse Glimmer)."""
    ids = mx.array([[1, 2, 3]], dtype=mx.int32)
    try:
        merged = vlm.get_input_embeddings(ids, None, mask=mx.ones(ids.shape, dtype=mx.int32)).inputs_embeds
    except Exception as e:  # noqa: BLE001 - whatever the family's merge raises is why images are off
        raise ValueError(f"its image merge does not run on a text-only prompt ({type(e).__name__}: {e})") from None
    plain = embed(ids).astype(mx.float32)
    if normed_rows:
        plain = mx.fast.rms_norm(plain, None, 1e-6)
    merged, plain = np.array(merged.astype(mx.float32)).reshape(-1), np.array(plain).reshape(-1)
    scale = float(merged @ plain / max(float(plain @ plain), 1e-30))
    if not np.allclose(merged, scale * plain, rtol=1e-2, atol=1e-3 * float(np.abs(merged).max() + 1e-30)):
        raise ValueError("its image merge transforms the text embeddings beyond a scale")
    return scale if abs(scale - 1.0) > 1e-6 else 1.0


def _stack_key(pixels: dict[str, Any]) -> Any:
    """Images whose encoder inputs have this key can go in one call: the same arrays with the
    same shapes past the first axis and dtypes (NumPy's: transformers' processors), the same
    plain values. An input of another kind (MLX arrays from mlx-vlm's own processors, Kimi-VL's
    list of grid shapes: how those join is the family's) makes the image a call of its own."""
    key: list[Any] = []
    for k in sorted(pixels):
        if k == "input_ids":
            continue
        v = pixels[k]
        if isinstance(v, np.ndarray):
            key.append((k, v.shape[1:], str(v.dtype)))
        elif v is None or isinstance(v, (bool, int, float, str)):
            key.append((k, repr(v)))
        else:
            return object()  # equal to no other key
    return tuple(key)
