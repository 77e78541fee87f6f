"""/v1/jobs: create (idempotent), list (filtered, sorted), get, report (JSON and HTML), artifact, cancel."""

from __future__ import annotations

import tempfile
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session, sessionmaker

from service import jobs, signing
from service.api.deps import SessionDep, SessionFactoryDep, SettingsDep, UserDep
from service.api.files import blob_response
from service.blobs import BlobCorruptError, open_blob
from service.errors import NotFoundError
from service.logging import bind_log_fields
from service.models import JobStatus
from service.pagination import DEFAULT_LIMIT, MAX_LIMIT
from service.schemas import JobCreate, JobOut, Page

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

IdempotencyKey = Annotated[
    str | None,
    Header(alias="Idempotency-Key", min_length=1, max_length=255, description="same key, same job"),
]
OrderBy = Annotated[
    str,
    Query(
        description="a column, largest first with a leading '-': created_at, finished_at, speedup, "
        "latency_ms_before, latency_ms_after, kernels_before, kernels_after, peak_memory_before, "
        "peak_memory_after; jobs without a value come last",
        max_length=64,
    ),
]
_TOO_MANY: dict[int | str, dict[str, Any]] = {
    429: {"description": "the tenant's queue is full (Retry-After says when to try again)"}
}


@router.post("", status_code=202, responses=_TOO_MANY)
def create_job(
    body: JobCreate,
    principal: UserDep,
    session: SessionDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
) -> JobOut:
    """Queue a fusion job. With an Idempotency-Key, repeating the request returns the same job."""
    job = jobs.create_job(session, principal.tenant_id, body, idempotency_key, settings)
    bind_log_fields(job_id=job.id)
    return JobOut.from_row(job)


@router.get("")
def list_jobs(
    principal: UserDep,
    session: SessionDep,
    status: JobStatus | None = None,
    model_id: str | None = None,
    order_by: OrderBy = "-created_at",
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
    cursor: str | None = None,
) -> Page[JobOut]:
    """The tenant's jobs, newest first or in `order_by`, optionally only one status or one model."""
    ordering = jobs.job_ordering(order_by)
    rows, next_cursor = jobs.list_jobs(
        session, principal.tenant_id, status, model_id, ordering, limit, cursor
    )
    return Page[JobOut](items=[JobOut.from_row(j) for j in rows], next_cursor=next_cursor)


@router.get("/{job_id}")
def get_job(job_id: str, principal: UserDep, session: SessionDep) -> JobOut:
    return JobOut.from_row(jobs.find_job(session, principal.tenant_id, job_id))


@router.get("/{job_id}/report")
def get_report(job_id: str, principal: UserDep, session: SessionDep) -> dict[str, Any]:
    """The full report (DESIGN.md §5), once the job succeeded."""
    job = jobs.find_job(session, principal.tenant_id, job_id)
    if job.report is None:
        raise NotFoundError(
            f"job '{job_id}' has no report yet (it is {job.status}); a job has one once it succeeded"
        )
    return job.report


# The page's kernel sources come out of the stored bundle only while it is this small: kernels/*.py
# sit in the zip beside the weights, and the whole blob is read to find them.
REPORT_HTML_ARTIFACT_LIMIT = 64 * 1024 * 1024


def _kernel_sources(
    session: Session, session_factory: sessionmaker[Session], key: str | None
) -> dict[str, str]:
    """kernels/<id>.py of the job's bundle, as text (shown escaped, never run); {} when there is no
    bundle, it is too large to read for a page, or it is not a readable zip."""
    import zipfile

    from opfuse.views import kernel_sources_from_zip

    if key is None:
        return {}
    try:
        reader = open_blob(session, session_factory, key)
        if reader.size > REPORT_HTML_ARTIFACT_LIMIT:
            return {}
        with tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024) as buffer:
            for chunk in reader:
                buffer.write(chunk)
            buffer.seek(0)
            with zipfile.ZipFile(buffer) as archive:
                return kernel_sources_from_zip(archive)
    except BlobCorruptError:  # logged by the blob store; the page is still worth showing
        return {}
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError):
        return {}


@router.get(
    "/{job_id}/report.html",
    response_class=HTMLResponse,
    responses={200: {"content": {"text/html": {}}, "description": "the report as one self-contained page"}},
)
def get_report_html(
    job_id: str, principal: UserDep, session: SessionDep, session_factory: SessionFactoryDep
) -> HTMLResponse:
    """The report as one HTML page that works offline, rendered here from the stored report JSON
    (never HTML from a worker), with the bundle's kernel sources; 404 until the job succeeded."""
    from opfuse.views import CONTENT_SECURITY_POLICY, render_html

    job = jobs.find_job(session, principal.tenant_id, job_id)
    if job.report is None:
        raise NotFoundError(
            f"job '{job_id}' has no report yet (it is {job.status}); a job has one once it succeeded"
        )
    sources = _kernel_sources(session, session_factory, job.artifact_blob_key)
    page = render_html(job.report, sources, title=f"job {job.id}")
    headers = {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "private, no-store",
        "Referrer-Policy": "no-referrer",
    }
    return HTMLResponse(page, headers=headers, media_type="text/html; charset=utf-8")


@router.get(
    "/{job_id}/artifact",
    response_class=Response,
    responses={
        200: {
            "content": {"application/zip": {}},
            "description": "the bundle; ETag is its sha256, Opfuse-Signature its signature (docs/api.md)",
        }
    },
)
def get_artifact(
    job_id: str,
    request: Request,
    principal: UserDep,
    session: SessionDep,
    session_factory: SessionFactoryDep,
) -> Response:
    """The fused bundle (zip), streamed; ETag is `"<sha256>"`."""
    job = jobs.find_job(session, principal.tenant_id, job_id)
    if job.status != JobStatus.SUCCEEDED or job.artifact_blob_key is None:
        raise NotFoundError(
            f"job '{job_id}' has no artifact (it is {job.status}); a job has one once it succeeded"
        )
    response = blob_response(
        request, session, session_factory, job.artifact_blob_key, "application/zip", f"{job.id}.opfuse.zip"
    )
    # Signed as stored: the sha256 the API computed when it received and checked the bundle.
    key = signing.tenant_key(request.app.state.signing_key, job.tenant_id)
    response.headers[signing.HEADER] = signing.signature(
        key, job.id, job.artifact_sha256 or job.artifact_blob_key
    )
    return response


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, principal: UserDep, session: SessionDep) -> JobOut:
    """Queued: canceled now. Running: canceled at the worker's next stage boundary. Finished: 409."""
    return JobOut.from_row(jobs.cancel_job(session, principal.tenant_id, job_id))
