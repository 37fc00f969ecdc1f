"""A pass-through HTTP proxy that records every request an external client
sends (method, path, JSON body) and the status it got, for the agent-client
tests: they assert that Claude Code's and Codex's own requests all succeed.
Responses are relayed as they arrive (streams stay streams)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}


class RecordingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.records: list[dict[str, Any]] = []  # finished requests, in the order they finished
        self.in_flight: list[dict[str, Any]] = []  # started, not finished (a hang shows here)
        lock = threading.Lock()
        records, in_flight = self.records, self.in_flight

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                record: dict[str, Any] = {"method": self.command, "path": self.path, "status": None,
                                          "started": time.monotonic()}
                with lock:
                    in_flight.append(record)
                try:
                    record["body"] = json.loads(body) if body else None
                except ValueError:
                    record["body"] = body[:2000].decode("utf-8", "replace")
                up = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP | {"host"}}
                up.request(self.command, self.path, body=body or None, headers=headers)
                resp = up.getresponse()
                record["status"] = resp.status
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Connection", "close")  # body ends when the connection does
                self.end_headers()
                chunks = []
                try:
                    while self.command != "HEAD" and (chunk := resp.read1(65536)):
                        chunks.append(chunk)
                        record["bytes"] = record.get("bytes", 0) + len(chunk)  # progress, for a hang's report
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    record["client_closed"] = True  # the client went away mid-response
                record["response"] = b"".join(chunks)[-4000:].decode("utf-8", "replace")
                record["seconds"] = round(time.monotonic() - record["started"], 1)
                self.close_connection = True
                up.close()
                with lock:
                    in_flight.remove(record)
                    records.append(record)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


if __name__ == "__main__":  # python tests/recording_proxy.py UPSTREAM_PORT OUT.json
    import sys
    import time

    proxy = RecordingProxy(int(sys.argv[1]))
    print(proxy.port, flush=True)
    try:
        while True:
            time.sleep(1)
            with open(sys.argv[2], "w") as f:
                json.dump(proxy.records, f, indent=1)
    except KeyboardInterrupt:
        proxy.close()
