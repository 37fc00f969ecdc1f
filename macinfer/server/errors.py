"""The errors every API answers with: an HTTP status and an OpenAI-style body (the
Anthropic and Ollama routes reshape it), and what a client learns of a failed generation."""

from __future__ import annotations

import logging
from typing import Any

from macinfer.engine.outputs import RequestOutput

log = logging.getLogger("macinfer.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def generation_error(out: RequestOutput) -> APIError:
    """What a client learns of a failed request: a message meant for it (shutdown,
    engine stopped: 503), or a generic 500. Exception text and paths stay in the log."""
    if out.client_error:
        return APIError(503, out.client_error, type="server_error", code="service_unavailable")
    log.error("request %s failed: %s", out.request_id, out.error)
    return APIError(500, "generation failed with an internal error (details are in the server log)",
                    type="server_error")
