"""`alembic upgrade head` on an empty database gives exactly the models' schema (SQLite, PostgreSQL)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import inspect, text

from service.app import create_app
from service.blobs import open_blob
from service.db import alembic_config, make_engine, make_session_factory, migrations_dir, upgrade_to_head
from service.models import Base
from service.settings import Settings
from tests.postgres import create_postgres_schema, drop_postgres_schema


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    server: str = request.getfixturevalue("postgres_server")
    url = create_postgres_schema(server)
    try:
        yield url
    finally:
        drop_postgres_schema(server, url)


def schema_diff(database_url: str) -> list:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"compare_type": True, "compare_server_default": False}
            )
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_head_gives_the_models_schema(empty_database: str) -> None:
    upgrade_to_head(empty_database)
    assert schema_diff(empty_database) == []
    upgrade_to_head(empty_database)  # a second run is a no-op


def test_downgrade_to_base_and_back(empty_database: str) -> None:
    upgrade_to_head(empty_database)
    command.downgrade(alembic_config(empty_database), "base")
    engine = make_engine(empty_database)
    try:
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()
    upgrade_to_head(empty_database)
    assert schema_diff(empty_database) == []


def test_migrations_are_one_linear_history() -> None:
    assert migrations_dir().name == "migrations"
    scripts = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert len(scripts.get_heads()) == 1


def test_the_app_migrates_at_start(empty_database: str, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", database_url=empty_database)
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 200
    assert schema_diff(empty_database) == []


def test_0002_moves_file_blobs_into_the_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0001")
    data = b"an onnx model, as the old file store kept it"
    key = hashlib.sha256(data).hexdigest()
    legacy = tmp_path / "blobs"
    (legacy / key[:2]).mkdir(parents=True)
    (legacy / key[:2] / key).write_bytes(data)
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                text("INSERT INTO tenants (id, name, created_at) VALUES (1, 't', '2026-01-01')")
            )
            connection.execute(
                text(
                    "INSERT INTO models (id, tenant_id, name, sha256, size_bytes, opset, inputs, outputs, "
                    "blob_key, created_at) VALUES ('m', 1, 'm', :k, :n, 17, '[]', '[]', :k, '2026-01-01')"
                ),
                {"k": key, "n": len(data)},
            )
        with pytest.raises(RuntimeError, match="OPFUSE_BLOB_DIR"):
            upgrade_to_head(url, tmp_path / "elsewhere")
        upgrade_to_head(url, legacy)
        with make_session_factory(engine)() as session:
            reader = open_blob(session, make_session_factory(engine), key)
        assert b"".join(reader) == data
    finally:
        engine.dispose()
    assert schema_diff(url) == []
