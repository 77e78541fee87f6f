"""GET /docs: the API reference as one page rendered here from the app's OpenAPI document, so it
needs nothing from the network (FastAPI's Swagger UI loads its scripts from a CDN, and the Swagger
UI packages pip can install here predate OpenAPI 3.1, which FastAPI writes)."""

from __future__ import annotations

import html
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)

CONTENT_SECURITY_POLICY = "default-src 'none'; style-src 'self' 'unsafe-inline'; img-src data:; " + (
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_METHODS = ("get", "post", "put", "patch", "delete")
_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; color: #1d2330; margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 16px 24px 48px; }
h2 { border-bottom: 1px solid #d9dde5; padding-bottom: 4px; margin-top: 32px; }
section.op { border: 1px solid #d9dde5; border-radius: 6px; margin: 10px 0; padding: 8px 12px; }
.m { display: inline-block; min-width: 64px; font-weight: 600; text-transform: uppercase; }
.get { color: #1a7f37; } .post { color: #2f6fdf; } .put { color: #9a6700; } .delete { color: #c62828; }
code, pre { font: 12.5px ui-monospace, monospace; }
pre { background: #f6f7f9; padding: 8px; overflow-x: auto; max-height: 360px; }
table { border-collapse: collapse; margin: 4px 0; } td, th { padding: 2px 10px 2px 0; text-align: left; }
.muted { color: #5b6475; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _type(schema: Any) -> str:
    if not isinstance(schema, dict):
        return ""
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " | ".join(_type(s) for s in schema[key])
    kind = str(schema.get("type", "object"))
    if kind == "array":
        return f"{_type(schema.get('items'))}[]"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    return kind


def _parameters(op: dict[str, Any]) -> str:
    rows = [
        f"<tr><td><code>{_e(p.get('name'))}</code></td><td>{_e(p.get('in'))}</td>"
        f"<td>{_e(_type(p.get('schema')))}</td><td>{'required' if p.get('required') else ''}</td>"
        f"<td class='muted'>{_e(p.get('description') or (p.get('schema') or {}).get('description') or '')}</td></tr>"
        for p in op.get("parameters", [])
        if isinstance(p, dict)
    ]
    return f"<table>{''.join(rows)}</table>" if rows else ""


def _body(op: dict[str, Any]) -> str:
    content = (op.get("requestBody") or {}).get("content") or {}
    parts = [f"<code>{_e(kind)}</code> {_e(_type(media.get('schema')))}" for kind, media in content.items()]
    return f"<p>Body: {', '.join(parts)}</p>" if parts else ""


def _responses(op: dict[str, Any]) -> str:
    rows = []
    for code, answer in (op.get("responses") or {}).items():
        content = (answer or {}).get("content") or {}
        kinds = ", ".join(f"{_e(k)} {_e(_type(v.get('schema')))}" for k, v in content.items())
        rows.append(
            f"<tr><td>{_e(code)}</td><td>{_e((answer or {}).get('description', ''))}</td><td>{kinds}</td></tr>"
        )
    return f"<table>{''.join(rows)}</table>" if rows else ""


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    anchor = f"{method}-{path}".replace("/", "_").replace("{", "").replace("}", "")
    return (
        f'<section class="op" id="{_e(anchor)}"><div><span class="m {method}">{method}</span> '
        f"<code>{_e(path)}</code> {_e(op.get('summary', ''))}</div>"
        f"<p class='muted'>{_e(op.get('description', ''))}</p>"
        f"{_parameters(op)}{_body(op)}<p>Responses:</p>{_responses(op)}</section>"
    )


def render_api_page(spec: dict[str, Any]) -> str:
    """The OpenAPI document `spec` as an HTML page: every operation with its parameters, body and
    answers, grouped by tag, then every schema as JSON. Everything from the spec is escaped."""
    info = spec.get("info") or {}
    by_tag: dict[str, list[str]] = {}
    for path, item in (spec.get("paths") or {}).items():
        for method in _METHODS:
            if isinstance(item, dict) and isinstance(item.get(method), dict):
                op = item[method]
                tag = str((op.get("tags") or ["other"])[0])
                by_tag.setdefault(tag, []).append(_operation(path, method, op))
    sections = "".join(f"<h2>{_e(tag)}</h2>{''.join(ops)}" for tag, ops in by_tag.items())
    schemas = (spec.get("components") or {}).get("schemas") or {}
    models = "".join(
        f"<details><summary><code>{_e(name)}</code></summary><pre>{_e(json.dumps(schema, indent=2))}</pre></details>"
        for name, schema in schemas.items()
    )
    title = f"{info.get('title', 'API')} {info.get('version', '')}".strip()
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        '<link rel="icon" href="data:,">'
        f"<title>{_e(title)} API</title><style>{_CSS}</style></head><body><main>"
        f"<h1>{_e(title)} API</h1><p>{_e(info.get('summary', ''))}</p>"
        "<p>Every call but the health checks needs <code>Authorization: Bearer &lt;api key&gt;</code>. "
        "The machine-readable document is <a href='/openapi.json'>/openapi.json</a>; the dashboard is "
        "<a href='/ui/'>/ui</a>.</p>"
        f"{sections}<h2>Schemas</h2>{models}</main></body></html>\n"
    )


@router.get("/docs", response_class=HTMLResponse)
def api_docs(request: Request) -> HTMLResponse:
    page = render_api_page(request.app.openapi())
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff"}
    return HTMLResponse(page, headers=headers)
