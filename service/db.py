"""Engines, sessions and migrations for SQLite and PostgreSQL.

A request runs in one transaction (see `service.api.deps.get_session`); nothing here commits on a
caller's behalf. SQLite is made to behave: real BEGIN (IMMEDIATE, so writers queue instead of failing
to upgrade a read lock), WAL, foreign keys on.
"""

from __future__ import annotations

import importlib.util
import sqlite3
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.orm import Session, sessionmaker

from service.file_modes import private_dir, private_sqlite_file


def is_sqlite(database_url: str) -> bool:
    return make_url(database_url).get_backend_name() == "sqlite"


def make_engine(database_url: str) -> Engine:
    """An engine for `database_url`; for a SQLite file, its directory is created (0700) and the file
    is its owner's only (0600)."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
        parent = Path(url.database).parent
        if not parent.exists():
            private_dir(parent)  # made by us: ours only (an existing folder is left as it is)
        private_sqlite_file(database_url)  # the file (webhook secrets) and its -wal/-shm: 0600
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
    # Let SQLAlchemy, not the sqlite3 module, decide where transactions begin (savepoints work then).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: objects stay readable after the request's commit, for the response.
    return sessionmaker(bind=engine, expire_on_commit=False)


def ping(engine: Engine) -> None:
    """Raise if the database cannot answer `SELECT 1`."""
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))


def migrations_dir() -> Path:
    # Found, not imported: migrations/env.py imports service.models, and the two must not import
    # each other in a circle (tests/unit/test_layering.py).
    spec = importlib.util.find_spec("migrations")
    assert spec is not None and spec.origin is not None, "the migrations package is not installed"
    return Path(spec.origin).resolve().parent


def alembic_config(database_url: str) -> Config:
    """Alembic's configuration without an ini file: script_location is the installed `migrations`."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # Passed as an attribute, not an ini option: a '%' in a password would break ini interpolation.
    config.attributes["database_url"] = database_url
    return config


def upgrade_to_head(database_url: str, legacy_blob_dir: Path | None = None) -> None:
    """`alembic upgrade head` on `database_url` (creates a SQLite file's directory first).

    `legacy_blob_dir`: where a server from before blobs moved into the database kept them
    (default: OPFUSE_BLOB_DIR, else $OPFUSE_HOME/blobs); migration 0002 copies them in.
    """
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            config = alembic_config(database_url)
            config.attributes["connection"] = connection
            if legacy_blob_dir is not None:
                config.attributes["legacy_blob_dir"] = str(legacy_blob_dir)
            command.upgrade(config, "head")
    finally:
        engine.dispose()
