"""GET /ui and its assets: files shipped in service/ui/static, served under a strict CSP.

The pages hold no tenant data: the browser calls the REST API itself, with the key kept in its
sessionStorage, so everything it shows is scoped by the API as for any other client.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from service.errors import NotFoundError

router = APIRouter(prefix="/ui", include_in_schema=False)

STATIC = Path(__file__).with_name("static")
# The only files served: a name never reaches the filesystem unless it is one of these.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "views.js": "text/javascript; charset=utf-8",
    "zip.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


@cache
def content_security_policy() -> str:
    """The dashboard's policy. A job's report page is shown in a frame (srcdoc), which runs under
    this policy too: its inline styles and its one sort script (by hash) are allowed, nothing else
    inline. opfuse.views is imported here, as the report routes do, so the server starts without it."""
    from opfuse.views import SCRIPT_HASH

    return (
        "default-src 'none'; "
        f"script-src 'self' 'sha256-{SCRIPT_HASH}'; "
        "style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data: blob:; "
        "connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def _headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": content_security_policy(),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "Cache-Control": "no-cache",
    }


@cache
def _asset(name: str) -> bytes:
    return (STATIC / name).read_bytes()


@router.get("")
def dashboard_redirect() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/")
def dashboard() -> Response:
    return Response(_asset("index.html"), media_type=ASSETS["index.html"], headers=_headers())


@router.get("/{name}")
def asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFoundError(f"no such file in the dashboard: '{name[:80]}'; open /ui/")
    return Response(_asset(name), media_type=ASSETS[name], headers=_headers())
