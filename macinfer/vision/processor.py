"""A vision model's prompt side: where its chat template puts an image (found once, at
load, by rendering a conversation with and without one) and how its own processor
(transformers' or mlx-vlm's class for the checkpoint) expands that marker into
placeholder tokens and pixel values, one image at a time, so that each image has its
own content hash (prefix cache, encoder cache)."""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

import numpy as np

from macinfer.vision.families import IMAGES_FIRST, PATCH_PLACEHOLDERS, UNK_PLACEHOLDERS
from macinfer.vision.images import ImageError
from macinfer.vision.inputs import ImageInputs, ImageSpan, content_digest
from macinfer.vision.processor_fixes import engine_outputs, mend

log = logging.getLogger(__name__)

_PROBE_TEXT = "x"
_FOLLOW = 8  # prompt tokens after an image marker that its expansion is made with


def _find_marker(with_image: list[int], without: list[int]) -> list[int]:
    """The ids the template adds for one image part (a render with it minus one without)."""
    head = 0
    while head < min(len(with_image), len(without)) and with_image[head] == without[head]:
        head += 1
    tail = 0
    while tail < min(len(with_image), len(without)) - head and with_image[-1 - tail] == without[-1 - tail]:
        tail += 1
    return with_image[head: len(with_image) - tail]


def _reads_parts(tokenizer: Any, text: list[dict[str, Any]], plain: list[int]) -> bool:
    """Whether the chat template reads a list of content parts (it renders a text part as it
    renders the same string; a string-only template prints the list, or fails on it)."""
    try:
        return tokenizer.encode_chat([{"role": "user", "content": text}]) == plain
    except ValueError:
        return False


def inline_marker(model_type: str | None) -> str | None:
    """The text mlx-vlm's prompt format (`prompt_utils`) writes for one image in a message of
    `model_type` when it writes images into the text ("<image>\n", "<|image_1|>", ...); None
    when it hands the template image parts, or has no format for the family."""
    from mlx_vlm.prompt_utils import get_message_json

    try:
        content = get_message_json(model_type or "", [{"type": "image"}, {"type": "text", "text": _PROBE_TEXT}])
    except (ValueError, KeyError):
        return None
    content = content.get("content") if isinstance(content, dict) else content
    if not isinstance(content, str) or not content.endswith(_PROBE_TEXT) or content == _PROBE_TEXT:
        return None
    return content[: -len(_PROBE_TEXT)]


