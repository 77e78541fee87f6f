"""The service's configuration: one pydantic-settings class read from `OPFUSE_*` environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GiB = 1024**3


def _sqlite_url(home: Path) -> str:
    return f"sqlite:///{home / 'opfuse.db'}"


class Settings(BaseSettings):
    """Everything the API server needs to know; every field is `OPFUSE_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="OPFUSE_", extra="ignore")

    home: Path = Path("./.opfuse")
    # Defaults under `home` (validated first, so `data["home"]` is absolute already).
    database_url: str = Field(default_factory=lambda data: _sqlite_url(data["home"]))
    blob_dir: Path = Field(default_factory=lambda data: data["home"] / "blobs")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_upload_bytes: int = Field(default=GiB, gt=0)
    max_artifact_bytes: int = Field(default=4 * GiB, gt=0)
    lease_seconds: float = Field(default=60.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    requeue_interval_seconds: float = Field(default=5.0, gt=0)
    blob_gc_interval_seconds: float = Field(default=600.0, gt=0)
    blob_gc_grace_seconds: float = Field(default=3600.0, ge=0)
    log_level: str = "INFO"

    @field_validator("home", "blob_dir")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        return path.expanduser().absolute()

    @model_validator(mode="after")
    def _empty_url_means_default(self) -> Settings:
        if not self.database_url:
            self.database_url = _sqlite_url(self.home)
        return self
