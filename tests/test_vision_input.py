"""Image input checks that need no model: decoding and its caps, the parts of each API, and
remote URLs (refused unless allowed; then public addresses only, no redirects, a byte cap)."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest
from PIL import Image

from macinfer.vision import fetch as fetch_mod
from macinfer.vision.images import ImageError, ImageLimits, decode
from macinfer.vision.messages import split_images
from tests.vision_models import picture


def _png(size=(20, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    picture(1, size).save(buf, format=fmt)
    return buf.getvalue()


def _url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def test_decode_takes_common_formats_and_refuses_the_rest():
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        assert decode(_png(fmt=fmt)).size == (30, 20)
    with pytest.raises(ImageError, match="format"):
        decode(_png(fmt="TIFF"))
    with pytest.raises(ImageError, match="byte limit"):
        decode(_png(), ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="pixel limit"):
        decode(_png(), ImageLimits(max_pixels=500))
    with pytest.raises(ImageError, match="empty"):
        decode(b"")


def test_split_images_in_order_with_a_limit_on_their_number():
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(_png((5, 5)))}},
                                         {"type": "text", "text": "a"},
                                         {"type": "image_url", "image_url": {"url": _url(_png((7, 7)))}}]}]
    out, images = split_images(msgs)
    assert [p["type"] for p in out[0]["content"]] == ["image", "text", "image"]
    assert [im.size for im in images] == [(5, 5), (7, 7)]
    many = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(_png((4, 4)))}}] * 3}]
    with pytest.raises(ImageError, match="more than 2 images"):
        split_images(many, ImageLimits(max_images=2))
    with pytest.raises(ImageError, match="--allow-image-urls"):
        split_images([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1/secret")
            self.end_headers()
            return
        body = _png((9, 9)) if self.path == "/ok.png" else b"x" * 5000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def local_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_urls_only_to_public_addresses_no_redirects_and_capped(local_http, monkeypatch):
    allowed = ImageLimits(allow_urls=True, max_bytes=4000)
    part = lambda url: [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]  # noqa: E731
    with pytest.raises(ImageError, match="private or local address"):
        split_images(part(local_http + "/ok.png"), allowed)
    # a name that resolved to a public address, served here: the fetch itself
    monkeypatch.setattr(fetch_mod, "public_address", lambda host, port, where, resolve=None: "127.0.0.1")
    _, images = split_images(part(local_http + "/ok.png"), allowed)
    assert images[0].size == (9, 9)
    with pytest.raises(ImageError, match="redirects"):
        split_images(part(local_http + "/moved"), allowed)
    with pytest.raises(ImageError, match="byte limit"):
        split_images(part(local_http + "/big"), allowed)
    with pytest.raises(ImageError, match="credentials"):
        split_images(part(local_http.replace("http://", "http://user:pw@") + "/ok.png"), allowed)


def test_every_resolved_address_must_be_public():
    check = fetch_mod.public_address
    assert check("example.org", 80, "x", resolve=lambda h, p: ["93.184.215.14"]) == "93.184.215.14"
    for bad in (["10.0.0.5"], ["93.184.215.14", "192.168.1.1"], ["::1"], ["169.254.169.254"], ["fe80::1%eth0"]):
        with pytest.raises(ImageError, match="private or local"):
            check("example.org", 80, "x", resolve=lambda h, p, bad=bad: bad)
