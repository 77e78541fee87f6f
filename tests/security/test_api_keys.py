"""API keys: a tenant's admin key manages its own tenant only (another tenant's keys and webhook
secret are 404), only the platform key makes keys for other tenants and worker keys; keys are
listed (never in clear), revoked and expired with effect on the next request; last use is recorded
at most once a minute; wrong keys are rate-limited per client address."""

from __future__ import annotations

import json
from datetime import timedelta

import httpx
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from service.auth import hash_key
from service.clock import utcnow
from service.db import make_engine
from service.models import ApiKey, Tenant
from service.settings import Settings
from tests.service.conftest import Keys, bearer, client_with


def _tenant_secrets(settings: Settings) -> dict[str, str | None]:
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            return {
                name: secret
                for name, secret in connection.execute(select(Tenant.name, Tenant.webhook_secret))
            }
    finally:
        engine.dispose()


def _key_count(settings: Settings) -> int:
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            return len(connection.scalars(select(ApiKey.id)).all())
    finally:
        engine.dispose()


def _set_key(settings: Settings, key: str, **values: object) -> None:
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(key)).values(**values))
    finally:
        engine.dispose()


def _key_row(settings: Settings, key: str) -> ApiKey:
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            row = connection.execute(select(ApiKey).where(ApiKey.key_hash == hash_key(key))).one()
            return ApiKey(**row._asdict())
    finally:
        engine.dispose()


