"""The database schema as SQLAlchemy 2 typed ORM classes: tenants, API keys, blobs, models, jobs and
webhook deliveries.

Works on SQLite and PostgreSQL. Every timestamp is timezone-aware UTC in Python (`UTCDateTime`).
Alembic's migrations (migrations/versions) must produce exactly this schema; a test checks it.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from service.clock import utcnow

# Deterministic constraint names, so migrations name things the same on every database.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Scope(StrEnum):
    USER = "user"
    WORKER = "worker"
    ADMIN = "admin"  # manages its own tenant's keys and webhook secret
    PLATFORM = "platform"  # the operator: keys of any tenant (and worker keys), new tenants


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


class DeliveryStatus(StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class Stage(StrEnum):
    LOADING = "loading"
    PROFILING = "profiling"
    FUSING = "fusing"
    CODEGEN = "codegen"
    TUNING = "tuning"
    VERIFYING = "verifying"
    BENCHMARKING = "benchmarking"
    PACKAGING = "packaging"


ACTIVE_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING)
FINISHED_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED)


def _in(values: type[StrEnum]) -> str:
    return ", ".join(f"'{v.value}'" for v in values)


def new_id() -> str:
    return uuid.uuid4().hex


def is_id(value: str) -> bool:
    """Whether `value` can be a model or job id at all (32 hex digits, what new_id makes). Lookups
    answer 404 for anything else without querying: a client's string may hold bytes (NUL) that
    PostgreSQL refuses in any text comparison."""
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back timezone-aware (SQLite keeps no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTCDateTime column; use service.clock.utcnow()")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime()}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    # Signs the tenant's webhooks (HMAC-SHA256); null: the server's OPFUSE_WEBHOOK_SECRET.
    webhook_secret: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """An API key; only the sha256 of the key is stored, so a leaked database leaks no keys.

    `prefix` is the key's first characters (not enough to use it), so people can tell keys apart;
    `last_used_at` is updated at most once a minute per key; past `expires_at` the key is refused.
    """

    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint(f"scope IN ({_in(Scope)})", name="scope"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    scope: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    prefix: Mapped[str | None] = mapped_column(String(16))
    expires_at: Mapped[datetime | None] = mapped_column()
    last_used_at: Mapped[datetime | None] = mapped_column()
    revoked_at: Mapped[datetime | None] = mapped_column()


class Blob(Base):
    """Bytes stored by their sha256 (content-addressed): an uploaded model or a bundle.

    The bytes are in `blob_chunks`; a model or job row references a blob by foreign key, so a blob
    that something uses cannot be deleted.
    """

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    chunk_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class BlobChunk(Base):
    """One piece of a blob (1–4 MiB), with its own sha256 so a damaged piece is never served."""

    __tablename__ = "blob_chunks"

    blob_sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Model(Base):
    """An uploaded ONNX model (self-contained: external data is inlined); its bytes (sha256 `sha256`)
    are the blob `blob_key`, the tenant's own copy (blobs.scoped_key)."""

    __tablename__ = "models"
    __table_args__ = (
        UniqueConstraint("tenant_id", "sha256"),
        Index(None, "tenant_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    opset: Mapped[int] = mapped_column(Integer)
    inputs: Mapped[list[Any]] = mapped_column(JSON)
    outputs: Mapped[list[Any]] = mapped_column(JSON)
    blob_key: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    """A fusion job: its options, where it is in the queue and the pipeline, its lease, its results."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index(None, "tenant_id", "created_at"),
        Index(None, "status", "created_at"),
        Index(None, "tenant_id", "status"),
        Index(None, "status", "target", "created_at"),
        CheckConstraint(f"status IN ({_in(JobStatus)})", name="status"),
        CheckConstraint(f"stage IS NULL OR stage IN ({_in(Stage)})", name="stage"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    options: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The device kind it runs on (`any`, `cpu`, a GPU kind): a column, so a claim reads no JSON.
    target: Mapped[str] = mapped_column(String(32), default="any", server_default="any")
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED.value)
    stage: Mapped[str | None] = mapped_column(String(16))
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claims so far
    max_attempts: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    webhook_url: Mapped[str | None] = mapped_column(Text)

    # The lease: who runs the job and until when. `lease_epoch` counts claims (a fencing counter);
    # `lease_token` is a fresh secret per claim that every worker write must present.
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_epoch: Mapped[int] = mapped_column(Integer, default=0)
    lease_expires_at: Mapped[datetime | None] = mapped_column()
    worker_id: Mapped[str | None] = mapped_column(String(255))
    worker_device: Mapped[str | None] = mapped_column(String(255))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    report: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    artifact_blob_key: Mapped[str | None] = mapped_column(ForeignKey("blobs.sha256"), index=True)
    artifact_sha256: Mapped[str | None] = mapped_column(String(64))
    artifact_size_bytes: Mapped[int | None] = mapped_column(BigInteger)

    # Summary metrics, copied out of the report so lists need not load it.
    speedup: Mapped[float | None] = mapped_column(Float)
    latency_ms_before: Mapped[float | None] = mapped_column(Float)
    latency_ms_after: Mapped[float | None] = mapped_column(Float)
    kernels_before: Mapped[int | None] = mapped_column(Integer)
    kernels_after: Mapped[int | None] = mapped_column(Integer)
    peak_memory_before: Mapped[int | None] = mapped_column(BigInteger)
    peak_memory_after: Mapped[int | None] = mapped_column(BigInteger)

    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column()
    stage_started_at: Mapped[datetime | None] = mapped_column()  # null: the stage began at started_at
    finished_at: Mapped[datetime | None] = mapped_column()


class WebhookDelivery(Base):
    """The outbox of webhook calls: written in the transaction that ends the job, sent afterwards by
    the API's delivery task, retried with backoff; a restart loses nothing."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index(None, "status", "next_attempt_at"),
        CheckConstraint(f"status IN ({_in(DeliveryStatus)})", name="status"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(Text)
    payload: Mapped[str] = mapped_column(Text)  # the exact JSON body that is signed and sent
    status: Mapped[str] = mapped_column(String(16), default=DeliveryStatus.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column()
