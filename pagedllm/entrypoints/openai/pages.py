"""The server's browser pages: the chat page at /, the static files both pages load, their palette.

The pages are hand-written files in static/ (package data: an install carries them, nothing is built,
nothing comes from a CDN, so they work offline). The files themselves hold no data and are open to
anyone; what a page shows comes from routes behind the API key (the OpenAI routes, /kv/events). A
browser cannot send `Authorization` when it opens a page, so / and /kv also take the key as `?api_key=`
(APIKeyMiddleware); the page then drops it from the address bar and sends it as a header.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from pagedllm.errors import InputError
from pagedllm.plot_style import css_palette

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_PREFIX = "/static/"
PAGE_PATHS = frozenset({"/", "/kv"})  # where the API key may come as ?api_key=


def check_query(raw: Request, allowed: frozenset[str]) -> None:
    """A query parameter a route does not take is a 400 naming it (a typo should not pass silently)."""
    unknown = sorted(set(raw.query_params) - allowed)
    if unknown:
        takes = f"takes only {', '.join(sorted(allowed))}" if allowed else "takes no query parameters"
        raise InputError(f"unknown query parameter {unknown[0]!r}: {raw.url.path} {takes}", param=unknown[0])


def page(name: str) -> FileResponse:
    """One of the static HTML pages, never cached (a new install's page should load its new script)."""
    return FileResponse(STATIC_DIR / name, media_type="text/html", headers={"Cache-Control": "no-cache"})


def add_page_routes(app: FastAPI) -> None:
    """/ (the chat page), /static/palette.css (plot_style's colors) and the static files."""

    @app.get("/", include_in_schema=False)
    async def chat_page(raw: Request) -> Response:
        """A small chat: streams from /v1/chat/completions, shows tokens/s and the request's blocks."""
        check_query(raw, frozenset({"api_key"}))
        return page("chat.html")

    @app.get(STATIC_PREFIX + "palette.css", include_in_schema=False)
    async def palette() -> Response:
        return Response(css_palette(), media_type="text/css")

    app.mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC_DIR), name="static")
