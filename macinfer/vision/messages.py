"""Images inside chat messages, as each API writes them, taken out in order: the
messages keep a bare `{"type": "image"}` part where each was (what chat templates
render as the model's image marker) and the images come back decoded."""

from __future__ import annotations

from typing import Any

from macinfer.vision.images import ImageError, ImageLimits, decode, from_base64, from_data_url

IMAGE_PARTS = ("image", "image_url", "input_image")


def image_source(part: dict[str, Any], where: str, allow_paths: bool, limits: ImageLimits = ImageLimits()) -> Any:
    """The bytes, PIL image or (Python API only) path an image part holds."""
    kind = part.get("type")
    if kind == "image_url" or kind == "input_image":
        url = part.get("image_url")
        if isinstance(url, dict):
            detail = url.get("detail")
            if detail not in (None, "auto"):
                raise ImageError(f"{where}: detail {detail!r} is not supported (this model's processor sizes "
                                 "every image itself; use 'auto')")
            url = url.get("url")
        if not isinstance(url, str):
            raise ImageError(f"{where}: needs an image URL")
        if url.startswith(("http://", "https://")):
            if not limits.allow_urls:
                raise ImageError(f"{where}: remote image URLs are not fetched unless the server runs with "
                                 "--allow-image-urls; send the image as a data:image/...;base64 URL")
            from macinfer.vision.fetch import fetch

            return fetch(url, limits, where)
        if url.startswith("data:"):
            return from_data_url(url, where)
        if allow_paths:
            return url[7:] if url.startswith("file://") else url
        raise ImageError(f"{where}: only data: URLs are taken (local paths are never read for a request)")
    # {"type": "image", ...}: Anthropic's base64 source, or the Python API's image/path/bytes
    source = part.get("source")
    if isinstance(source, dict):
        if source.get("type") != "base64":
            raise ImageError(f"{where}: image source type {source.get('type')!r} is not supported (use base64)")
        data = source.get("data")
        if not isinstance(data, str):
            raise ImageError(f"{where}: the base64 source has no data")
        return from_base64(data, where)
    value = part.get("image")
    if value is None:
        raise ImageError(f"{where}: an image part needs an image")
    return value


def split_images(messages: list[dict[str, Any]], limits: ImageLimits = ImageLimits(),
                 allow_paths: bool = False, inline: str | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with bare image parts, the decoded images in order); with `inline`, the
    messages holding images as strings with that marker in each image's place."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                    for p in content):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                where = f"messages[{i}].content[{j}]"
                images.append(decode(image_source(p, where, allow_paths, limits), limits, where, allow_paths))
                if len(images) > limits.max_images:
                    raise ImageError(f"more than {limits.max_images} images in one request")
                parts.append({"type": "image"})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    return (inline_images(out, inline) if inline and images else out), images


def inline_images(messages: list[dict[str, Any]], marker: str) -> list[dict[str, Any]]:
    """Each message's content parts as one string, an image part as `marker` (for a chat
    template that reads string content only; `VisionProcessor.inline_marker`)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text = "".join(marker if isinstance(p, dict) and p.get("type") == "image" else
                           str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
            m = {**m, "content": text}
        out.append(m)
    return out
