"""Where mlx-vlm's processor for a family departs from the published one so that its prompt
and its pixels disagree, the engine mends it with the processor's own methods (decided
once, at load): the prompt's placeholders and the encoder's features must match. Where its
outputs are in a form of its own, the engine's view of them (`engine_outputs`)."""

from __future__ import annotations

from typing import Any


def torch_free_siglip2() -> None:
    """Phi-4-SigLIP's processor (mlx-vlm's) builds transformers' `Siglip2ImageProcessor`, whose
    module imports torch, which a Mac's MLX install does not have: where that import fails, the
    module's name holds transformers' torch-free `Siglip2ImageProcessorPil` (the same resizing to
    a patch budget, the same outputs) for the process. Where torch is there, nothing changes."""
    import importlib
    import sys
    import types

    name = "transformers.models.siglip2.image_processing_siglip2"
    try:
        importlib.import_module(name)
    except ImportError:
        from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

        stand_in = types.ModuleType(name, "transformers' torch-free Siglip2 image processor under the torch one's name")
        stand_in.Siglip2ImageProcessor = Siglip2ImageProcessorPil
        sys.modules[name] = stand_in


def mend(processor: Any, model_type: str | None) -> None:
    if model_type == "llama4":
        _llama4_global_tile(processor.image_processor)


def engine_outputs(processor: Any, model_type: str | None) -> None:
    """The processor's outputs as the engine takes them: a transformers-style call giving the
    prompt's ids and the encoder's inputs (NumPy or float MLX arrays)."""
    if model_type in ("deepseekocr", "deepseekocr_2", "unlimited_ocr", "unlimited-ocr"):  # (and as published)
        _deepseek_ocr(processor)
    if model_type == "got":
        _got(processor)
    if model_type in ("phi4_siglip", "phi4-siglip"):  # (mlx-vlm's name for it, and the checkpoints')
        _untemplated(processor)


def _untemplated(processor: Any) -> None:
    """Phi-4-SigLIP's processor (mlx-vlm's own) wraps any text without `<|im_start|>` in its chat
    template: the engine's template writes the conversation, so the engine's call takes the text
    as it is (an image's marker alone, expanded)."""
    cls = type(processor)

    class EngineOutputs(cls):  # type: ignore[misc, valid-type]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            template, self.tokenizer.chat_template = self.tokenizer.chat_template, None
            try:
                return super().__call__(*args, **kwargs)
            finally:
                self.tokenizer.chat_template = template

    processor.__class__ = EngineOutputs


def got_conversation() -> tuple[str, str, str, str]:
    """GOT-OCR's conversation pieces, as mlx-vlm's processor writes them (MPT's, from its
    published code): its system turn, the turn separator, the user's and the assistant's heads."""
    from mlx_vlm.models.got import processing_got as g

    return g.GOT_SYSTEM, g.GOT_SEP, g.GOT_USER_ROLE, g.GOT_ASSISTANT_ROLE


def _got(processor: Any) -> None:
    """GOT-OCR's processor (mlx-vlm's own) wraps any text without a turn separator in its whole
    conversation, and expands `<image>` only then: the engine's template writes the
    conversation, so the engine's call expands each `<image>` as the processor would (its own
    rule on the marker alone, the conversation around it cut off) and leaves the rest."""
    from mlx_vlm.models.got import processing_got as g

    system, sep, user, assistant = got_conversation()
    wrapped = g.build_got_prompt(g.IMAGE_PLACEHOLDER, has_image=True)
    image = wrapped.removeprefix(system + sep + user).removesuffix(sep + assistant)
    cls = type(processor)

    class EngineOutputs(cls):  # type: ignore[misc, valid-type]
        def __call__(self, *, text: Any = None, images: Any = None, **kwargs: Any) -> dict[str, Any]:
            texts = [t.replace(g.IMAGE_PLACEHOLDER, image) for t in (text if isinstance(text, list) else [text])]
            return {**self.image_processor(images), **self.tokenizer(texts, return_tensors="np")}

    processor.__class__ = EngineOutputs


def _deepseek_ocr(processor: Any) -> None:
    """DeepSeek-OCR's processor (mlx-vlm's own) drops a prompt's last token in its inference
    mode (DeepSeek's code ends the formatted prompt with one to drop; mlx-vlm's template ends
    with a space instead, which it loses), puts BOS first, and gives its views as a list of
    bfloat16 arrays under `images`: the engine's call keeps every token of the text it is
    given, no BOS (its prompt has one), and the views as float32 (bfloat16 values exactly) under
    `pixel_values`, as mlx-vlm's `prepare_inputs` renames them."""
    import mlx.core as mx
    import numpy as np

    cls = type(processor)

    class EngineOutputs(cls):  # type: ignore[misc, valid-type]
        def __call__(self, *, text: Any = None, images: Any = None, **kwargs: Any) -> dict[str, Any]:
            out = self.process_one(prompt=text[0] if isinstance(text, list) else text, images=images,
                                   inference_mode=False)
            ids = np.asarray(out["input_ids"]).reshape(-1)
            mask = np.asarray(out["images_seq_mask"]).reshape(-1)
            if len(ids) and ids[0] == self.bos_id:
                ids, mask = ids[1:], mask[1:]
            return {"input_ids": ids[None], "pixel_values": [v.astype(mx.float32) for v in out["images"]],
                    "images_seq_mask": mask[None], "images_spatial_crop": np.asarray(out["images_spatial_crop"])}

    processor.__class__ = EngineOutputs


def _llama4_global_tile(image_processor: Any) -> None:
    """Llama 4: a picture cut into several tiles is followed by a global tile (the whole
    picture at one tile's size), as transformers' processor makes it and as mlx-vlm's prompt
    counts it (`<|image|>` and one more tile's placeholders); mlx-vlm's image processor leaves
    it out, so its features fell a tile short of the placeholders."""
    import numpy as np
    from PIL import Image

    cls = type(image_processor)

    class WithGlobalTile(cls):  # type: ignore[misc, valid-type]
        def preprocess(self, images: Any, **kwargs: Any) -> dict[str, Any]:
            pixels, ratios = [], []
            for img in images if isinstance(images, list) else [images]:
                img = img if isinstance(img, Image.Image) else Image.fromarray(np.uint8(img))
                ratio = self._get_best_resolution(img.width, img.height)
                tiles = self._split_into_tiles(img, ratio)
                if ratio[0] * ratio[1] > 1:
                    tiles += self._split_into_tiles(img, (1, 1))
                pixels += [self._preprocess_single(t) for t in tiles]
                ratios.append(ratio)
            return {"pixel_values": np.stack(pixels), "aspect_ratios": ratios}

    image_processor.__class__ = WithGlobalTile