class VisionProcessor:
    """Turns (prompt ids with image markers, images) into the expanded prompt and an
    `ImageInputs` for the engine."""

    def __init__(self, processor: Any, tokenizer: Any, image_token_id: int, marker: list[int],
                 placeholders_only: bool = False, own_vocab: tuple[int, int] | None = None,
                 image_processor: Any = None):
        self.processor, self.tokenizer = processor, tokenizer
        self.image_token_id, self.marker = image_token_id, marker
        # mlx-vlm's own image processor where the checkpoint's processor is a bare tokenizer
        # (LLaVA-Bunny's): the prompt is tokenized around "<image>" and the image's id put
        # between, as mlx-vlm's `prepare_inputs` does.
        self.image_processor = image_processor
        # A sentinel family (one id, -200, an image, grown into all of its feature rows at the
        # merge): how many rows an image's inputs give (`VisionEncoder.sentinel_rows`), set
        # with the encoder; the engine's prompt holds that many placeholders instead.
        self.sentinel_rows: Any = None
        # The processor writes the whole prompt around any text (PaliGemma: BOS and a newline),
        # which the template writes too: an image's expansion is its run of placeholders alone.
        self.placeholders_only = placeholders_only
        # Ids [lo, hi) the family's merge embeds itself (Gemma 3n's vision vocabulary): rows too.
        self.own_vocab = own_vocab
        self._marker_text = tokenizer.decode(marker, skip_special_tokens=False)
        # A chat template that reads string content only (Phi-4 multimodal's, nanoLLaVA's): the
        # text mlx-vlm's prompt format writes for an image in a message, which each image part
        # becomes before the template runs (`vision/messages.py: inline_images`); None: the
        # template renders image parts itself.
        self.inline_marker: str | None = None
        # The images go first, after the prompt's lead token (`IMAGES_FIRST`): the template
        # renders the text alone (each image part as nothing) and has no marker.
        self.images_first = False

    @classmethod
    def load(cls, path: str, tokenizer: Any, image_token_id: int | None, placeholders_only: bool = False,
             model_type: str | None = None, own_vocab: tuple[int, int] | None = None) -> "VisionProcessor":
        """The checkpoint's processor; the template's image marker found by a probe render; the
        placeholder id the config names, else the processor's (MiniCPM-V's config names none).
        Raises ValueError with the reason when the template shows no image or no id is named."""
        from mlx_vlm.utils import load_processor

        with contextlib.redirect_stdout(io.StringIO()) as said:  # (DeepSeek-OCR's prints what it adds)
            processor = load_processor(path, add_detokenizer=False)
        if said.getvalue().strip():
            log.debug("the processor says: %s", said.getvalue().strip())
        mend(processor, model_type)
        engine_outputs(processor, model_type)
        image_processor = None
        from transformers import PreTrainedTokenizerBase

        # A bare tokenizer: mlx-vlm's image processor, if any. (A processor that takes images
        # itself, Step 3.7's, has no image processor but is no tokenizer.)
        if not hasattr(processor, "image_processor") and isinstance(processor, PreTrainedTokenizerBase):
            from mlx_vlm.models.base import BaseImageProcessor
            from mlx_vlm.utils import load_image_processor

            found = load_image_processor(path)
            if not isinstance(found, BaseImageProcessor):
                raise ValueError("its processor is a tokenizer and mlx-vlm has no image processor for it")
            image_processor = found
        if image_token_id is None:
            image_token_id = getattr(processor, "image_token_id", None)
            if image_token_id is None and model_type in UNK_PLACEHOLDERS:
                image_token_id = getattr(getattr(processor, "tokenizer", None), "unk_token_id", None)
        if image_token_id is None and isinstance(getattr(processor, "image_patch_token", None), str):  # Molmo 1's
            image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_patch_token)
        if model_type in PATCH_PLACEHOLDERS:  # (the config's image id is the prompt's marker there)
            image_token_id = getattr(getattr(processor, "_image_proc", None), "patch_token_id", None)
            if not isinstance(image_token_id, int):
                raise ValueError("neither its config nor its processor names an image token id")
        hf = getattr(processor, "tokenizer", None)
        if hf is not None and getattr(hf, "pad_token", None) is None and getattr(hf, "eos_token", None):
            hf.pad_token = hf.eos_token  # one prompt a call, never padded; some processors ask for padding

        if model_type in IMAGES_FIRST:
            out = cls(processor, tokenizer, image_token_id, [], placeholders_only, own_vocab, image_processor)
            out.inline_marker, out.images_first = "", True
            return out
        text = [{"type": "text", "text": _PROBE_TEXT}]
        without = tokenizer.encode_chat([{"role": "user", "content": _PROBE_TEXT}])
        inline = None if _reads_parts(tokenizer, text, without) else inline_marker(model_type)
        if inline is not None:
            with_image = tokenizer.encode_chat([{"role": "user", "content": inline + _PROBE_TEXT}])
        else:
            with_image = tokenizer.encode_chat([{"role": "user", "content": [{"type": "image"}, *text]}])
        marker = _find_marker(with_image, without)
        if not marker:
            raise ValueError("its chat template renders no marker for an image part")
        out = cls(processor, tokenizer, image_token_id, marker, placeholders_only, own_vocab, image_processor)
        out.inline_marker = inline
        return out

    def _expand_one(self, image: Any, after: list[int]) -> tuple[list[int], dict[str, Any]]:
        """The marker expanded for `image` by the model's processor, and its encoder inputs.
        The marker goes in with the prompt's next few tokens (`after`): a processor may write
        something that depends on them (Idefics2: a space before text that follows an image
        directly); when they come back unchanged, what stands before them is the expansion."""
        if self.images_first:  # (the processor prepends the image's tokens to an empty text)
            return self._run("", image)
        if self.placeholders_only:
            ids, pixels = self._run(self._marker_text, image)
            run = next((i for i, t in enumerate(ids) if t != self.image_token_id), len(ids))
            return ids[:run], pixels
        follow = after[:_FOLLOW]
        ids, pixels = self._run(self._marker_text + self.tokenizer.decode(follow, skip_special_tokens=False)
                                if follow else self._marker_text, image)
        if follow:
            if ids[-len(follow):] == follow:
                return ids[: -len(follow)], pixels
            ids, pixels = self._run(self._marker_text, image)  # tokenized otherwise in context: alone
        return ids, pixels

    def _run(self, text: str, image: Any) -> tuple[list[int], dict[str, Any]]:
        if self.image_processor is not None:
            return self._run_split(text, image)
        try:
            out = self.processor(text=[text], images=[image], return_tensors="np")
        except (ValueError, TypeError, IndexError, KeyError) as e:  # sizes the processor refuses
            raise ImageError(f"the model's image processor refused the image: {str(e)[:200]}") from None
        if not any(k.startswith(("pixel_values", "images")) for k in out):  # a bare tokenizer: the image dropped
            raise ImageError("the model's processor made no pixel values for the image (transformers loaded a "
                             "tokenizer only for this checkpoint)")
        ids = np.asarray(out["input_ids"]).reshape(-1).tolist()
        bos = getattr(self.tokenizer, "bos_token_id", None)
        # (BOS the processor writes is the template's, unless BOS's id is the image's placeholder:
        # Moondream's prefix is BOS and its image, one run)
        if ids and bos is not None and ids[0] == bos and self.marker[:1] != [bos] and bos != self.image_token_id:
            ids = ids[1:]
        pixels = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "token_type_ids",
                                                                 "mm_token_type_ids", "labels")}
        return ids, pixels

    def _run_split(self, text: str, image: Any) -> tuple[list[int], dict[str, Any]]:
        """mlx-vlm's `prepare_inputs` for a tokenizer and its own image processor: the text
        before and after "<image>" tokenized apart, the image's id between them."""
        before, found, after = text.partition("<image>")
        if not found:
            raise ImageError("the model's image marker did not reach its processor")
        try:
            pixels = np.stack([np.asarray(p) for p in self.image_processor.preprocess(images=[image.convert("RGB")])])
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise ImageError(f"the model's image processor refused the image: {str(e)[:200]}") from None
        ids = list(self.processor(before).input_ids) + [self.image_token_id] + list(self.processor(after).input_ids)
        return ids, {"pixel_values": pixels}

    def _grown(self, shown: list[int], pixels: dict[str, Any], expanded: list[int]) -> tuple[list[int], list[int]]:
        """A sentinel family's image: its one sentinel id replaced by a placeholder (id 0, its
        embedding replaced) for each of the image's feature rows; (the prompt's ids, those rows)."""
        at = shown.index(self.image_token_id)
        n = self.sentinel_rows({"input_ids": expanded, **pixels})
        return shown[:at] + [0] * n + shown[at + 1:], list(range(at, at + n))

    def _numbered(self, ids: list[int], k: int) -> list[int]:
        """MiniCPM-V writes each image's number before it (`<image_id>k</image_id>`, counted
        over the prompt's images); expanded alone, an image is number 0: its processor's own
        rule for that number renumbers it."""
        number = getattr(self.processor, "_build_image_id_ids", None)
        if k == 0 or number is None:
            return ids
        zero = number(0)
        return number(k) + ids[len(zero):] if zero and ids[:len(zero)] == zero else ids

    def expand(self, prompt: list[int], images: list[Any]) -> tuple[list[int], ImageInputs]:
        """Each of the prompt's image markers, in order, replaced by its image's expansion."""
        m = self.marker
        if self.images_first:  # every image after the lead token, in order (no marker to replace)
            lead = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else \
                self.tokenizer.eos_token_id
            starts = [1 if prompt[:1] == [lead] else 0] * len(images)
        else:
            at = [i for i in range(len(prompt) - len(m) + 1) if prompt[i: i + len(m)] == m]
            starts, last = [], -len(m)
            for i in at:  # non-overlapping occurrences
                if i >= last + len(m):
                    starts.append(i)
                    last = i
        if len(starts) != len(images):
            raise ImageError(f"the prompt has {len(starts)} image markers and the request {len(images)} images")
        ids: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for k, (start, image) in enumerate(zip(starts, images)):
            ids.extend(prompt[prev:start])
            end = starts[k + 1] if k + 1 < len(starts) else len(prompt)
            expanded, pixels = self._expand_one(image, prompt[start + len(m): end])
            shown = self._numbered(expanded, k)
            lo, hi = self.own_vocab or (0, 0)
            rows = [j for j, t in enumerate(shown) if t == self.image_token_id or lo <= t < hi]
            if self.sentinel_rows is not None and len(rows) == 1:
                shown, rows = self._grown(shown, pixels, expanded)
            shown = [0 if t < 0 else t for t in shown]  # (negative placeholders, Phi-3 Vision's: no token)
            if not rows:
                raise ImageError("the model's processor gave the image no placeholder tokens")
            # (the encoder takes the image as expanded alone: its inputs' bounds count those ids)
            spans.append(ImageSpan(len(ids), len(shown), rows, content_digest(expanded, pixels),
                                   {"input_ids": expanded, **pixels}))
            ids.extend(shown)
            prev = start + len(m)
        ids.extend(prompt[prev:])
        return ids, ImageInputs(spans)
