"""Pure ASGI guards in front of the app: Host check, API key, body limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware), so the app's `receive` stays
the server's own: a handler sees `http.disconnect` when its client goes away
and can abort the request, streaming or not.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import secrets
import socket
from collections.abc import Awaitable, Callable

from macinfer.text.json_limits import JSONTooDeep, check_depth

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

log = logging.getLogger("macinfer.server")

_DRAIN_LIMIT = 64 << 20  # a refused body up to this size is read before the 413 goes out
_DRAIN_SECONDS = 5.0

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


# RFC 9110 Host: uri-host [ ":" port ], where uri-host is a name, an IPv4 literal or
# a bracketed IPv6 literal. No userinfo ("localhost:80@evil.example"), no path.
_HOST_RE = re.compile(r"^(?P<host>\[[0-9a-f:.]+\]|[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?)(?::(?P<port>\d{1,5}))?$")


def host_name(value: bytes) -> str | None:
    """The host of a Host header (lower case, IPv6 in brackets), or None if the header
    is not a well-formed authority."""
    try:
        text = value.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    m = _HOST_RE.match(text.rstrip("."))
    return m.group("host") if m else None


def is_ip_literal(host: str) -> bool:
    """DNS rebinding needs a name that resolves to this machine; a bare address cannot
    be rebound, so a Host that is one is safe to answer."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def allowed_host_names(bound: str, extra: tuple[str, ...] = ()) -> set[str] | None:
    """Host names a server bound to `bound` answers to: loopback names, the bound
    address, this machine's names (and `NAME.local`), and `extra`. None (any) only
    when `extra` holds "*"."""
    if "*" in extra:
        return None
    names = {*LOOPBACK_HOSTS, bound.lower(), *(h.lower().rstrip(".") for h in extra)}
    if not is_loopback(bound):
        for name in {socket.gethostname(), socket.getfqdn()}:
            if name:
                names |= {name.lower(), f"{name.lower().split('.')[0]}.local"}
    return names


_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|"
                             rb"(?<![0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def json_body_problem(scope: Scope, body: bytes) -> str | None:
    """Why a request body is refused before any route sees it (None: it is not). A body that
    is JSON is read as JSON whatever its Content-Type says (as Ollama and llama-server do:
    `curl -d` sends form encoding); it may nest MAX_JSON_DEPTH deep and hold no unpaired
    UTF-16 surrogate escape (not text: the tokenizer would fail on it)."""
    headers = scope.get("headers") or []
    kind = next((v for k, v in headers if k == b"content-type"), b"").split(b";")[0].strip().lower()
    if kind.startswith(b"multipart/") or body.lstrip()[:1] not in (b"{", b"["):
        return None
    if kind != b"application/json":
        scope["headers"] = [(k, v) for k, v in headers if k != b"content-type"] + \
            [(b"content-type", b"application/json")]
    try:
        check_depth(body, "the request body")
    except JSONTooDeep as e:
        return str(e)
    if _LONE_SURROGATE.search(body):  # a candidate (an escaped backslash may precede it): parse to be sure
        try:
            value = json.loads(body)
        except ValueError:
            return None  # the route says what is wrong with it
        where = _surrogate_at(value, "")
        if where is not None:
            return f"{where or 'body'} contains an unpaired UTF-16 surrogate (invalid Unicode)"
    return None


def _surrogate_at(value, path: str) -> str | None:
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            stack.extend((x, f"{p}.{k}" if p else str(k)) for k, x in v.items())
            stack.extend((k, p) for k in v)
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))
    return None


class Guard:
    """Host header check (DNS-rebinding defence: a browser page on another name cannot
    reach the server through the user's browser; addresses are always answered), API key
    (`Authorization: Bearer KEY` or `x-api-key: KEY`), and a body limit that
    buffers the body, so a chunked upload over the limit gets 413 too."""

    def __init__(self, app, api_keys: list[str], max_body_bytes: int, allowed_hosts: set[str] | None,
                 open_paths: tuple[str, ...] = ("/health",), body_timeout: float = 30.0):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_body = max_body_bytes
        self.body_timeout = body_timeout
        self.allowed_hosts = allowed_hosts
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = host_name(headers.get(b"host", b""))
        if host is None or (self.allowed_hosts is not None and host not in self.allowed_hosts
                            and not is_ip_literal(host)):
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
        declared_size = int(declared) if declared is not None and declared.isdigit() else None
        if declared_size is not None and declared_size > self.max_body:
            if headers.get(b"expect", b"").lower() != b"100-continue" and declared_size <= _DRAIN_LIMIT:
                # Read what the client is sending before answering: closing on unread
                # data makes the kernel reset the connection, and the client sees that
                # instead of the 413.
                await self._drain(receive)
            return await self._too_large(send, scope["path"])
        chunks, size = [], 0
        if scope["method"] in ("POST", "PUT", "PATCH"):
            deadline = asyncio.get_running_loop().time() + self.body_timeout
            while True:
                try:
                    message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
                except (asyncio.TimeoutError, ValueError):
                    return await send_error(send, 408, f"the request body did not arrive within {self.body_timeout:g} s",
                                            "invalid_request_error", "request_timeout",
                                            headers=[(b"connection", b"close")], path=scope["path"])
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_body:
                    if size + (declared_size or 0) <= _DRAIN_LIMIT:
                        await self._drain(receive)
                    return await self._too_large(send, scope["path"])
                if not message.get("more_body", False):
                    break
        body = b"".join(chunks)
        if body:
            # ~25 ms a MB: a large body is looked at off the event loop (streams go on)
            refused = json_body_problem(scope, body) if len(body) < 1 << 20 else \
                await asyncio.to_thread(json_body_problem, scope, body)
            if refused:
                return await send_error(send, 400, refused, "invalid_request_error", path=scope["path"])
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls see the client's disconnect

        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = (scope.get("state") or {}).get("response_headers")  # set by an endpoint (request.state)
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, replay, tracked_send)
        except Exception:
            # Caught here rather than by an app-level handler: Starlette re-raises after
            # its handler, so uvicorn would log every 500 a second time.
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:
                await send_error(send, 500, "internal server error", "server_error", path=scope["path"])

    async def _drain(self, receive: Receive) -> None:
        """Read and drop the rest of a refused body, within _DRAIN_LIMIT bytes and a few seconds."""
        loop = asyncio.get_running_loop()
        deadline, size = loop.time() + _DRAIN_SECONDS, 0
        while size <= _DRAIN_LIMIT:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))

    async def _too_large(self, send: Send, path: str) -> None:
        await send_error(send, 413, f"request body is larger than {self.max_body} bytes (serve --max-body-mb)",
                         "invalid_request_error",
                         headers=[(b"connection", b"close")], path=path)
