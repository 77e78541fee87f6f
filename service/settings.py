"""The service's configuration: one pydantic-settings class read from `OPFUSE_*` environment variables."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def _sqlite_url(home: Path) -> str:
    return f"sqlite:///{home / 'opfuse.db'}"


class Settings(BaseSettings):
    """Everything the API server needs to know; every field is `OPFUSE_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="OPFUSE_", extra="ignore")

    home: Path = Path("./.opfuse")
    # Defaults under `home` (validated first, so `data["home"]` is absolute already).
    database_url: str = Field(default_factory=lambda data: _sqlite_url(data["home"]))
    # Uploads are spooled here while they stream in and are checked (then stored in the database).
    tmp_dir: Path = Field(default_factory=lambda data: data["home"] / "tmp")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: str = "INFO"

    # Blobs (models, bundles) live in the database in chunks of this size.
    blob_chunk_bytes: int = Field(default=MiB, ge=KiB, le=4 * MiB)
    blob_gc_interval_seconds: float = Field(default=600.0, gt=0)

    # Queue.
    lease_seconds: float = Field(default=60.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    requeue_interval_seconds: float = Field(default=5.0, gt=0)

    # Limits on requests.
    # A model upload, counted unpacked: a zip's entries as they will be once decompressed.
    max_upload_bytes: int = Field(default=GiB, gt=0)
    # How much smaller than its content a zip entry may be (weights barely compress; a bomb does).
    max_zip_ratio: float = Field(default=100.0, ge=1.0)
    max_artifact_bytes: int = Field(default=4 * GiB, gt=0)
    max_json_bytes: int = Field(default=MiB, gt=0)
    # The worker's POST /v1/worker/jobs/{id}/complete carries the report (worker keys only).
    max_report_bytes: int = Field(default=16 * MiB, gt=0)
    request_timeout_seconds: float = Field(default=600.0, gt=0)
    # How long a request body may go without a byte arriving (408).
    body_idle_timeout_seconds: float = Field(default=30.0, gt=0)
    # Connections: the request line and headers must arrive within this (408), an idle keep-alive
    # connection is closed after this, and one client address may hold this many at once (0: any).
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    keep_alive_seconds: float = Field(default=5.0, gt=0)
    max_connections_per_client: int = Field(default=64, ge=0)
    rate_limit_per_min: int = Field(default=1200, ge=0)  # per API key (not worker keys); 0: no limit
    auth_failures_per_min: int = Field(default=20, ge=0)  # wrong keys per client address; 0: no limit
    max_queued_jobs_per_tenant: int = Field(default=1000, ge=0)  # 0: no limit
    # What one tenant may keep: bytes of models and bundles, and models. 0: no limit.
    tenant_storage_bytes: int = Field(default=100 * GiB, ge=0)
    tenant_max_models: int = Field(default=1000, ge=0)

    # Limits on uploaded models.
    max_graph_nodes: int = Field(default=50_000, ge=1)
    max_graph_depth: int = Field(default=10_000, ge=1)
    max_input_elements: int = Field(default=2**31, ge=1)
    # Bytes of uploaded models parsed and checked at once (a check holds ~3.5x the model).
    check_budget_bytes: int = Field(default=32 * MiB, ge=MiB)

    # Bundles are signed with a key derived per tenant from this one (service/signing.py); unset:
    # a key made on first start and kept in `home`/signing.key (0600).
    signing_key: SecretStr | None = Field(default=None, min_length=32)

    # Webhooks.
    webhook_secret: SecretStr | None = None
    webhook_allow_private: bool = False
    webhook_max_attempts: int = Field(default=6, ge=1)
    webhook_backoff_seconds: float = Field(default=2.0, ge=0)
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    webhook_interval_seconds: float = Field(default=1.0, gt=0)
    # Deliveries in flight at once: per tenant (one tenant's slow receivers hold only its own), in all.
    webhook_tenant_concurrency: int = Field(default=4, ge=1)
    webhook_max_in_flight: int = Field(default=64, ge=1)

    @property
    def legacy_blob_dir(self) -> Path:
        """Where servers before migration 0002 kept blobs as files (OPFUSE_BLOB_DIR)."""
        configured = os.environ.get("OPFUSE_BLOB_DIR")
        return Path(configured).expanduser().absolute() if configured else self.home / "blobs"

    @field_validator("home", "tmp_dir")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        return path.expanduser().absolute()

    @model_validator(mode="after")
    def _empty_means_default(self) -> Settings:
        if not self.database_url:
            self.database_url = _sqlite_url(self.home)
        if self.webhook_secret is not None and not self.webhook_secret.get_secret_value():
            self.webhook_secret = None
        return self
