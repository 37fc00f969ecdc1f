"""The listening side of `macinfer serve`: the socket (bound before the model
loads, so a busy port fails fast), file-descriptor and connection limits, a
header timeout for idle connections, and rate-limited connection-error logs."""

from __future__ import annotations

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


def protocol_with_header_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections that have not sent a complete
    request head within `seconds` (uvicorn only times out idle keep-alives)."""

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(seconds, self._head_timeout)

        def _head_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None:
                self._head_timer.cancel()

        def connection_lost(self, exc) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


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
