"""The web playground at ``/``: a chat page over this server's own OpenAI API (streaming,
attachments, sampling controls, per-message usage), its assets shipped in the package so it
works with no internet. ``--no-playground`` leaves it out."""

from __future__ import annotations

import secrets
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Header
from fastapi.responses import FileResponse

from omniserve.entrypoints.openai.serving_engine import ServingError

ASSETS = Path(__file__).with_name("playground")
_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def playground_router(info: dict[str, Any], api_key: str | None) -> APIRouter:
    """``/`` (the page), ``/playground/<asset>`` and ``/playground/info``: the served model as
    the page shows it, given the API key when the server has one (without it, only that a key
    is needed: a 200, so the browser logs no failed request before the user enters one)."""
    router = APIRouter(include_in_schema=False)
    assets = {path.name: path for path in ASSETS.iterdir() if path.suffix in _MEDIA_TYPES}

    @router.get("/")
    async def page() -> FileResponse:
        return _asset(assets["index.html"])

    @router.get("/playground/info")
    async def served(authorization: str = Header("")) -> dict[str, Any]:
        scheme, _, token = authorization.partition(" ")
        if api_key is not None and not (
            scheme.lower() == "bearer"
            and secrets.compare_digest(token.strip().encode(), api_key.encode())
        ):
            return {"api_key_required": True}
        return {"api_key_required": False, **info}

    @router.get("/playground/{name}")
    async def asset(name: str) -> FileResponse:
        path = assets.get(name)
        if path is None:
            raise ServingError(f"No playground asset {name!r}.", HTTPStatus.NOT_FOUND)
        return _asset(path)

    return router


def _asset(path: Path) -> FileResponse:
    return FileResponse(
        path, media_type=_MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"}
    )
