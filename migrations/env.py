"""Alembic environment: runs migrations on the URL or connection that service.db hands over.

Used programmatically (service.db.upgrade_to_head) and by the alembic CLI with service/alembic.ini
(`OPFUSE_DATABASE_URL` or `-x url=...` gives the database there).
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from service.models import Base

target_metadata = Base.metadata

# Any constant: PostgreSQL advisory lock so replicas starting together migrate one at a time.
_MIGRATION_LOCK_ID = 0x6F70_6675


def _database_url() -> str:
    config = context.config
    url = config.attributes.get("database_url") or context.get_x_argument(as_dictionary=True).get("url")
    url = url or os.environ.get("OPFUSE_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        from service.settings import Settings

        url = Settings().database_url
    return str(url)


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )


def run_migrations_offline() -> None:
    context.configure(
        url=_database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
        return
    from service.db import make_engine

    engine = make_engine(_database_url())
    try:
        with engine.connect() as connection:
            _run_on(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
