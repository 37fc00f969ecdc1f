"""The engine's image side (`macinfer/vision/`): the vision path loaded beside the language
model, or why images are refused; a prompt's images expanded by the model's processor; and
the images a step's prompt chunks reach, encoded before its forward."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

log = logging.getLogger("macinfer")


def load(engine: Any) -> tuple[Any, str | None]:
    """(the image path, None), or (None, why images are refused) for a vision checkpoint;
    (None, None) for a text model (`vision/families.py`, `vision/support.py`). Multimodal RoPE
    and DeepStack are installed in the language model's layers here, once."""
    from macinfer.vision.families import is_vision_config
    from macinfer.vision.support import load_vision

    config = engine.loaded.config
    if engine.loaded.source.endswith(".gguf"):  # its images come from a vision projector file, if any
        return _with_mmproj(engine)
    if engine.config.mmproj:  # never a flag that silently does nothing
        raise ValueError("--mmproj is a GGUF model's vision projector; this model is not a GGUF file (a "
                         "checkpoint folder holds its own vision tower)")
    if not is_vision_config(config):
        return None, None
    if not engine.config.images:
        return None, "it is served text-only (images off)"
    model = engine.model
    embed = getattr(model, "embed_module", lambda: None)()
    if embed is None:
        return None, "its language model takes no embeddings in place of tokens"
    vision, why = load_vision(engine.loaded.source, config, engine.tokenizer, embed, model.kv_dtype(),
                              cache_bytes=engine.config.encoder_cache_mb * 2**20)
    if vision is None:
        return None, why
    return _install(engine, vision, config)


def _with_mmproj(engine: Any) -> tuple[Any, str | None]:
    """A GGUF model's image path from its vision projector file (`gguf/mmproj.py`); (None,
    None) when it has none, as a text model. A projector named by --mmproj that cannot be
    used is a load error; one found beside the model leaves the text served and images
    refused with the reason (logged)."""
    import tempfile

    from macinfer.gguf.mmproj import MmprojError, find_mmproj, fits, read_projector
    from macinfer.vision.support import load_vision

    given = engine.config.mmproj
    try:
        path = find_mmproj(engine.loaded.source, given)
    except MmprojError as e:
        raise ValueError(str(e)) from None
    if path is None:
        return None, None
    if not given and not fits(path, engine.loaded.config):  # another model's, beside this one
        log.info("%s beside the model projects to another width: not this model's, left alone",
                 os.path.basename(path))
        return None, None
    if not engine.config.images:
        return None, "it is served text-only (images off)"
    model = engine.model
    embed = getattr(model, "embed_module", lambda: None)()
    why = None if embed is not None else "its language model takes no embeddings in place of tokens"
    with tempfile.TemporaryDirectory(prefix="macinfer-mmproj-") as folder:
        try:
            config, vlm = read_projector(path, engine.loaded.config, engine.tokenizer, folder, model.kv_dtype()) \
                if why is None else (None, None)
        except MmprojError as e:
            why = str(e)
        if why is None:
            vision, why = load_vision(folder, config, engine.tokenizer, embed, model.kv_dtype(),
                                      cache_bytes=engine.config.encoder_cache_mb * 2**20, prepared=vlm)
    if why is not None:
        why = why if why.startswith(os.path.basename(path)) else f"{os.path.basename(path)}: {why}"
        if given:
            raise ValueError(f"--mmproj {why}")
        log.warning("images are off: the vision projector beside the model: %s", why)
        return None, why
    log.info("images: the vision projector %s", os.path.basename(path))
    vision.projector = path
    return _install(engine, vision, config)


def _install(engine: Any, vision: Any, config: dict[str, Any]) -> tuple[Any, str | None]:
    """The language model made to run `vision`'s rules (multimodal RoPE, DeepStack, ...)."""
    model = engine.model
    if engine.dist is not None and vision.lora is not None:
        return None, "its vision LoRA is not served over --distributed ranks (each rank holds a share of its layers)"
    if vision.mrope is not None:
        from macinfer.models import mrope

        try:
            mrope.install(model.decoder_layers, *vision.mrope)
        except ValueError as e:
            return None, str(e)
    if vision.deepstack:
        from macinfer.models import deepstack

        try:
            deepstack.install(model.decoder_layers, vision.deepstack)
        except ValueError as e:
            return None, str(e)
    if vision.pad_image_ids:  # (the merges of these families read placeholders as id 0)
        model.image_pad_id = 0
    model.token_embed_scale = vision.token_embed_scale
    log.info("images: %s's vision tower and projector loaded (%.1f MiB)", config.get("model_type"),
             vision.encoder.nbytes / 2**20)
    return vision, None


def prepare(vision: Any, refusal: str | None, prompt: list[int], images: list) -> tuple[list[int], Any]:
    """`LLMEngine.prepare_images`: the ids to queue and the `ImageInputs` to add with them."""
    from macinfer.vision.images import ImageError

    if vision is None:
        raise ValueError("this model takes no images" + (f": {refusal}" if refusal else " (a text model)"))
    if len(images) > vision.limits.max_images:
        raise ImageError(f"{len(images)} images; at most {vision.limits.max_images} a request")
    ids, inputs = vision.processor.expand(prompt, images)
    inputs.both_ways = vision.both_ways
    if vision.prefix_lm:
        inputs.set_prefix(ids)
    if vision.mrope is not None:
        inputs.rope, inputs.rope_delta = vision.encoder.positions(ids, inputs.spans)
    return ids, inputs


def encode_step(encoder: Any, scheduled: list, fail: Callable[[Any, Exception], Any]) -> list:
    """Encode the images the step's prompt chunks reach (each once: the encoder caches by
    content, and a sequence keeps its features for a recompute), same-shape ones in one call.
    A request whose image fails ends alone (`fail`), with the reason, and leaves the step."""
    need: dict[int, Any] = {}
    for seq, n in scheduled:
        if seq.images is not None:
            for span in seq.images.overlapping(seq.num_computed_tokens, seq.num_computed_tokens + n):
                if span.features is None:
                    need[id(span)] = span
    if not need:
        return []
    try:
        for span, features in zip(need.values(), encoder.encode_many(list(need.values()))):
            span.features, span.pixels = features, None
        return []
    except Exception:  # noqa: BLE001 - found below, one request at a time
        pass
    failed = []
    for item in list(scheduled):
        seq, n = item
        if seq.images is None:
            continue
        try:
            for span in seq.images.overlapping(seq.num_computed_tokens, seq.num_computed_tokens + n):
                if span.features is None:
                    span.features = encoder.encode(span)
                    span.pixels = None
        except Exception as e:  # noqa: BLE001 - the image's fault or the family's: this request only
            log.warning("request %s: encoding an image failed: %s", seq.request_id, e)
            scheduled.remove(item)
            failed.append(fail(seq, e))
    return failed
