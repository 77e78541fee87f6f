"""`alembic upgrade head` on an empty database gives exactly the models' schema (SQLite, PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from service.app import create_app
from service.db import alembic_config, make_engine, migrations_dir, upgrade_to_head
from service.models import Base
from service.settings import Settings

from .conftest import create_postgres_schema, drop_postgres_schema


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
