"""Image bytes from a request to a checked RGB picture: base64 data URLs, raw bytes,
PIL images and (for the Python API and the CLI only) file paths. Every failure is an
`ImageError` that says which image and why (a 400 at the API)."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import Any

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what the decoder may open (no TIFF, no PSD, ...)


class ImageError(ValueError):
    """An image a request cannot use: undecodable, too large, a format not taken."""


@dataclass(frozen=True)
class ImageLimits:
    """Caps decided once at load (server flags): bytes before decoding, pixels after."""
    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000  # a decompression bomb stops here, before its pixels are decoded
    max_images: int = 16  # per request
    allow_urls: bool = False  # fetch http(s) image URLs (`serve --allow-image-urls`, `vision/fetch.py`)


def from_data_url(url: str, where: str = "image") -> bytes:
    """The bytes of a `data:image/...;base64,` URL."""
    head, sep, data = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise ImageError(f"{where}: not a data URL (expected data:image/<format>;base64,...)")
    if not head.startswith("data:image/"):
        raise ImageError(f"{where}: the data URL holds {head[5:].split(';')[0] or 'no media type'}, not an image")
    if not head.endswith(";base64"):
        raise ImageError(f"{where}: the data URL must be base64 encoded")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the base64 data does not decode") from None


def from_base64(data: str, where: str = "image") -> bytes:
    """Bare base64 (Anthropic's and Ollama's image fields); a data URL is taken too."""
    if data.startswith("data:"):
        return from_data_url(data, where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the base64 data does not decode") from None


def decode(source: Any, limits: ImageLimits = ImageLimits(), where: str = "image", allow_paths: bool = False):
    """A PIL RGB image from bytes, a PIL image, or (`allow_paths`) a file path."""
    from PIL import Image, ImageOps

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, str) and allow_paths:
            try:
                with open(source, "rb") as f:
                    source = f.read(limits.max_bytes + 1)
            except OSError as e:
                raise ImageError(f"{where}: cannot read {source}: {e.strerror}") from None
        if not isinstance(source, (bytes, bytearray)):
            raise ImageError(f"{where}: expected image bytes, got {type(source).__name__}")
        if len(source) > limits.max_bytes:
            raise ImageError(f"{where}: {len(source)} bytes is over the {limits.max_bytes}-byte limit")
        if not source:
            raise ImageError(f"{where}: empty")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(bytes(source)), formats=FORMATS)
        except Image.DecompressionBombError:
            raise ImageError(f"{where}: too many pixels (a decompression bomb?)") from None
        except (Image.UnidentifiedImageError, Image.DecompressionBombWarning, OSError, ValueError) as e:
            raise ImageError(f"{where}: not an image in a format taken ({', '.join(FORMATS)}): "
                             f"{str(e)[:120] or type(e).__name__}") from None
    w, h = image.size
    if w * h > limits.max_pixels:
        raise ImageError(f"{where}: {w}x{h} is over the {limits.max_pixels}-pixel limit")
    if w < 1 or h < 1:
        raise ImageError(f"{where}: {w}x{h} has no pixels")
    try:
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")  # decodes the pixels: truncated files fail here
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{where}: the image data is damaged ({str(e)[:120] or type(e).__name__})") from None
