"""Remote images, only where the server was started with `--allow-image-urls`: http(s) to a
public address only (every address the name resolves to is checked, and the connection goes
to the checked one), no redirects followed, a byte cap read as it streams, a timeout."""

from __future__ import annotations

import ipaddress
import socket
from typing import Callable
from urllib.parse import urlsplit

from macinfer.vision.images import ImageError, ImageLimits

Resolver = Callable[[str, int], list[str]]


def _resolve(host: str, port: int) -> list[str]:
    return sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


def public_address(host: str, port: int, where: str, resolve: Resolver = _resolve) -> str:
    """One address `host` resolves to, all of them public (no loopback, private, link-local,
    multicast or reserved address: the server must not become a way into its own network)."""
    try:
        addresses = resolve(host, port)
    except OSError as e:
        raise ImageError(f"{where}: cannot resolve {host} ({e.strerror or e})") from None
    if not addresses:
        raise ImageError(f"{where}: {host} resolves to no address")
    for a in addresses:
        if not ipaddress.ip_address(a.split("%")[0]).is_global:
            raise ImageError(f"{where}: {host} resolves to a private or local address ({a}); remote images "
                             "are fetched from public addresses only")
    return addresses[0]


def fetch(url: str, limits: ImageLimits, where: str, timeout: float = 10.0, resolve: Resolver = _resolve) -> bytes:
    """The bytes at `url` (ImageError with the reason otherwise)."""
    import httpx

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageError(f"{where}: not an http(s) URL")
    if parts.username is not None or parts.password is not None:
        raise ImageError(f"{where}: image URLs with credentials are not fetched")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = public_address(parts.hostname, port, where, resolve)
    # The connection goes to the address checked (a second lookup could answer otherwise);
    # the Host header and TLS name stay the URL's.
    transport = httpx.HTTPTransport(retries=0)
    target = url.replace(parts.netloc, f"[{address}]:{port}" if ":" in address else f"{address}:{port}", 1)
    try:
        with httpx.Client(transport=transport, timeout=timeout, follow_redirects=False) as client:
            request = client.build_request("GET", target, headers={"Host": parts.netloc},
                                           extensions={"sni_hostname": parts.hostname})
            r = client.send(request, stream=True)
            try:
                if r.is_redirect:
                    raise ImageError(f"{where}: the image URL redirects ({r.status_code}); redirects are not followed")
                if r.status_code != 200:
                    raise ImageError(f"{where}: the image URL answered {r.status_code}")
                data = bytearray()
                for chunk in r.iter_bytes():
                    data.extend(chunk)
                    if len(data) > limits.max_bytes:
                        raise ImageError(f"{where}: the image is over the {limits.max_bytes}-byte limit")
                return bytes(data)
            finally:
                r.close()
    except httpx.HTTPError as e:
        raise ImageError(f"{where}: fetching the image failed ({type(e).__name__})") from None
