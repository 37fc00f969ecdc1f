"""Where mlx-vlm's processor for a family departs from the published one so that its prompt
and its pixels disagree, the engine mends it with the processor's own methods (decided
once, at load): the prompt's placeholders and the encoder's features must match."""

from __future__ import annotations

from typing import Any


def mend(processor: Any, model_type: str | None) -> None:
    if model_type == "llama4":
        _llama4_global_tile(processor.image_processor)


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
