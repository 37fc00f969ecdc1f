"""The listening side of `macinfer serve`: the socket (bound before the model
loads, so a busy port fails fast), file-descriptor and connection limits, a
header timeout for idle connections, a per-address connection share, JSON
protocol errors, and rate-limited connection-error logs."""

from __future__ import annotations

import json
import logging
import resource
import socket
import time

from uvicorn.protocols.http.h11_impl import H11Protocol


class PortInUseError(OSError):
    pass


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket for host:port, or PortInUseError with a clear message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortInUseError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def raise_fd_limit(want: int = 65536) -> int:
    """Raise the soft open-file limit toward the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(want, hard) if hard != resource.RLIM_INFINITY else want
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def max_connections_for(fd_limit: int, reserve: int = 128) -> int:
    """Connections the server may hold open: the fd limit less what the process
    itself needs (model files, logs, pipes)."""
    return max(8, min(1024, fd_limit - reserve))


def _json_error(status: int, reason: str, message: str, type_: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


async def _busy(scope, receive, send) -> None:
    """uvicorn's answer past --max-connections, as a JSON error like every other."""
    body = json.dumps({"error": {"message": "the server has too many open connections; retry shortly",
                                 "type": "server_error", "param": None, "code": "service_unavailable"}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def protocol_with_limits(header_timeout: float, per_client: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with what it lacks against slow or greedy clients:
    connections that have not sent a complete request head within `header_timeout`
    seconds are closed (uvicorn only times out idle keep-alives); one client address
    holds at most `per_client` connections (so 40 trickling bodies or 250 idle
    keep-alives from one host cannot take every connection); and protocol-level
    errors are JSON bodies, as the app's are."""
    import uvicorn.protocols.http.h11_impl as h11_impl

    h11_impl.service_unavailable = _busy  # the 503 uvicorn sends past limit_concurrency
    per_address: dict[str, int] = {}

    class LimitedProtocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            self._peer = peer[0] if peer else None
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(header_timeout, self._head_timeout)
            if self._peer is not None:
                if per_address.get(self._peer, 0) >= per_client:
                    self._peer = None  # not counted
                    transport.write(_json_error(503, "Service Unavailable", "too many open connections from this "
                                                "address; close some and retry", "server_error"))
                    transport.close()
                    return
                per_address[self._peer] = per_address.get(self._peer, 0) + 1

        def _head_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None:
                self._head_timer.cancel()

        def send_400_response(self, msg: str) -> None:
            self.transport.write(_json_error(400, "Bad Request", msg, "invalid_request_error"))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._head_timer.cancel()
            if self._peer is not None:
                left = per_address.get(self._peer, 1) - 1
                if left:
                    per_address[self._peer] = left
                else:
                    per_address.pop(self._peer, None)
                self._peer = None
            super().connection_lost(exc)

    return LimitedProtocol


class RateLimitFilter(logging.Filter):
    """At most `burst` records per `window` seconds for each message template:
    a connection flood must not become a log flood."""

    def __init__(self, burst: int = 5, window: float = 10.0):
        super().__init__()
        self.burst, self.window = burst, window
        self.seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        start, count = self.seen.get(record.msg, (now, 0)) if isinstance(record.msg, str) else (now, 0)
        if now - start > self.window:
            start, count = now, 0
        self.seen[str(record.msg)] = (start, count + 1)
        if len(self.seen) > 1000:
            self.seen.clear()
        return count < self.burst
