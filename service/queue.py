"""The job queue as workers see it: claim under a lease, heartbeat, upload, complete, fail.

Fencing: every worker write names the lease token it got from its claim; the row is locked and the
token compared before anything changes, so a worker whose lease expired (and whose job may now run
elsewhere) can change nothing. `lease_epoch` counts claims. Expired leases go back to the queue until
`max_attempts` claims were used up.

Every end of a job goes through `finish_job`, which also puts its webhook in the outbox and records
its duration; every change of stage records how long the stage before took.
"""

from __future__ import annotations

import math
import secrets
import threading
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, select, update
from sqlalchemy.orm import Session

from service import webhooks
from service.errors import ConflictError, LeaseLostError, NotFoundError
from service.logging import get_logger
from service.metrics import record_job, record_stage
from service.models import Job, JobStatus, Stage, is_id
from service.storable import scrub
from service.targets import Target, device_kind

log = get_logger("queue")

MAX_ERROR_CHARS = 10_000
_CLAIM_RETRIES = 5


def _end_stage(job: Job, now: datetime) -> None:
    """The current stage is over: record its duration (it began at stage_started_at, or at the
    claim when the worker has not moved on yet)."""
    began = job.stage_started_at or job.started_at
    if job.stage is not None and began is not None:
        record_stage(job.stage, (now - began).total_seconds())
    job.stage_started_at = None


def _release(job: Job, now: datetime) -> None:
    _end_stage(job, now)
    job.lease_expires_at = None
    job.stage = None


def _requeue(job: Job, now: datetime) -> None:
    _release(job, now)
    job.status = JobStatus.QUEUED.value
    job.lease_token = None
    job.worker_id = None
    job.worker_device = None
    job.progress = 0.0


def finish_job(session: Session, job: Job, status: JobStatus, now: datetime, error: str | None) -> None:
    """End the job (succeeded, failed or canceled): its webhook goes to the outbox."""
    _release(job, now)
    job.status = status.value
    job.error = error
    job.finished_at = now
    record_job(status.value, (now - job.created_at).total_seconds())
    webhooks.enqueue(session, job)


def requeue_expired(session: Session, now: datetime) -> list[Job]:
    """Jobs whose lease ran out: back to the queue, or failed once their attempts are used up
    (canceled if the user had asked). Returns the jobs it changed."""
    expired = session.scalars(
        select(Job)
        .where(Job.status == JobStatus.RUNNING.value, Job.lease_expires_at < now)
        .with_for_update(skip_locked=True)
    ).all()
    for job in expired:
        if job.cancel_requested:
            finish_job(session, job, JobStatus.CANCELED, now, None)
        elif job.attempts >= job.max_attempts:
            finish_job(
                session,
                job,
                JobStatus.FAILED,
                now,
                f"lease expired {job.attempts} times; the worker running it stopped heartbeating "
                f"(last worker: {job.worker_id})",
            )
        else:
            _requeue(job, now)
        log.warning(
            "lease expired",
            extra={
                "job_id": job.id,
                "status": job.status,
                "attempts": job.attempts,
                "lease_epoch": job.lease_epoch,
            },
        )
    return list(expired)


def _runs_on(kind: str) -> ColumnElement[bool]:
    """Jobs a worker of this device kind may take: target `any` or exactly its kind (a column of
    its own: reading it out of the options JSON made one job's stored text every claim's problem)."""
    return Job.target.in_((Target.ANY.value, kind))


def claim_job(
    session: Session, worker_id: str, device: str, lease_seconds: float, now: datetime
) -> Job | None:
    """Requeue expired leases, then take the oldest queued job of any tenant that this worker's
    device serves (its target is `any` or the device's kind); None if there is none.

    PostgreSQL: SELECT ... FOR UPDATE SKIP LOCKED, so concurrent claims take different jobs.
    SQLite: a conditional UPDATE ... WHERE status = 'queued' whose rowcount says who won.
    """
    requeue_expired(session, now)
    kind = device_kind(device)
    for _ in range(_CLAIM_RETRIES):
        job_id = session.scalar(
            select(Job.id)
            .where(Job.status == JobStatus.QUEUED.value, _runs_on(kind))
            .order_by(Job.created_at, Job.id)
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        if job_id is None:
            return None
        result = cast(
            CursorResult[Any],
            session.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.QUEUED.value)
                .values(
                    status=JobStatus.RUNNING.value,
                    stage=Stage.LOADING.value,
                    progress=0.0,
                    attempts=Job.attempts + 1,
                    lease_epoch=Job.lease_epoch + 1,
                    lease_token=secrets.token_urlsafe(32),
                    lease_expires_at=now + timedelta(seconds=lease_seconds),
                    worker_id=worker_id,
                    worker_device=device,
                    started_at=now,
                    # A new attempt starts clean: an earlier attempt's upload is not this one's.
                    artifact_blob_key=None,
                    artifact_sha256=None,
                    artifact_size_bytes=None,
                )
                .execution_options(synchronize_session=False)
            ),
        )
        if result.rowcount == 1:
            job = session.get(Job, job_id, populate_existing=True)
            assert job is not None
            log.info(
                "job claimed",
                extra={
                    "job_id": job.id,
                    "worker_id": worker_id,
                    "device_kind": kind,
                    "attempts": job.attempts,
                    "lease_epoch": job.lease_epoch,
                },
            )
            return job
    return None


def _same_token(job: Job, lease_token: str) -> bool:
    # Bytes: compare_digest refuses non-ASCII str, and a token arrives from anywhere.
    current = (job.lease_token or "").encode()
    return bool(current) and secrets.compare_digest(current, lease_token.encode())


