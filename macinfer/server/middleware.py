"""Pure ASGI guards in front of the app: Host check, API key, body limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware), so the app's `receive` stays
the server's own: a handler sees `http.disconnect` when its client goes away
and can abort the request, streaming or not.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


async def send_error(send: Send, status: int, message: str, type_: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None, path: str = "") -> None:
    if path.startswith("/v1/messages"):  # Anthropic's error shape for Anthropic clients
        from macinfer.server.anthropic import error_body

        body = json.dumps(error_body(status, message)).encode()
    else:
        body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _host_name(value: bytes) -> str:
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """Host header check (DNS-rebinding defence for loopback servers), API key
    (`Authorization: Bearer KEY` or `x-api-key: KEY`), and a body limit that
    buffers the body, so a chunked upload over the limit gets 413 too."""

    def __init__(self, app, api_keys: list[str], max_body_bytes: int, allowed_hosts: set[str] | None,
                 open_paths: tuple[str, ...] = ("/health",)):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_body = max_body_bytes
        self.allowed_hosts = allowed_hosts
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.allowed_hosts is not None and _host_name(headers.get(b"host", b"")) not in self.allowed_hosts:
            return await send_error(send, 400, "invalid Host header (this server only answers to its own address; "
                                    "add names with --allowed-host)", "invalid_request_error", "invalid_host",
                                    path=scope["path"])
        if self.keys and scope["path"] not in self.open_paths and scope["method"] != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            # Compare with every key (bytes: a non-ASCII header is just a wrong key).
            matched = [i for i, k in enumerate(self.keys) if secrets.compare_digest(given, k)]
            if not matched:
                return await send_error(send, 401, "missing or invalid API key (send 'Authorization: Bearer <key>' "
                                        "or 'x-api-key: <key>')", "authentication_error", "invalid_api_key",
                                        path=scope["path"])
            scope.setdefault("state", {})["api_key_index"] = matched[0]  # for prefix-cache isolation
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return await self._too_large(send, scope["path"])
        chunks, size = [], 0
        if scope["method"] in ("POST", "PUT", "PATCH"):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_body:
                    return await self._too_large(send, scope["path"])
                if not message.get("more_body", False):
                    break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls see the client's disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, path: str) -> None:
        await send_error(send, 413, f"request body is larger than {self.max_body} bytes", "invalid_request_error",
                         headers=[(b"connection", b"close")], path=path)
