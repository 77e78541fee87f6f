"""/v1/worker: the worker protocol (scope `worker`; fleet-wide, jobs of every tenant).

claim → (model download) → heartbeat … → artifact upload → complete | fail. Every call about a job
carries the lease token from the claim; a stale token gets 409 and changes nothing.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service import queue
from service.api.deps import MetricsDep, SessionDep, SessionFactoryDep, SettingsDep, WorkerDep
from service.api.files import blob_response
from service.artifact_check import artifact_problem, refusal
from service.blobs import store_blob
from service.check_budget import CheckBudget
from service.clock import utcnow
from service.errors import UnprocessableError
from service.logging import bind_log_fields, get_logger
from service.metrics import Metrics
from service.model_zip import ZIP_MAGIC
from service.models import Job, Model
from service.schemas import (
    ArtifactOut,
    ClaimOut,
    ClaimRequest,
    CompleteRequest,
    FailRequest,
    HeartbeatOut,
    HeartbeatRequest,
    JobOut,
    ModelOut,
)
from service.settings import Settings
from service.spool import UploadSpool
from service.uploads import receive_body, require_content_type

router = APIRouter(prefix="/v1/worker", tags=["worker"])
log = get_logger("worker_api")

LeaseToken = Annotated[str, Header(alias="Lease-Token", min_length=1, description="the token from the claim")]


def _seen(metrics: Metrics, job: Job) -> None:
    """Log lines of this request carry the worker's id; /metrics has when it was last heard from."""
    bind_log_fields(worker_id=job.worker_id)
    if job.worker_id:
        metrics.workers.seen(job.worker_id)


# Claimed jobs that fail to dispatch, one after another, before a claim answers 204.
MAX_UNDISPATCHABLE_PER_CLAIM = 10


