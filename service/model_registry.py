"""Uploaded models: validate, deduplicate per tenant (by sha256), store, list, delete."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from opfuse.frontend.inspect import ModelInfo
from service.blobs import delete_unreferenced, store_blob, tenant_scope
from service.check_budget import CheckBudget
from service.errors import ConflictError, NotFoundError, PayloadTooLargeError, QuotaExceededError
from service.model_checks import ModelLimits, check_and_describe, parse_upload
from service.model_zip import model_from_zip, unpacked_size
from service.models import ACTIVE_STATUSES, Job, Model, is_id
from service.pagination import CREATED_DESC, paginate
from service.spool import UploadSpool

DEFAULT_MODEL_NAME = "model"
ONNX_CONTENT_TYPE = "application/octet-stream"
ZIP_CONTENT_TYPE = "application/zip"


def find_model(
    session: Session, tenant_id: int, model_id: str, *, lock: Literal["share", "update"] | None = None
) -> Model:
    """The tenant's model, or 404 (another tenant's model is reported missing, never forbidden).

    `lock` takes the row FOR SHARE / FOR UPDATE on PostgreSQL, so creating a job for a model and
    deleting it exclude each other (SQLite serializes transactions anyway).
    """
    model = None
    if is_id(model_id):
        stmt = select(Model).where(Model.id == model_id, Model.tenant_id == tenant_id)
        if lock is not None:
            stmt = stmt.with_for_update(read=lock == "share")
        model = session.scalar(stmt)
    if model is None:
        raise NotFoundError(f"no model with id '{model_id}'; list your models with GET /v1/models")
    return model


def find_by_sha256(session: Session, tenant_id: int, sha256: str) -> Model | None:
    return session.scalar(select(Model).where(Model.tenant_id == tenant_id, Model.sha256 == sha256))


def describe_model_file(path: Path, limits: ModelLimits) -> ModelInfo:
    """Parse, check and describe a raw .onnx upload; 422 with every reason when it is not a valid,
    self-contained ONNX model within the server's limits."""
    return check_and_describe(parse_upload(path.read_bytes()), limits)


@dataclass(frozen=True)
class StorageQuota:
    """What one tenant may keep (0: no limit)."""

    max_bytes: int
    max_models: int


def stored_bytes(session: Session, tenant_id: int) -> int:
    """Bytes the tenant keeps: its models and its jobs' bundles (shared blobs count for each)."""
    models = session.scalar(
        select(func.coalesce(func.sum(Model.size_bytes), 0)).where(Model.tenant_id == tenant_id)
    )
    bundles = session.scalar(
        select(func.coalesce(func.sum(Job.artifact_size_bytes), 0)).where(Job.tenant_id == tenant_id)
    )
    return int(models or 0) + int(bundles or 0)


def check_quota(session: Session, tenant_id: int, new_bytes: int, quota: StorageQuota) -> None:
    """413 when `new_bytes` more would take the tenant over its storage quota, 429 when it has as
    many models as it may; the message says what is used and what to do."""
    hint = "delete models you no longer need (DELETE /v1/models/{id}, `opfuse models delete ID`)"
    if quota.max_models:
        count = session.scalar(select(func.count()).select_from(Model).where(Model.tenant_id == tenant_id))
        if (count or 0) >= quota.max_models:
            raise QuotaExceededError(
                f"your tenant has {count} models, the most it may keep (OPFUSE_TENANT_MAX_MODELS); {hint}"
            )
    if quota.max_bytes:
        used = stored_bytes(session, tenant_id)
        if used + new_bytes > quota.max_bytes:
            raise PayloadTooLargeError(
                f"this model ({new_bytes} bytes) would take your tenant's storage to {used + new_bytes} "
                f"bytes, over its quota of {quota.max_bytes} (OPFUSE_TENANT_STORAGE_BYTES; models and "
                f"bundles count); {hint}"
            )


@dataclass
class PreparedUpload:
    """What to store for an upload: the model's bytes, and its description (None: the tenant has
    these bytes already, nothing to check)."""

    spool: UploadSpool
    info: ModelInfo | None


