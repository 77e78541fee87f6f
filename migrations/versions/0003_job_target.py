"""The device kind a job runs on as a column of its own, so a claim reads no JSON.

Claims used to filter on `options ->> 'target'`; PostgreSQL must de-escape the whole stored JSON
text to answer that, and one job whose options held `\\u0000` made every claim fail. The options
are copied into the column in Python, which reads any stored JSON.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BATCH = 500


def _target_of(options: Any) -> str:
    if isinstance(options, str | bytes):
        try:
            options = json.loads(options)
        except ValueError:
            return "any"
    target = options.get("target") if isinstance(options, dict) else None
    return target if isinstance(target, str) and target else "any"


def _copy_targets(connection: sa.Connection) -> None:
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("target", sa.String))
    # The options as text: no JSON function of the database is asked to read them.
    rows = connection.execute(sa.text("SELECT id, CAST(options AS TEXT) FROM jobs")).all()
    for start in range(0, len(rows), _BATCH):
        for job_id, options in rows[start : start + _BATCH]:
            target = _target_of(options)
            if target != "any":
                connection.execute(jobs.update().where(jobs.c.id == job_id).values(target=target[:32]))


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("target", sa.String(length=32), nullable=False, server_default="any"))
    _copy_targets(op.get_bind())
    with op.batch_alter_table("jobs") as batch:
        batch.create_index(batch.f("ix_jobs_status_target_created_at"), ["status", "target", "created_at"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index(batch.f("ix_jobs_status_target_created_at"))
        batch.drop_column("target")
