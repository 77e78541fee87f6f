"""/v1/worker: the worker protocol (scope `worker`; fleet-wide, jobs of every tenant).

claim → (model download) → heartbeat … → artifact upload → complete | fail. Every call about a job
carries the lease token from the claim; a stale token gets 409 and changes nothing.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service import queue
from service.api.deps import BlobsDep, SessionDep, SessionFactoryDep, SettingsDep, WorkerDep
from service.api.files import blob_response
from service.blobs import BlobWriter
from service.clock import utcnow
from service.errors import UnprocessableError
from service.models import Model
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
from service.uploads import receive_body, require_content_type

router = APIRouter(prefix="/v1/worker", tags=["worker"])

LeaseToken = Annotated[str, Header(alias="Lease-Token", min_length=1, description="the token from the claim")]

_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip with entries / an empty zip


@router.post("/claim", response_model=ClaimOut, responses={204: {"description": "nothing queued"}})
def claim(
    body: ClaimRequest, _worker: WorkerDep, session: SessionDep, settings: SettingsDep
) -> Response | ClaimOut:
    """Take the oldest queued job under a lease (requeueing expired leases first); 204 if none."""
    job = queue.claim_job(session, body.worker_id, body.device, settings.lease_seconds, utcnow())
    if job is None:
        return Response(status_code=204)
    model = session.get(Model, job.model_id)
    assert model is not None and job.lease_token is not None and job.lease_expires_at is not None
    return ClaimOut(
        job=JobOut.from_row(job),
        lease_token=job.lease_token,
        lease_epoch=job.lease_epoch,
        lease_expires_at=job.lease_expires_at,
        model=ModelOut.from_row(model),
    )


@router.get("/jobs/{job_id}/model", response_class=FileResponse)
def get_model(
    job_id: str,
    request: Request,
    lease_token: LeaseToken,
    _worker: WorkerDep,
    session: SessionDep,
    blobs: BlobsDep,
) -> Response:
    """The job's model bytes, streamed; ETag is their sha256."""
    job = queue.leased_job(session, job_id, lease_token)
    model = session.get(Model, job.model_id)
    assert model is not None
    return blob_response(request, blobs, model.blob_key, "application/octet-stream", f"{model.id}.onnx")


@router.post("/jobs/{job_id}/heartbeat")
def heartbeat(
    job_id: str, body: HeartbeatRequest, _worker: WorkerDep, session: SessionDep, settings: SettingsDep
) -> HeartbeatOut:
    """Renew the lease and report progress; `cancel: true` means the user canceled the job."""
    job = queue.leased_job(session, job_id, body.lease_token)
    queue.heartbeat(job, body.stage, body.progress, settings.lease_seconds, utcnow())
    assert job.lease_expires_at is not None
    return HeartbeatOut(cancel=job.cancel_requested, lease_expires_at=job.lease_expires_at)


def _check_lease(session_factory: sessionmaker[Session], job_id: str, lease_token: str) -> None:
    with session_factory() as session:
        queue.leased_job(session, job_id, lease_token)


def _store_artifact(session: Session, job_id: str, lease_token: str, writer: BlobWriter) -> ArtifactOut:
    if not writer.head.startswith(_ZIP_MAGIC):
        raise UnprocessableError(
            "the artifact is not a zip file: upload the bundle (a .opfuse.zip) as produced"
        )
    job = queue.leased_job(session, job_id, lease_token)  # the lease may have been lost during the upload
    queue.attach_artifact(job, writer.publish(), writer.size)
    return ArtifactOut(sha256=writer.sha256, size_bytes=writer.size)


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
    blobs: BlobsDep,
    settings: SettingsDep,
) -> ArtifactOut:
    """The bundle (zip), streamed; kept only if the lease is still current when it has arrived."""
    require_content_type(request, "application/zip", "application/octet-stream")
    await run_in_threadpool(
        _check_lease, session_factory, job_id, lease_token
    )  # refuse early, before the bytes
    with blobs.writer() as writer:
        await receive_body(
            request, writer, settings.max_artifact_bytes, "artifact", "OPFUSE_MAX_ARTIFACT_BYTES"
        )
        return await run_in_threadpool(_store_artifact, session, job_id, lease_token, writer)


@router.post("/jobs/{job_id}/complete")
def complete(job_id: str, body: CompleteRequest, _worker: WorkerDep, session: SessionDep) -> JobOut:
    """Succeed the job with its report (after its artifact was uploaded under this lease)."""
    return JobOut.from_row(queue.complete_job(session, job_id, body.lease_token, body.report, utcnow()))


@router.post("/jobs/{job_id}/fail")
def fail(job_id: str, body: FailRequest, _worker: WorkerDep, session: SessionDep) -> JobOut:
    """Give the job up: canceled if the user asked, requeued if retryable and attempts are left, else failed."""
    job = queue.leased_job(session, job_id, body.lease_token)
    queue.fail_job(job, body.error, body.retryable, utcnow())
    return JobOut.from_row(job)
