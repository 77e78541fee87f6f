"""Fixtures of the service tests: a fresh database per test (SQLite file, or PostgreSQL when
OPFUSE_TEST_POSTGRES_URL is set: one database per session, emptied before each test), the app, a
TestClient, and keys for two tenants and a worker.

Every test that uses `database_url` (directly or through `client`) runs on both databases. With
OPFUSE_REQUIRE_POSTGRES=1 an unreachable or unconfigured PostgreSQL fails those tests instead of
skipping them.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.orm import Session

from service import webhooks
from service.app import create_app
from service.auth import create_key, get_or_create_tenant
from service.db import make_engine, upgrade_to_head
from service.models import Scope
from service.settings import Settings
from tests.postgres import (
    create_postgres_database,
    drop_postgres_database,
    reachable_postgres,
)

from .onnx_models import mlp, to_bytes

# Children first. DELETE, not TRUNCATE: several times faster on tables this small.
TABLES = ("webhook_deliveries", "jobs", "models", "blob_chunks", "blobs", "api_keys", "tenants")


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The URL of a reachable PostgreSQL (a database to connect to for CREATE/DROP DATABASE)."""
    return reachable_postgres()


@pytest.fixture(scope="session")
def postgres_database(postgres_server: str) -> Iterator[str]:
    """One migrated database for the whole session, dropped at the end."""
    url = create_postgres_database(postgres_server)
    try:
        upgrade_to_head(url)
        yield url
    finally:
        drop_postgres_database(postgres_server, url)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file; each test gets a copy (cheaper than migrating every time)."""
    path = tmp_path_factory.mktemp("template") / "opfuse.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database of its own for this test."""
    if request.param == "sqlite":
        sqlite_url: str = request.getfixturevalue("sqlite_database_url")
        return sqlite_url
    url: str = request.getfixturevalue("postgres_database")
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            for table in TABLES:
                connection.execute(text(f"DELETE FROM {table}"))
    finally:
        engine.dispose()
    return url


@pytest.fixture
def sqlite_database_url(sqlite_template: Path, tmp_path: Path) -> str:
    """A migrated, empty SQLite database; a module whose tests need no PostgreSQL run overrides
    `database_url` with it."""
    path = tmp_path / "home" / "opfuse.db"
    path.parent.mkdir(exist_ok=True)
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def public_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host name resolves to a public address (no DNS in tests)."""
    monkeypatch.setattr(webhooks, "resolve", lambda host, port: ["93.184.216.34"])


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        home=tmp_path / "home",
        database_url=database_url,
        max_upload_bytes=64 * 1024,
        lease_seconds=30,
        max_attempts=3,
        webhook_secret=SecretStr("test-webhook-secret"),
        # The tests drive requeue, sweep and webhook delivery themselves.
        requeue_interval_seconds=3600,
        blob_gc_interval_seconds=3600,
        webhook_interval_seconds=3600,
    )


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    # The database is migrated already (test_migrations covers migrating at app start).
    with TestClient(create_app(settings, run_migrations=False)) as test_client:
        yield test_client


@dataclass(frozen=True)
class Keys:
    admin: str  # tenant "default" (its tenant admin)
    user: str  # tenant "default"
    other: str  # tenant "other"
    worker: str
    platform: str  # the operator's key (tenant "default")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys(client: TestClient, settings: Settings) -> Keys:
    """Keys made straight in the database (test_auth covers the admin API and ensure_local_keys)."""
    engine = make_engine(settings.database_url)
    try:
        with Session(engine) as session, session.begin():
            default, other = get_or_create_tenant(session, "default"), get_or_create_tenant(session, "other")
            return Keys(
                admin=create_key(session, default, Scope.ADMIN),
                user=create_key(session, default, Scope.USER),
                other=create_key(session, other, Scope.USER),
                worker=create_key(session, default, Scope.WORKER),
                platform=create_key(session, default, Scope.PLATFORM),
            )
    finally:
        engine.dispose()


@pytest.fixture
def api_url(settings: Settings, keys: Keys) -> Iterator[str]:
    """The app served over real HTTP (uvicorn, in a thread, on a free port) on the test's database,
    for the SDK and the CLI."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(settings, run_migrations=False)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def upload(client: TestClient, key: str, data: bytes, name: str = "mlp.onnx") -> dict:
    response = client.post(
        "/v1/models",
        params={"name": name},
        content=data,
        headers={**bearer(key), "Content-Type": "application/octet-stream"},
    )
    assert response.status_code in (200, 201), response.text
    body: dict = response.json()
    return body


@pytest.fixture
def model(client: TestClient, keys: Keys) -> dict:
    """The MLP (dynamic batch) uploaded by tenant default."""
    return upload(client, keys.user, to_bytes(mlp()))


def create_job(client: TestClient, key: str, model_id: str, **fields: object) -> dict:
    body = {"model_id": model_id, "input_shapes": {"x": [8, 4]}, **fields}
    response = client.post("/v1/jobs", json=body, headers=bearer(key))
    assert response.status_code == 202, response.text
    job: dict = response.json()
    return job


@contextmanager
def client_with(settings: Settings, **overrides: object) -> Iterator[TestClient]:
    """A TestClient of an app with some settings changed (same database)."""
    with TestClient(create_app(settings.model_copy(update=overrides), run_migrations=False)) as test_client:
        yield test_client