def test_a_tenant_admin_cannot_mint_keys_for_another_tenant(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    before = _key_count(settings)
    for tenant in ("other", "brand-new"):
        response = client.post(
            "/v1/admin/api-keys", json={"tenant": tenant, "scope": "admin"}, headers=bearer(keys.admin)
        )
        assert response.status_code == 403, response.text
        assert "platform" in response.json()["detail"]
    # Worker keys claim every tenant's jobs: a tenant admin cannot make one even for itself.
    response = client.post(
        "/v1/admin/api-keys", json={"tenant": "default", "scope": "worker"}, headers=bearer(keys.admin)
    )
    assert response.status_code == 403, response.text
    assert _key_count(settings) == before
    assert "brand-new" not in _tenant_secrets(settings)


def test_a_tenant_admin_cannot_read_or_change_another_tenants_webhook_secret(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    before = _tenant_secrets(settings)
    for tenant in ("other", "no-such-tenant"):
        path = f"/v1/admin/tenants/{tenant}/webhook-secret"
        rotated = client.post(path, headers=bearer(keys.admin))
        assert rotated.status_code == 404, rotated.text
        assert "webhook_secret" not in rotated.json()
        assert client.delete(path, headers=bearer(keys.admin)).status_code == 404
    assert _tenant_secrets(settings) == before
    own = client.post("/v1/admin/tenants/default/webhook-secret", headers=bearer(keys.admin))
    assert own.status_code == 201 and _tenant_secrets(settings)["default"] == own.json()["webhook_secret"]


def test_the_platform_key_manages_every_tenant(client: TestClient, keys: Keys, settings: Settings) -> None:
    made = client.post(
        "/v1/admin/api-keys", json={"tenant": "team-c", "scope": "worker"}, headers=bearer(keys.platform)
    )
    assert made.status_code == 201, made.text
    assert made.json()["tenant"] == "team-c" and made.json()["scope"] == "worker"
    rotated = client.post("/v1/admin/tenants/other/webhook-secret", headers=bearer(keys.platform))
    assert rotated.status_code == 201
    assert _tenant_secrets(settings)["other"] == rotated.json()["webhook_secret"]
    # Tenant admins cannot make platform keys; the platform key can.
    assert (
        client.post("/v1/admin/api-keys", json={"scope": "platform"}, headers=bearer(keys.admin)).status_code
        == 403
    )
    assert (
        client.post(
            "/v1/admin/api-keys", json={"scope": "platform"}, headers=bearer(keys.platform)
        ).status_code
        == 201
    )


def test_keys_are_listed_per_tenant_and_never_in_clear(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    made = client.post("/v1/admin/api-keys", json={"scope": "user"}, headers=bearer(keys.admin))
    assert made.status_code == 201, made.text
    new = made.json()
    assert new["tenant"] == "default" and new["key"].startswith(new["prefix"]) and len(new["prefix"]) == 12

    listed = client.get("/v1/admin/api-keys", headers=bearer(keys.admin))
    assert listed.status_code == 200, listed.text
    items = listed.json()["items"]
    assert {item["tenant"] for item in items} == {"default"}  # not tenant "other"
    assert len(items) == 5  # admin, user, worker, platform, the new one
    assert [item["id"] for item in items] == sorted((item["id"] for item in items), reverse=True)
    mine = next(item for item in items if item["id"] == new["id"])
    assert mine["prefix"] == new["prefix"] and mine["scope"] == "user" and mine["revoked"] is False
    assert mine["expires_at"] is None and mine["created_at"]
    for secret in (keys.admin, keys.user, keys.worker, keys.platform, keys.other, new["key"]):
        assert secret not in listed.text and hash_key(secret) not in listed.text

    assert (
        client.get("/v1/admin/api-keys", params={"tenant": "other"}, headers=bearer(keys.admin)).status_code
        == 404
    )
    everyone = client.get("/v1/admin/api-keys", params={"limit": 2}, headers=bearer(keys.platform)).json()
    assert len(everyone["items"]) == 2 and everyone["next_cursor"]
    rest = client.get(
        "/v1/admin/api-keys",
        params={"cursor": everyone["next_cursor"], "limit": 200},
        headers=bearer(keys.platform),
    ).json()
    assert {item["tenant"] for item in everyone["items"] + rest["items"]} == {"default", "other"}
    assert len(everyone["items"] + rest["items"]) == 6 and rest["next_cursor"] is None
    bad = client.get("/v1/admin/api-keys", params={"cursor": "x\x00"}, headers=bearer(keys.platform))
    assert bad.status_code in (400, 422)
    assert client.get("/v1/admin/api-keys", headers=bearer(keys.user)).status_code == 403


def test_a_revoked_key_is_refused_at_once(client: TestClient, keys: Keys) -> None:
    assert client.get("/v1/models", headers=bearer(keys.other)).status_code == 200
    everyone = client.get("/v1/admin/api-keys", params={"tenant": "other"}, headers=bearer(keys.platform))
    (other,) = everyone.json()["items"]
    # Another tenant's key is not there for a tenant admin: 404, and the key keeps working.
    for method, path in (
        ("POST", f"/v1/admin/api-keys/{other['id']}/revoke"),
        ("DELETE", f"/v1/admin/api-keys/{other['id']}"),
    ):
        assert client.request(method, path, headers=bearer(keys.admin)).status_code == 404
    assert client.get("/v1/models", headers=bearer(keys.other)).status_code == 200

    revoked = client.post(f"/v1/admin/api-keys/{other['id']}/revoke", headers=bearer(keys.platform))
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["revoked"] is True and revoked.json()["revoked_at"]
    refused = client.get("/v1/models", headers=bearer(keys.other))
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]

    # A tenant admin revokes its own tenant's keys (DELETE is the same).
    listed = client.get("/v1/admin/api-keys", headers=bearer(keys.admin)).json()["items"]
    user = next(item for item in listed if item["scope"] == "user")
    assert client.delete(f"/v1/admin/api-keys/{user['id']}", headers=bearer(keys.admin)).status_code == 200
    assert client.get("/v1/models", headers=bearer(keys.user)).status_code == 401
    assert client.post("/v1/admin/api-keys/999999/revoke", headers=bearer(keys.platform)).status_code == 404


def test_an_expired_key_is_refused(client: TestClient, keys: Keys, settings: Settings) -> None:
    soon = (utcnow() + timedelta(hours=1)).isoformat()
    made = client.post(
        "/v1/admin/api-keys", json={"scope": "user", "expires_at": soon}, headers=bearer(keys.admin)
    )
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    assert made.json()["expires_at"] is not None
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    _set_key(settings, key, expires_at=utcnow() - timedelta(seconds=1))
    refused = client.get("/v1/models", headers=bearer(key))
    assert refused.status_code == 401 and "expired" in refused.json()["detail"]

    past = (utcnow() - timedelta(minutes=1)).isoformat()
    late = client.post(
        "/v1/admin/api-keys", json={"scope": "user", "expires_at": past}, headers=bearer(keys.admin)
    )
    assert late.status_code == 422 and "past" in late.json()["detail"]
    naive = client.post(
        "/v1/admin/api-keys",
        json={"scope": "user", "expires_at": "2999-01-01T00:00:00"},
        headers=bearer(keys.admin),
    )
    assert naive.status_code == 422


def test_last_use_is_recorded_at_most_once_a_minute(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    assert _key_row(settings, keys.user).last_used_at is None
    assert client.get("/v1/models", headers=bearer(keys.user)).status_code == 200
    first = _key_row(settings, keys.user).last_used_at
    assert first is not None and abs((utcnow() - first).total_seconds()) < 60

    recent = utcnow() - timedelta(seconds=30)
    _set_key(settings, keys.user, last_used_at=recent)
    for _ in range(3):
        assert client.get("/v1/models", headers=bearer(keys.user)).status_code == 200
    assert _key_row(settings, keys.user).last_used_at == recent  # not rewritten within the minute

    stale = utcnow() - timedelta(minutes=2)
    _set_key(settings, keys.user, last_used_at=stale)
    assert client.get("/v1/models", headers=bearer(keys.user)).status_code == 200
    assert _key_row(settings, keys.user).last_used_at > stale  # type: ignore[operator]
    listed = client.get("/v1/admin/api-keys", headers=bearer(keys.admin)).json()["items"]
    assert next(item for item in listed if item["scope"] == "user")["last_used_at"] is not None


def test_wrong_keys_are_rate_limited_per_address(settings: Settings, keys: Keys) -> None:
    with client_with(settings, auth_failures_per_min=20) as client:
        for attempt in range(20):
            guess = client.get("/v1/models", headers=bearer(f"opf_guess{attempt}"))
            assert guess.status_code == 401, (attempt, guess.text)
        blocked = client.get("/v1/models", headers=bearer("opf_guess-more"))
        assert blocked.status_code == 429
        assert int(blocked.headers["retry-after"]) >= 1
        assert "failed authentications" in blocked.json()["detail"]
        # While blocked, that address gets 429 even with a right key: guessing gains nothing.
        assert client.get("/v1/models", headers=bearer(keys.user)).status_code == 429


def test_the_failed_auth_limit_refills_and_is_per_address() -> None:
    from service.rate_limit import FailedAuthLimiter  # here: the module is older than this limiter

    now = [0.0]
    limiter = FailedAuthLimiter(per_minute=6, clock=lambda: now[0])
    for _ in range(6):
        limiter.check("10.0.0.1")
        limiter.failed("10.0.0.1")
    try:
        limiter.check("10.0.0.1")
    except Exception as exc:
        assert getattr(exc, "status_code", None) == 429
        assert exc.headers == {"Retry-After": "10"}  # type: ignore[attr-defined]
    else:
        raise AssertionError("a seventh failed attempt in a minute was not refused")
    limiter.check("10.0.0.2")  # another address is not affected
    now[0] = 10.0  # one attempt refilled
    limiter.check("10.0.0.1")


def _cli(api_url: str, key: str, *args: str) -> str:
    from typer.testing import CliRunner

    from client.cli import app as cli_app

    result = CliRunner().invoke(cli_app, [*args, "--api", api_url, "--key", key], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return result.output


def test_opfuse_keys_create_list_revoke(api_url: str, keys: Keys) -> None:
    made = json.loads(
        _cli(api_url, keys.admin, "keys", "create", "--scope", "user", "--expires-in", "30d", "--json")
    )
    assert made["key"].startswith(made["prefix"]) and made["tenant"] == "default" and made["expires_at"]
    with httpx.Client(base_url=api_url) as http:
        assert http.get("/v1/models", headers=bearer(made["key"])).status_code == 200

        listed = json.loads(_cli(api_url, keys.admin, "keys", "list", "--json"))
        assert {k["tenant"] for k in listed} == {"default"} and made["id"] in {k["id"] for k in listed}
        table = _cli(api_url, keys.admin, "keys", "list")
        assert made["prefix"] in table and made["key"] not in table and "live" in table

        revoked = json.loads(_cli(api_url, keys.admin, "keys", "revoke", str(made["id"]), "--json"))
        assert revoked["revoked"] is True
        assert http.get("/v1/models", headers=bearer(made["key"])).status_code == 401
        assert "revoked" in _cli(api_url, keys.admin, "keys", "list")

    # A tenant admin asking for another tenant: one line naming the platform key, exit 1.
    from typer.testing import CliRunner

    from client.cli import app as cli_app

    refused = CliRunner().invoke(
        cli_app, ["keys", "create", "--tenant", "other", "--api", api_url, "--key", keys.admin]
    )
    assert refused.exit_code == 1 and "platform" in refused.output and "HTTP 403" in refused.output
    bad = CliRunner().invoke(
        cli_app, ["keys", "create", "--expires-in", "soon", "--api", api_url, "--key", keys.admin]
    )
    assert bad.exit_code == 2 and "30d" in bad.output