def leased_job(session: Session, job_id: str, lease_token: str) -> Job:
    """The running job whose current lease is `lease_token`, locked; else 404 / 409 lease lost."""
    job = session.scalar(select(Job).where(Job.id == job_id).with_for_update()) if is_id(job_id) else None
    if job is None:
        raise NotFoundError(f"no job with id '{job_id}'")
    if job.status != JobStatus.RUNNING or not _same_token(job, lease_token):
        raise LeaseLostError(
            f"job '{job_id}' is not leased to you (anymore): it is {job.status}, at attempt {job.attempts}; "
            "stop working on it"
        )
    return job


def heartbeat(job: Job, stage: Stage | None, progress: float, lease_seconds: float, now: datetime) -> None:
    """Renew the lease; a new stage ends the one before (its duration is recorded)."""
    if stage is not None and stage.value != job.stage:
        _end_stage(job, now)
        job.stage = stage.value
        job.stage_started_at = now
    job.progress = progress
    job.lease_expires_at = now + timedelta(seconds=lease_seconds)


def attach_artifact(job: Job, blob_key: str, size: int) -> None:
    job.artifact_blob_key = blob_key
    job.artifact_sha256 = blob_key
    job.artifact_size_bytes = size


def _at(report: dict[str, Any], *path: str) -> Any:
    value: Any = report
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _int(value: Any) -> int | None:
    number = _float(value)
    return int(number) if number is not None else None


def apply_summary(job: Job, report: dict[str, Any]) -> None:
    """Copy the headline numbers of a report (DESIGN.md §5) into the job's summary columns."""
    job.speedup = _float(report.get("speedup"))
    job.latency_ms_before = _float(_at(report, "before", "latency_ms", "p50"))
    job.latency_ms_after = _float(_at(report, "after", "latency_ms", "p50"))
    job.kernels_before = _int(_at(report, "kernels", "before"))
    job.kernels_after = _int(_at(report, "kernels", "after"))
    job.peak_memory_before = _int(_at(report, "before", "peak_memory_bytes"))
    job.peak_memory_after = _int(_at(report, "after", "peak_memory_bytes"))


def complete_job(
    session: Session, job_id: str, lease_token: str, report: dict[str, Any], now: datetime
) -> Job:
    """Succeed the job with its report; its artifact must have been uploaded under this lease.

    Repeating the call with the same token after it succeeded is harmless (returns the job).
    """
    job = session.scalar(select(Job).where(Job.id == job_id).with_for_update()) if is_id(job_id) else None
    if job is not None and job.status == JobStatus.SUCCEEDED and _same_token(job, lease_token):
        return job
    job = leased_job(session, job_id, lease_token)
    if job.artifact_sha256 is None:
        raise ConflictError(
            f"job '{job_id}' has no artifact from this attempt: upload the bundle with "
            f"PUT /v1/worker/jobs/{job_id}/artifact first, then complete the job"
        )
    job.report = report
    apply_summary(job, report)
    job.progress = 1.0
    finish_job(session, job, JobStatus.SUCCEEDED, now, None)
    log.info("job succeeded", extra={"job_id": job.id, "speedup": job.speedup})
    return job


def fail_job(session: Session, job: Job, error: str, retryable: bool, now: datetime) -> None:
    """Canceled if the user asked; requeued if retryable and attempts are left; failed otherwise."""
    error = error[:MAX_ERROR_CHARS]
    if job.cancel_requested:
        finish_job(session, job, JobStatus.CANCELED, now, None)
    elif retryable and job.attempts < job.max_attempts:
        _requeue(job, now)
        job.error = f"attempt {job.attempts} failed (will retry): {error}"
    elif retryable:
        finish_job(session, job, JobStatus.FAILED, now, f"{error} (gave up after {job.attempts} attempts)")
    else:
        finish_job(session, job, JobStatus.FAILED, now, error)
    log.info("job failed", extra={"job_id": job.id, "status": job.status, "retryable": retryable})


def fail_undispatchable(session: Session, job: Job, exc: Exception, now: datetime) -> None:
    """A claimed job that cannot be handed to a worker (its stored rows do not describe a job)
    fails with the reason, so the queue moves on instead of offering it to every claim."""
    finish_job(
        session,
        job,
        JobStatus.FAILED,
        now,
        f"the job could not be handed to a worker ({type(exc).__name__}: {scrub(str(exc))[:500]}); "
        "upload the model again and submit a new job",
    )
    log.error("job could not be dispatched", extra={"job_id": job.id, "error": repr(exc)[:500]})


class ClaimHealth:
    """Whether claims are working, for /readyz: unready while the latest claim failed (within
    `window_seconds`; an old failure with no claim since says nothing about now)."""

    def __init__(self, window_seconds: float = 300.0) -> None:
        self.window_seconds = window_seconds
        self._failed_at: datetime | None = None
        self._error = ""
        self._lock = threading.Lock()

    def succeeded(self) -> None:
        with self._lock:
            self._failed_at = None

    def failed(self, exc: BaseException, now: datetime) -> None:
        with self._lock:
            self._failed_at = now
            self._error = f"{type(exc).__name__}: {scrub(str(exc))[:200]}"

    def problem(self, now: datetime) -> str | None:
        """Why claims are failing, or None."""
        with self._lock:
            if self._failed_at is None or (now - self._failed_at).total_seconds() > self.window_seconds:
                return None
            return f"worker claims are failing ({self._error})"
