"""Request and response bodies of the REST API v1 (DESIGN.md §3), as pydantic models."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AnyHttpUrl, AwareDatetime, BaseModel, ConfigDict, Field, StrictInt, field_validator

from opfuse.frontend.rule_registry import check_disable
from service.models import Job, JobStatus, Model, Scope, Stage
from service.storable import StorableStr, scrub, storable_json
from service.targets import Target

Precision = Literal["fp32", "tf32", "fp16", "bf16"]
TENANT_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
ItemT = TypeVar("ItemT")


class Page(BaseModel, Generic[ItemT]):
    items: list[ItemT]
    next_cursor: str | None = Field(description="pass as `cursor` to get the next page; null on the last")


# -- models -------------------------------------------------------------------------------------


class TensorSpec(BaseModel):
    name: str
    dtype: str
    shape: list[int | str] = Field(description='a dynamic dim is its symbol, e.g. "batch"; unnamed is "?"')


class ModelOut(BaseModel):
    id: str
    name: str
    sha256: str
    size_bytes: int
    opset: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    created_at: datetime

    @classmethod
    def from_row(cls, model: Model) -> ModelOut:
        return cls(
            id=model.id,
            name=model.name,
            sha256=model.sha256,
            size_bytes=model.size_bytes,
            opset=model.opset,
            inputs=[TensorSpec(**t) for t in model.inputs],
            outputs=[TensorSpec(**t) for t in model.outputs],
            created_at=model.created_at,
        )


# -- jobs ---------------------------------------------------------------------------------------


class FusionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    disable: list[Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.-]+$")]] = Field(
        default_factory=list, description="names of fusion rules not to apply"
    )

    @field_validator("disable")
    @classmethod
    def _known_rules(cls, names: list[str]) -> list[str]:
        check_disable(names)  # the compiler's own list: a misspelt name is a 422, not a failed job
        return names


class VerifyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rtol: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    atol: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str
    input_shapes: dict[StorableStr, list[Annotated[StrictInt, Field(gt=0)]]] = Field(
        default_factory=dict, description="a value for every dim of every input that is not fully static"
    )
    precision: Precision = "fp32"
    fusion: FusionOptions = Field(default_factory=FusionOptions)
    verify: VerifyOptions = Field(default_factory=VerifyOptions)
    webhook_url: AnyHttpUrl | None = None
    target: Target = Field(
        default=Target.ANY,
        description="the device kind to run on: `any`, `cpu` or a GPU kind such as `h200` (service.targets)",
    )

    def options(self) -> dict[str, Any]:
        """What the worker needs to run the job (stored as the job's `options`)."""
        return {
            "input_shapes": self.input_shapes,
            "precision": self.precision,
            "fusion": self.fusion.model_dump(),
            "verify": self.verify.model_dump(),
            "target": self.target.value,
        }


class JobSummary(BaseModel):
    speedup: float | None
    latency_ms_before: float | None
    latency_ms_after: float | None
    kernels_before: int | None
    kernels_after: int | None
    peak_memory_before: int | None
    peak_memory_after: int | None


class JobOut(BaseModel):
    id: str
    model_id: str
    status: JobStatus
    stage: Stage | None
    progress: float
    attempts: int
    max_attempts: int
    error: str | None
    cancel_requested: bool
    options: dict[str, Any]
    webhook_url: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    summary: JobSummary | None = Field(description="set once the job succeeded")

    @classmethod
    def from_row(cls, job: Job) -> JobOut:
        summary = None
        if job.status == JobStatus.SUCCEEDED:
            summary = JobSummary(
                speedup=job.speedup,
                latency_ms_before=job.latency_ms_before,
                latency_ms_after=job.latency_ms_after,
                kernels_before=job.kernels_before,
                kernels_after=job.kernels_after,
                peak_memory_before=job.peak_memory_before,
                peak_memory_after=job.peak_memory_after,
            )
        return cls(
            id=job.id,
            model_id=job.model_id,
            status=JobStatus(job.status),
            stage=Stage(job.stage) if job.stage else None,
            progress=job.progress,
            attempts=job.attempts,
            max_attempts=job.max_attempts,
            error=job.error,
            cancel_requested=job.cancel_requested,
            options=job.options,
            webhook_url=job.webhook_url,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            summary=summary,
        )


# -- admin --------------------------------------------------------------------------------------


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str | None = Field(
        default=None,
        pattern=TENANT_PATTERN,
        description="default: the caller's tenant; another tenant (created if new) needs a platform key",
    )
    scope: Scope = Scope.USER
    expires_at: AwareDatetime | None = Field(default=None, description="refused from then on; null: never")


class ApiKeyOut(BaseModel):
    """A key just made: the key itself is in this response only."""

    id: int
    key: str = Field(description="shown once; only its hash is stored")
    prefix: str = Field(description="the key's first characters, shown in lists to recognise it")
    tenant: str
    scope: Scope
    created_at: datetime
    expires_at: datetime | None


class ApiKeyInfo(BaseModel):
    """A key as listed: never the key itself."""

    id: int
    prefix: str | None = Field(description="the key's first characters; null for keys made before prefixes")
    tenant: str
    scope: Scope
    created_at: datetime
    last_used_at: datetime | None = Field(description="to the minute: written at most once a minute")
    expires_at: datetime | None
    revoked: bool
    revoked_at: datetime | None


class WebhookSecretOut(BaseModel):
    tenant: str
    webhook_secret: str = Field(description="verify X-Opfuse-Signature (HMAC-SHA256 of the body) with it")


# -- worker protocol ----------------------------------------------------------------------------


class ClaimRequest(BaseModel):
    worker_id: StorableStr = Field(min_length=1, max_length=255)
    device: StorableStr = Field(min_length=1, max_length=255)


class ClaimOut(BaseModel):
    job: JobOut
    lease_token: str = Field(description="send with every write for this job; stale tokens get 409")
    lease_epoch: int = Field(description="how many times the job has been claimed (fencing counter)")
    lease_expires_at: datetime
    model: ModelOut


class HeartbeatRequest(BaseModel):
    lease_token: str
    stage: Stage | None = None
    progress: float = Field(default=0.0, ge=0.0, le=1.0)


class HeartbeatOut(BaseModel):
    cancel: bool = Field(description="the user canceled the job: stop at the next stage boundary and fail")
    lease_expires_at: datetime


class CompleteRequest(BaseModel):
    lease_token: str
    report: dict[str, Any]

    @field_validator("report")
    @classmethod
    def _report_is_json(cls, report: dict[str, Any]) -> dict[str, Any]:
        """What the database can hold: NaN/±inf as null, NUL and lone surrogates replaced (node
        names of a model end up in its report), at most 64 levels deep."""
        result: dict[str, Any] = storable_json(report)
        return result


class FailRequest(BaseModel):
    lease_token: str
    error: str = Field(min_length=1)
    retryable: bool = False

    @field_validator("error", mode="before")
    @classmethod
    def _error_is_text(cls, error: Any) -> Any:
        """Scrubbed, never refused: a job whose failure could not be recorded would stay running
        until its lease expired."""
        return scrub(error) if isinstance(error, str) else error


class ArtifactOut(BaseModel):
    sha256: str
    size_bytes: int
