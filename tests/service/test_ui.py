"""The dashboard's files at /ui and the offline API page at /docs: served under a strict CSP, nothing
from another host, no route that reads tenant data (the browser calls the scoped REST API)."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from service.ui import routes
from service.ui.docs import render_api_page
from tests.service.conftest import Keys, bearer

# Anything that would make the browser reach another host: absolute URLs, protocol-relative ones.
EXTERNAL = re.compile(r"""(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}|(?:src|href)=["']//""", re.IGNORECASE)


@pytest.fixture
def database_url(sqlite_database_url: str) -> str:
    return sqlite_database_url


def test_dashboard_and_assets_under_a_strict_policy(client: TestClient) -> None:
    assert client.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text):
        assert client.get(src).status_code == 200, src
    for name, kind in routes.ASSETS.items():
        answer = client.get(f"/ui/{name}")
        assert answer.status_code == 200 and answer.headers["content-type"] == kind
        policy = answer.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy
        assert "'unsafe-eval'" not in policy and "script-src 'self' 'sha256-" in policy
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["x-frame-options"] == "DENY"
        assert not EXTERNAL.search(answer.text), (name, EXTERNAL.search(answer.text))
    assert "<script>" not in page.text and "style=" not in page.text  # nothing inline in the page


def test_no_other_file_and_no_tenant_data(client: TestClient, keys: Keys) -> None:
    for name in ("../app.py", "..%2fapp.py", "routes.py", "__init__.py", "static", "index.htm"):
        answer = client.get(f"/ui/{name}")
        assert answer.status_code == 404, name
        assert "open /ui/" in answer.json()["detail"] or name.startswith(".."), name
    # The files are the same for anyone: they hold no tenant's data.
    anonymous = client.get("/ui/app.js").content
    assert client.get("/ui/app.js", headers=bearer(keys.user)).content == anonymous
    assert client.get("/ui/app.js", headers=bearer(keys.other)).content == anonymous
    ui_routes = sorted(getattr(r, "path", "") for r in routes.router.routes)
    assert ui_routes == ["/ui", "/ui/", "/ui/{name}"]


def test_docs_is_offline_and_lists_every_operation(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert not EXTERNAL.search(page.text), EXTERNAL.search(page.text)
    assert "<script" not in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    spec = client.get("/openapi.json").json()
    for path, item in spec["paths"].items():
        for method in item:
            assert f'<span class="m {method}">{method}</span> <code>{path}</code>' in page.text
    assert client.get("/redoc").status_code == 404


def test_docs_escapes_the_spec() -> None:
    hostile = "<script>alert(1)</script>\"'&"
    spec = {
        "info": {"title": hostile, "version": "1"},
        "paths": {"/x": {"get": {"summary": hostile, "parameters": [{"name": hostile, "in": "query"}]}}},
        "components": {"schemas": {hostile: {"description": hostile}}},
    }
    page = render_api_page(spec)
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
