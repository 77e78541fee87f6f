"""Blobs in the database, webhook outbox, per-tenant webhook secrets, the clock of a job's stage.

Moves the bytes of an existing file blob store (OPFUSE_BLOB_DIR, default $OPFUSE_HOME/blobs) into
`blob_chunks` first, so the new foreign keys from models and jobs hold.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-07
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from alembic import context, op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of what the models declared at this revision; migrations never import app code.
DELIVERY_STATUSES = "'pending', 'delivered', 'failed'"
CHUNK_BYTES = 1024**2


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def _legacy_blob_dir() -> Path:
    configured = context.config.attributes.get("legacy_blob_dir") or os.environ.get("OPFUSE_BLOB_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("OPFUSE_HOME") or "./.opfuse").expanduser() / "blobs"


def _import_file_blobs(connection: sa.Connection) -> None:
    """Copy every blob a row references from the old file store into the new tables."""
    keys = set(connection.scalars(sa.text("SELECT blob_key FROM models")))
    keys |= set(
        connection.scalars(sa.text("SELECT artifact_blob_key FROM jobs WHERE artifact_blob_key IS NOT NULL"))
    )
    if not keys:
        return
    blobs = sa.table(
        "blobs",
        sa.column("sha256", sa.String),
        sa.column("size_bytes", sa.BigInteger),
        sa.column("chunk_count", sa.Integer),
        sa.column("created_at", _utc()),
    )
    chunks = sa.table(
        "blob_chunks",
        sa.column("blob_sha256", sa.String),
        sa.column("seq", sa.Integer),
        sa.column("sha256", sa.String),
        sa.column("data", sa.LargeBinary),
    )
    root = _legacy_blob_dir()
    for key in sorted(keys):
        path = root / key[:2] / key
        if not path.is_file():
            raise RuntimeError(
                f"blob {key} is referenced by the database but {path} does not exist; set OPFUSE_BLOB_DIR "
                "to the old blob directory and migrate again"
            )
        size = path.stat().st_size
        connection.execute(
            blobs.insert().values(
                sha256=key, size_bytes=size, chunk_count=-(-size // CHUNK_BYTES), created_at=datetime.now(UTC)
            )
        )
        whole = hashlib.sha256()
        with path.open("rb") as f:
            for seq, chunk in enumerate(iter(lambda: f.read(CHUNK_BYTES), b"")):
                whole.update(chunk)
                connection.execute(
                    chunks.insert().values(
                        blob_sha256=key, seq=seq, sha256=hashlib.sha256(chunk).hexdigest(), data=chunk
                    )
                )
        if whole.hexdigest() != key:
            raise RuntimeError(f"{path} does not hash to its name; the old blob store is damaged")


def upgrade() -> None:
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("chunk_count", sa.Integer(), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_blobs")),
    )
    op.create_table(
        "blob_chunks",
        sa.Column("blob_sha256", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["blob_sha256"],
            ["blobs.sha256"],
            name=op.f("fk_blob_chunks_blob_sha256_blobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("blob_sha256", "seq", name=op.f("pk_blob_chunks")),
    )
    _import_file_blobs(op.get_bind())

    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("webhook_secret", sa.String(length=128), nullable=True))
    with op.batch_alter_table("models") as batch:
        batch.create_index(batch.f("ix_models_blob_key"), ["blob_key"])
        batch.create_foreign_key(batch.f("fk_models_blob_key_blobs"), "blobs", ["blob_key"], ["sha256"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("stage_started_at", _utc(), nullable=True))
        batch.create_index(batch.f("ix_jobs_artifact_blob_key"), ["artifact_blob_key"])
        batch.create_index(batch.f("ix_jobs_tenant_id_status"), ["tenant_id", "status"])
        batch.create_foreign_key(
            batch.f("fk_jobs_artifact_blob_key_blobs"), "blobs", ["artifact_blob_key"], ["sha256"]
        )

    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", _utc(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("delivered_at", _utc(), nullable=True),
        sa.CheckConstraint(f"status IN ({DELIVERY_STATUSES})", name=op.f("ck_webhook_deliveries_status")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_webhook_deliveries_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_webhook_deliveries_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(op.f("ix_webhook_deliveries_job_id"), "webhook_deliveries", ["job_id"])
    op.create_index(
        op.f("ix_webhook_deliveries_status_next_attempt_at"),
        "webhook_deliveries",
        ["status", "next_attempt_at"],
    )


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(batch.f("fk_jobs_artifact_blob_key_blobs"), type_="foreignkey")
        batch.drop_index(batch.f("ix_jobs_tenant_id_status"))
        batch.drop_index(batch.f("ix_jobs_artifact_blob_key"))
        batch.drop_column("stage_started_at")
    with op.batch_alter_table("models") as batch:
        batch.drop_constraint(batch.f("fk_models_blob_key_blobs"), type_="foreignkey")
        batch.drop_index(batch.f("ix_models_blob_key"))
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("webhook_secret")
    # The bytes go with the tables: export them first if you need the file store back.
    op.drop_table("blob_chunks")
    op.drop_table("blobs")
