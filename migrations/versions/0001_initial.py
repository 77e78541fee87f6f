"""Initial schema: tenants, api_keys, models, jobs.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of what the models declared at this revision; migrations never import app code.
SCOPES = "'user', 'worker', 'admin'"
STATUSES = "'queued', 'running', 'succeeded', 'failed', 'canceled'"
STAGES = "'loading', 'profiling', 'fusing', 'codegen', 'tuning', 'verifying', 'benchmarking', 'packaging'"


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("revoked", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.CheckConstraint(f"scope IN ({SCOPES})", name=op.f("ck_api_keys_scope")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])

    op.create_table(
        "models",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("opset", sa.Integer(), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("outputs", sa.JSON(), nullable=False),
        sa.Column("blob_key", sa.String(length=64), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_models_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint("tenant_id", "sha256", name=op.f("uq_models_tenant_id_sha256")),
    )
    op.create_index(op.f("ix_models_tenant_id_created_at"), "models", ["tenant_id", "created_at"])

    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.String(length=32), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("stage", sa.String(length=16), nullable=True),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("webhook_url", sa.Text(), nullable=True),
        sa.Column("lease_token", sa.String(length=64), nullable=True),
        sa.Column("lease_epoch", sa.Integer(), nullable=False),
        sa.Column("lease_expires_at", _utc(), nullable=True),
        sa.Column("worker_id", sa.String(length=255), nullable=True),
        sa.Column("worker_device", sa.String(length=255), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.Column("artifact_blob_key", sa.String(length=64), nullable=True),
        sa.Column("artifact_sha256", sa.String(length=64), nullable=True),
        sa.Column("artifact_size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("speedup", sa.Float(), nullable=True),
        sa.Column("latency_ms_before", sa.Float(), nullable=True),
        sa.Column("latency_ms_after", sa.Float(), nullable=True),
        sa.Column("kernels_before", sa.Integer(), nullable=True),
        sa.Column("kernels_after", sa.Integer(), nullable=True),
        sa.Column("peak_memory_before", sa.BigInteger(), nullable=True),
        sa.Column("peak_memory_after", sa.BigInteger(), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("started_at", _utc(), nullable=True),
        sa.Column("finished_at", _utc(), nullable=True),
        sa.CheckConstraint(f"status IN ({STATUSES})", name=op.f("ck_jobs_status")),
        sa.CheckConstraint(f"stage IS NULL OR stage IN ({STAGES})", name=op.f("ck_jobs_stage")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_jobs_model_id_models"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_jobs_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("tenant_id", "idempotency_key", name=op.f("uq_jobs_tenant_id_idempotency_key")),
    )
    op.create_index(op.f("ix_jobs_model_id"), "jobs", ["model_id"])
    op.create_index(op.f("ix_jobs_status_created_at"), "jobs", ["status", "created_at"])
    op.create_index(op.f("ix_jobs_tenant_id_created_at"), "jobs", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_table("jobs")
    op.drop_table("models")
    op.drop_table("api_keys")
    op.drop_table("tenants")