def prepare_upload(
    session_factory: sessionmaker[Session],
    tenant_id: int,
    upload: UploadSpool,
    content_type: str,
    limits: ModelLimits,
    budget: CheckBudget,
    stack: ExitStack,
    quota: StorageQuota,
) -> PreparedUpload:
    """Check an upload (a raw .onnx, or a zip with external data made self-contained here).

    Runs before the request's transaction starts, so a slow check of a big model holds no locks.
    A check holds the model in memory, so it waits for room in `budget`. A spool made here is
    discarded when `stack` closes.
    """
    if content_type == ZIP_CONTENT_TYPE:
        # The check holds the model unpacked: the budget counts that, not the zip's size.
        unpacked = unpacked_size(upload.path, limits)
        with session_factory() as session:
            check_quota(session, tenant_id, unpacked, quota)  # refused before any work
        with budget.hold(unpacked):
            model = model_from_zip(upload.path, limits)
            info = check_and_describe(model, limits)
            data = model.SerializeToString()
            del model
            spool = stack.enter_context(UploadSpool.of_bytes(upload.path.parent, data))
        return PreparedUpload(spool, info)
    with session_factory() as session:
        if find_by_sha256(session, tenant_id, upload.sha256) is not None:
            return PreparedUpload(upload, None)
        check_quota(session, tenant_id, upload.size, quota)
    with budget.hold(upload.size):
        return PreparedUpload(upload, describe_model_file(upload.path, limits))


def save_model(
    session: Session,
    tenant_id: int,
    upload: PreparedUpload,
    name: str,
    limits: ModelLimits,
    chunk_bytes: int,
    quota: StorageQuota,
) -> tuple[Model, bool]:
    """The tenant's model with these bytes, and whether it is new (storing the blob if so)."""
    spool = upload.spool
    existing = find_by_sha256(session, tenant_id, spool.sha256)
    if existing is not None:
        return existing, False
    check_quota(session, tenant_id, spool.size, quota)
    info = upload.info or describe_model_file(spool.path, limits)  # the copy seen before was deleted
    model = Model(
        tenant_id=tenant_id,
        name=name,
        sha256=spool.sha256,
        size_bytes=spool.size,
        opset=info.opset,
        inputs=[vars(t) for t in info.inputs],
        outputs=[vars(t) for t in info.outputs],
        blob_key=store_blob(session, spool, chunk_bytes, tenant_scope(tenant_id)),
    )
    try:
        with session.begin_nested():
            session.add(model)
    except IntegrityError:
        # A concurrent upload of the same bytes committed first: answer with its model.
        existing = find_by_sha256(session, tenant_id, spool.sha256)
        if existing is None:
            raise
        return existing, False
    return model, True


def list_models(
    session: Session, tenant_id: int, limit: int, cursor: str | None
) -> tuple[list[Model], str | None]:
    stmt = select(Model).where(Model.tenant_id == tenant_id)
    return paginate(session, stmt, Model, CREATED_DESC, limit, cursor)


def delete_model(session: Session, tenant_id: int, model_id: str) -> None:
    """Delete a model, its finished jobs, and the blobs (model, bundles) nothing else uses;
    409 while it has queued or running jobs."""
    model = find_model(session, tenant_id, model_id, lock="update")
    active = session.scalar(
        select(func.count()).select_from(Job).where(Job.model_id == model.id, Job.status.in_(ACTIVE_STATUSES))
    )
    if active:
        raise ConflictError(
            f"model '{model_id}' has {active} queued or running job(s); cancel them "
            "(POST /v1/jobs/{id}/cancel) or let them finish, then delete the model"
        )
    blob_keys = {model.blob_key}
    blob_keys.update(
        key
        for key in session.scalars(select(Job.artifact_blob_key).where(Job.model_id == model.id))
        if key is not None
    )
    session.execute(delete(Job).where(Job.model_id == model.id))
    session.delete(model)
    session.flush()
    delete_unreferenced(session, blob_keys)