@router.post("/claim", response_model=ClaimOut, responses={204: {"description": "nothing queued"}})
def claim(
    body: ClaimRequest,
    request: Request,
    _worker: WorkerDep,
    session: SessionDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> Response | ClaimOut:
    """Take the oldest queued job this worker's device serves (target `any` or the device's kind,
    service.targets.device_kind) under a lease, requeueing expired leases first; 204 if none.

    A job that cannot be handed out fails with the reason and the next one is taken; a claim that
    fails altogether makes /readyz unready until one succeeds."""
    bind_log_fields(worker_id=body.worker_id)
    metrics.workers.seen(body.worker_id)
    health: queue.ClaimHealth = request.app.state.claim_health
    try:
        out = _claim_next(session, body, settings.lease_seconds)
    except Exception as exc:
        health.failed(exc, utcnow())
        raise
    health.succeeded()
    return Response(status_code=204) if out is None else out


def _claim_next(session: Session, body: ClaimRequest, lease_seconds: float) -> ClaimOut | None:
    for _ in range(MAX_UNDISPATCHABLE_PER_CLAIM):
        job = queue.claim_job(session, body.worker_id, body.device, lease_seconds, utcnow())
        if job is None:
            return None
        try:
            with session.begin_nested():
                return _claim_out(session, job)
        except Exception as exc:
            queue.fail_undispatchable(session, job, exc, utcnow())
    return None


def _claim_out(session: Session, job: Job) -> ClaimOut:
    bind_log_fields(job_id=job.id)
    model = session.get(Model, job.model_id)
    if model is None or job.lease_token is None or job.lease_expires_at is None:
        raise RuntimeError("the job's model or lease is missing")
    return ClaimOut(
        job=JobOut.from_row(job),
        lease_token=job.lease_token,
        lease_epoch=job.lease_epoch,
        lease_expires_at=job.lease_expires_at,
        model=ModelOut.from_row(model),
    )


@router.get("/jobs/{job_id}/model", response_class=Response)
def get_model(
    job_id: str,
    request: Request,
    lease_token: LeaseToken,
    _worker: WorkerDep,
    session: SessionDep,
    session_factory: SessionFactoryDep,
    metrics: MetricsDep,
) -> Response:
    """The job's model bytes, streamed; ETag is their sha256."""
    job = queue.leased_job(session, job_id, lease_token)
    _seen(metrics, job)
    model = session.get(Model, job.model_id)
    assert model is not None
    return blob_response(
        request, session, session_factory, model.blob_key, "application/octet-stream", f"{model.id}.onnx"
    )


@router.post("/jobs/{job_id}/heartbeat")
def heartbeat(
    job_id: str,
    body: HeartbeatRequest,
    _worker: WorkerDep,
    session: SessionDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> HeartbeatOut:
    """Renew the lease and report progress; `cancel: true` means the user canceled the job."""
    job = queue.leased_job(session, job_id, body.lease_token)
    _seen(metrics, job)
    queue.heartbeat(job, body.stage, body.progress, settings.lease_seconds, utcnow())
    assert job.lease_expires_at is not None
    return HeartbeatOut(cancel=job.cancel_requested, lease_expires_at=job.lease_expires_at)


def _check_lease(session_factory: sessionmaker[Session], job_id: str, lease_token: str) -> None:
    with session_factory() as session:
        queue.leased_job(session, job_id, lease_token)


def _store_artifact(
    session: Session,
    job_id: str,
    lease_token: str,
    spool: UploadSpool,
    settings: Settings,
    budget: CheckBudget,
) -> ArtifactOut:
    if not spool.head.startswith(ZIP_MAGIC):
        raise UnprocessableError(
            "the artifact is not a zip file: upload the bundle (a .opfuse.zip) as produced"
        )
    job = queue.leased_job(session, job_id, lease_token)  # the lease may have been lost during the upload
    bind_log_fields(worker_id=job.worker_id)
    # Checked as opfuse.load checks it: a bundle carrying code opfuse did not generate fails its job.
    problem = artifact_problem(spool.path, spool.size, settings.max_artifact_bytes, budget)
    if problem is not None:
        log.warning("artifact refused", extra={"job_id": job.id, "worker_id": job.worker_id})
        queue.fail_job(session, job, refusal(problem), False, utcnow())
        session.commit()  # the job's failure stays; the 422 below rolls back nothing else
        raise UnprocessableError(f"the bundle was refused: {problem}")
    chunk_bytes = settings.blob_chunk_bytes
    queue.attach_artifact(job, store_blob(session, spool, chunk_bytes), spool.size)
    return ArtifactOut(sha256=spool.sha256, size_bytes=spool.size)


@router.put(
    "/jobs/{job_id}/artifact",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload_artifact(
    job_id: str,
    request: Request,
    lease_token: LeaseToken,
    _worker: WorkerDep,
    session: SessionDep,
    session_factory: SessionFactoryDep,
    settings: SettingsDep,
) -> ArtifactOut:
    """The bundle (zip), streamed; kept only if the lease is still current when it has arrived."""
    require_content_type(request, "application/zip", "application/octet-stream")
    await run_in_threadpool(
        _check_lease, session_factory, job_id, lease_token
    )  # refuse early, before the bytes
    with UploadSpool(settings.tmp_dir) as spool:
        await receive_body(
            request, spool, settings.max_artifact_bytes, "artifact", "OPFUSE_MAX_ARTIFACT_BYTES"
        )
        return await run_in_threadpool(
            _store_artifact,
            session,
            job_id,
            lease_token,
            spool,
            settings,
            request.app.state.check_budget,
        )


@router.post("/jobs/{job_id}/complete")
def complete(
    job_id: str, body: CompleteRequest, _worker: WorkerDep, session: SessionDep, metrics: MetricsDep
) -> JobOut:
    """Succeed the job with its report (after its artifact was uploaded under this lease)."""
    job = queue.complete_job(session, job_id, body.lease_token, body.report, utcnow())
    _seen(metrics, job)
    return JobOut.from_row(job)


@router.post("/jobs/{job_id}/fail")
def fail(
    job_id: str, body: FailRequest, _worker: WorkerDep, session: SessionDep, metrics: MetricsDep
) -> JobOut:
    """Give the job up: canceled if the user asked, requeued if retryable and attempts are left, else failed."""
    job = queue.leased_job(session, job_id, body.lease_token)
    _seen(metrics, job)
    queue.fail_job(session, job, body.error, body.retryable, utcnow())
    return JobOut.from_row(job)
