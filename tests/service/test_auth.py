"""API keys: 401 without a valid key, 403 for the wrong scope, admin key creation, local bootstrap."""

from __future__ import annotations

import json
import stat

from fastapi.testclient import TestClient
from sqlalchemy import select

from service.auth import hash_key
from service.bootstrap import ensure_local_keys, remove_server_info, write_server_info
from service.db import make_engine
from service.models import ApiKey
from service.settings import Settings

from .conftest import Keys, bearer

CLAIM = {"worker_id": "w", "device": "cpu"}


def test_no_key_is_401_with_a_bearer_challenge(client: TestClient, keys: Keys) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in response.json()["detail"]


def test_bad_or_malformed_key_is_401(client: TestClient, keys: Keys) -> None:
    for header in (
        "Bearer opf_not-a-real-key",
        "Bearer something-else",
        "Basic dXNlcjpwYXNz",
        f"Bearer{keys.user}",
    ):
        response = client.get("/v1/jobs", headers={"Authorization": header})
        assert response.status_code == 401, header
        assert response.headers["www-authenticate"] == "Bearer"


def test_wrong_scope_is_403(client: TestClient, keys: Keys) -> None:
    user_on_worker = client.post("/v1/worker/claim", json=CLAIM, headers=bearer(keys.user))
    assert user_on_worker.status_code == 403
    assert "scope 'worker'" in user_on_worker.json()["detail"]
    assert client.post("/v1/worker/claim", json=CLAIM, headers=bearer(keys.admin)).status_code == 403
    assert client.get("/v1/models", headers=bearer(keys.worker)).status_code == 403
    user_on_admin = client.post(
        "/v1/admin/api-keys", json={"tenant": "x", "scope": "user"}, headers=bearer(keys.user)
    )
    assert user_on_admin.status_code == 403


def test_platform_admin_creates_keys_for_new_tenants(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    response = client.post(
        "/v1/admin/api-keys", json={"tenant": "team-b", "scope": "user"}, headers=bearer(keys.platform)
    )
    assert response.status_code == 201
    body = response.json()
    assert body["tenant"] == "team-b" and body["scope"] == "user" and body["key"].startswith("opf_")
    assert client.get("/v1/models", headers=bearer(body["key"])).status_code == 200
    engine = make_engine(settings.database_url)
    with engine.connect() as connection:
        hashes = set(connection.scalars(select(ApiKey.key_hash)))
    engine.dispose()
    assert hash_key(body["key"]) in hashes and body["key"] not in hashes  # stored hashed only
    for bad in ({"tenant": "Bad Name!", "scope": "user"}, {"tenant": "ok", "scope": "root"}):
        assert client.post("/v1/admin/api-keys", json=bad, headers=bearer(keys.platform)).status_code == 422


def test_local_keys_are_made_once_and_reused(client: TestClient, settings: Settings) -> None:
    admin, worker = ensure_local_keys(settings)
    assert ensure_local_keys(settings) == (admin, worker)
    for name, key in (("api_key", admin), ("worker_key", worker)):
        path = settings.home / name
        assert path.read_text().strip() == key
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert client.get("/v1/models", headers=bearer(admin)).status_code == 200
    assert client.post("/v1/worker/claim", json=CLAIM, headers=bearer(worker)).status_code == 204

    (settings.home / "api_key").write_text("opf_unknown\n")  # e.g. a file left from another database
    new_admin, same_worker = ensure_local_keys(settings)
    assert new_admin != admin and same_worker == worker
    assert (settings.home / "api_key").read_text().strip() == new_admin


def test_server_info_is_written_for_the_cli(settings: Settings) -> None:
    path = write_server_info(settings, port=8123)
    assert json.loads(path.read_text())["url"] == "http://127.0.0.1:8123"
    remove_server_info(settings)
    assert not path.exists()
    wildcard = settings.model_copy(update={"host": "0.0.0.0"})
    assert json.loads(write_server_info(wildcard).read_text())["url"] == f"http://127.0.0.1:{settings.port}"
