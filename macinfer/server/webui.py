"""The chat page at `/`: plain static files shipped in the package (no build step,
no CDN, works offline). The page itself holds no secrets, so it loads without
the API key; every API call it makes carries the key the user entered."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse

WEBUI_DIR = Path(__file__).with_name("webui")
ASSETS = {"chat.js": "text/javascript", "markdown.js": "text/javascript", "chat.css": "text/css"}
OPEN_PATHS = ("/", *(f"/ui/{name}" for name in ASSETS))
# The page runs only its own files and talks only to this server.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_routes(app: FastAPI) -> None:
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # clients probe `HEAD /`
    async def index() -> FileResponse:
        return FileResponse(WEBUI_DIR / "index.html", media_type="text/html", headers=HEADERS)

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise HTTPException(404, f"no such file: /ui/{name}")
        return FileResponse(WEBUI_DIR / name, media_type=ASSETS[name], headers=HEADERS)
