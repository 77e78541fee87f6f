"""Jobs as users see them: create (validated against the model and the tenant's limits,
idempotent), list (filtered, in any order of the summary metrics), cancel."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import false, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import webhooks
from service.clock import utcnow
from service.errors import ConflictError, NotFoundError, TooManyRequestsError, UnprocessableError
from service.model_registry import find_model
from service.models import FINISHED_STATUSES, Job, JobStatus, Model, Tenant, is_id
from service.pagination import Ordering, paginate, parse_ordering
from service.queue import finish_job
from service.schemas import JobCreate
from service.settings import Settings
from service.storable import check_storable

# What `GET /v1/jobs?order_by=` accepts (each also with a leading "-": largest first).
ORDER_BY_TIME = ("created_at", "finished_at")
ORDER_BY_NUMBER = (
    "speedup",
    "latency_ms_before",
    "latency_ms_after",
    "kernels_before",
    "kernels_after",
    "peak_memory_before",
    "peak_memory_after",
)
QUEUE_FULL_RETRY_SECONDS = 30


def find_job(session: Session, tenant_id: int, job_id: str) -> Job:
    """The tenant's job, or 404 (another tenant's job is reported missing, never forbidden)."""
    job = (
        session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id))
        if is_id(job_id)
        else None
    )
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


def size_problems(input_shapes: dict[str, list[int]], max_elements: int) -> list[str]:
    return [
        f"input_shapes gives input '{name}' {math.prod(dims)} elements, over this server's limit of "
        f"{max_elements} (OPFUSE_MAX_INPUT_ELEMENTS)"
        for name, dims in input_shapes.items()
        if math.prod(dims) > max_elements
    ]


def check_input_shapes(model: Model, input_shapes: dict[str, list[int]], max_elements: int) -> None:
    problems = shape_problems(model.inputs, input_shapes) + size_problems(input_shapes, max_elements)
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


def check_queue_limit(session: Session, tenant_id: int, limit: int) -> None:
    """429 when the tenant has `limit` jobs queued already (0: no limit).

    The tenant row is locked first (PostgreSQL), so concurrent creates count one after the other.
    """
    if limit <= 0:
        return
    # FOR NO KEY UPDATE: inserts that reference the tenant (keys, jobs) do not wait for it.
    session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True))
    queued = session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.tenant_id == tenant_id, Job.status == JobStatus.QUEUED.value)
    )
    if queued is not None and queued >= limit:
        raise TooManyRequestsError(
            f"your tenant has {queued} jobs queued, the most this server allows "
            f"(OPFUSE_MAX_QUEUED_JOBS_PER_TENANT={limit}); wait for some to start, or cancel some",
            QUEUE_FULL_RETRY_SECONDS,
        )


def create_job(
    session: Session, tenant_id: int, body: JobCreate, idempotency_key: str | None, settings: Settings
) -> Job:
    """A new queued job, or the job this Idempotency-Key already created for the same request."""
    webhook_url = str(body.webhook_url) if body.webhook_url else None
    if webhook_url is not None:
        webhooks.check_url(webhook_url, settings)  # first: DNS can be slow, and no lock is held yet
    if idempotency_key is not None:
        check_storable(idempotency_key, "the Idempotency-Key header")
        earlier = session.scalar(
            select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == idempotency_key)
        )
        if earlier is not None:
            return _replay(earlier, body, idempotency_key)
    # FOR SHARE: a concurrent DELETE of the model waits for this job (and then sees it).
    model = find_model(session, tenant_id, body.model_id, lock="share")
    check_input_shapes(model, body.input_shapes, settings.max_input_elements)
    if webhook_url is not None:
        webhooks.check_secret(session, tenant_id, settings)
    check_queue_limit(session, tenant_id, settings.max_queued_jobs_per_tenant)
    job = Job(
        tenant_id=tenant_id,
        model_id=model.id,
        options=body.options(),
        target=body.target.value,
        status=JobStatus.QUEUED.value,
        max_attempts=settings.max_attempts,
        idempotency_key=idempotency_key,
        webhook_url=webhook_url,
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


def job_ordering(order_by: str) -> Ordering:
    """`order_by` of GET /v1/jobs; 422 naming the choices when unknown."""
    return parse_ordering(order_by, ORDER_BY_NUMBER, ORDER_BY_TIME)


def list_jobs(
    session: Session,
    tenant_id: int,
    status: JobStatus | None,
    model_id: str | None,
    ordering: Ordering,
    limit: int,
    cursor: str | None,
) -> tuple[list[Job], str | None]:
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        stmt = stmt.where(Job.status == status.value)
    if model_id is not None:
        stmt = stmt.where(Job.model_id == model_id if is_id(model_id) else false())
    return paginate(session, stmt, Job, ordering, limit, cursor)


def cancel_job(session: Session, tenant_id: int, job_id: str) -> Job:
    """Queued: canceled now. Running: flagged; the worker stops at its next stage boundary."""
    job = find_job(session, tenant_id, job_id)
    session.refresh(job, with_for_update=True)
    if job.status in FINISHED_STATUSES:
        raise ConflictError(f"job '{job_id}' already {job.status}; there is nothing to cancel")
    if job.status == JobStatus.QUEUED:
        finish_job(session, job, JobStatus.CANCELED, utcnow(), None)
    else:
        job.cancel_requested = True
    return job
