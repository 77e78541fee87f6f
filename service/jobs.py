"""Jobs as users see them: create (validated against the model, idempotent), list, cancel."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.clock import utcnow
from service.errors import ConflictError, NotFoundError, UnprocessableError
from service.model_registry import find_model
from service.models import FINISHED_STATUSES, Job, JobStatus, Model
from service.pagination import paginate
from service.schemas import JobCreate


def find_job(session: Session, tenant_id: int, job_id: str) -> Job:
    """The tenant's job, or 404 (another tenant's job is reported missing, never forbidden)."""
    job = session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id))
    if job is None:
        raise NotFoundError(f"no job with id '{job_id}'; list your jobs with GET /v1/jobs")
    return job


def _dim_name(dim: int | str) -> str:
    return "unnamed" if dim == "?" else f"'{dim}'"


def shape_problems(inputs: list[dict[str, Any]], input_shapes: dict[str, list[int]]) -> list[str]:
    """Everything wrong with `input_shapes` for a model with these inputs, in words."""
    by_name = {spec["name"]: spec["shape"] for spec in inputs}
    names = ", ".join(f"'{n}'" for n in by_name) or "none"
    problems = [
        f"input_shapes names '{name}', which is not an input of the model (its inputs: {names})"
        for name in input_shapes
        if name not in by_name
    ]
    unbound: list[str] = []
    bound_symbols: dict[str, tuple[int, str]] = {}
    for name, model_shape in by_name.items():
        given = input_shapes.get(name)
        if given is None:
            unbound += [
                f"input '{name}' dim {i} ({_dim_name(d)})"
                for i, d in enumerate(model_shape)
                if isinstance(d, str)
            ]
            continue
        if len(given) != len(model_shape):
            problems.append(
                f"input '{name}' has {len(model_shape)} dims {model_shape} but input_shapes gives {len(given)}: {given}"
            )
            continue
        for i, (declared, value) in enumerate(zip(model_shape, given, strict=True)):
            if isinstance(declared, int) and declared != value:
                problems.append(
                    f"input '{name}' dim {i} is {declared} in the model but input_shapes gives {value}"
                )
            elif isinstance(declared, str) and declared != "?":
                first = bound_symbols.setdefault(declared, (value, f"input '{name}' dim {i}"))
                if first[0] != value:
                    problems.append(
                        f"dim '{declared}' is {first[0]} at {first[1]} but {value} at input '{name}' dim {i}; "
                        "one symbol needs one value"
                    )
    if unbound:
        problems.append("every dynamic dim needs a value in input_shapes; unbound: " + ", ".join(unbound))
    return problems


def check_input_shapes(model: Model, input_shapes: dict[str, list[int]]) -> None:
    problems = shape_problems(model.inputs, input_shapes)
    if problems:
        raise UnprocessableError("; ".join(problems))


def _same_request(job: Job, body: JobCreate) -> bool:
    webhook = str(body.webhook_url) if body.webhook_url else None
    return job.model_id == body.model_id and job.options == body.options() and job.webhook_url == webhook


def _replay(job: Job, body: JobCreate, key: str) -> Job:
    if not _same_request(job, body):
        raise ConflictError(
            f"Idempotency-Key '{key}' was already used for a different request (job '{job.id}'); "
            "send a new key to create another job"
        )
    return job


def create_job(
    session: Session, tenant_id: int, body: JobCreate, idempotency_key: str | None, max_attempts: int
) -> Job:
    """A new queued job, or the job this Idempotency-Key already created for the same request."""
    if idempotency_key is not None:
        earlier = session.scalar(
            select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == idempotency_key)
        )
        if earlier is not None:
            return _replay(earlier, body, idempotency_key)
    # FOR SHARE: a concurrent DELETE of the model waits for this job (and then sees it).
    model = find_model(session, tenant_id, body.model_id, lock="share")
    check_input_shapes(model, body.input_shapes)
    job = Job(
        tenant_id=tenant_id,
        model_id=model.id,
        options=body.options(),
        status=JobStatus.QUEUED.value,
        max_attempts=max_attempts,
        idempotency_key=idempotency_key,
        webhook_url=str(body.webhook_url) if body.webhook_url else None,
    )
    try:
        with session.begin_nested():
            session.add(job)
    except IntegrityError:
        if idempotency_key is None:
            raise
        # A concurrent request with the same key committed first.
        earlier = session.scalar(
            select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == idempotency_key)
        )
        if earlier is None:
            raise
        return _replay(earlier, body, idempotency_key)
    return job


def list_jobs(
    session: Session,
    tenant_id: int,
    status: JobStatus | None,
    model_id: str | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[Job], str | None]:
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        stmt = stmt.where(Job.status == status.value)
    if model_id is not None:
        stmt = stmt.where(Job.model_id == model_id)
    return paginate(session, stmt, Job.created_at, Job.id, limit, cursor)


def cancel_job(session: Session, tenant_id: int, job_id: str) -> Job:
    """Queued: canceled now. Running: flagged; the worker stops at its next stage boundary."""
    job = find_job(session, tenant_id, job_id)
    session.refresh(job, with_for_update=True)
    if job.status in FINISHED_STATUSES:
        raise ConflictError(f"job '{job_id}' already {job.status}; there is nothing to cancel")
    if job.status == JobStatus.QUEUED:
        job.status = JobStatus.CANCELED.value
        job.finished_at = utcnow()
    else:
        job.cancel_requested = True
    return job
