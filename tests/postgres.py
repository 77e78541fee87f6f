"""Throw-away PostgreSQL databases and schemas for the service and reliability suites.

OPFUSE_TEST_POSTGRES_URL names the server; with OPFUSE_REQUIRE_POSTGRES=1 (what .ci/run sets) an
unset or unreachable server fails the PostgreSQL tests instead of skipping them.
"""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

POSTGRES_URL = os.environ.get("OPFUSE_TEST_POSTGRES_URL", "")
REQUIRE_POSTGRES = os.environ.get("OPFUSE_REQUIRE_POSTGRES") == "1"


def postgres_unavailable(reason: str) -> None:
    if REQUIRE_POSTGRES:
        pytest.fail(f"OPFUSE_REQUIRE_POSTGRES=1 but {reason}")
    pytest.skip(reason)


def reachable_postgres() -> str:
    """The server URL, once it answers; skips (or fails, when required) otherwise."""
    if not POSTGRES_URL:
        postgres_unavailable("OPFUSE_TEST_POSTGRES_URL is not set")
    engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:
        postgres_unavailable(
            f"PostgreSQL at {make_url(POSTGRES_URL).render_as_string()} is unreachable: {exc}"
        )
    finally:
        engine.dispose()
    return POSTGRES_URL


def create_postgres_database(server_url: str, prefix: str = "opfuse_test") -> str:
    """A new, uniquely named, empty database on the server of `server_url`; returns its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(server_url: str, database_url: str) -> None:
    name = make_url(database_url).database
    engine = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


def create_postgres_schema(server_url: str) -> str:
    """A new, uniquely named, empty schema; the returned URL makes it the only one on the search path
    (cheaper than a database, for tests that need an empty one)."""
    name = f"opfuse_test_{uuid.uuid4().hex[:12]}"
    engine = create_engine(server_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(f'CREATE SCHEMA "{name}"'))
    finally:
        engine.dispose()
    url = make_url(server_url).update_query_dict({"options": f"-csearch_path={name}"})
    return url.render_as_string(hide_password=False)


def drop_postgres_schema(server_url: str, schema_url: str) -> None:
    name = str(make_url(schema_url).query["options"]).removeprefix("-csearch_path=")
    engine = create_engine(server_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
    finally:
        engine.dispose()
