"""Uploaded models: validate, deduplicate per tenant (by sha256), store, list, delete."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from opfuse.errors import ModelError
from opfuse.frontend.inspect import ModelInfo, inspect_model
from service.blobs import BlobWriter
from service.errors import ConflictError, NotFoundError, UnprocessableError
from service.models import ACTIVE_STATUSES, Job, Model
from service.pagination import paginate

DEFAULT_MODEL_NAME = "model"


def find_model(
    session: Session, tenant_id: int, model_id: str, *, lock: Literal["share", "update"] | None = None
) -> Model:
    """The tenant's model, or 404 (another tenant's model is reported missing, never forbidden).

    `lock` takes the row FOR SHARE / FOR UPDATE on PostgreSQL, so creating a job for a model and
    deleting it exclude each other (SQLite serializes transactions anyway).
    """
    stmt = select(Model).where(Model.id == model_id, Model.tenant_id == tenant_id)
    if lock is not None:
        stmt = stmt.with_for_update(read=lock == "share")
    model = session.scalar(stmt)
    if model is None:
        raise NotFoundError(f"no model with id '{model_id}'; list your models with GET /v1/models")
    return model


def find_by_sha256(session: Session, tenant_id: int, sha256: str) -> Model | None:
    return session.scalar(select(Model).where(Model.tenant_id == tenant_id, Model.sha256 == sha256))


def describe_model_file(path: Path, size: int) -> ModelInfo:
    """Parse, check and describe an uploaded file (opfuse.frontend: parse_model, check_model,
    default_opset); 422 with the reason when it is not a valid, self-contained ONNX model."""
    if size == 0:
        raise UnprocessableError("the request body is empty: send the bytes of the .onnx file")
    try:
        return inspect_model(path)
    except ModelError as exc:
        raise UnprocessableError(str(exc)) from None


def check_upload(
    session_factory: sessionmaker[Session], tenant_id: int, writer: BlobWriter
) -> ModelInfo | None:
    """Validate an upload, unless the tenant already has these bytes (then None: nothing to check).

    Runs before the request's transaction starts, so a slow check of a big model holds no locks.
    """
    with session_factory() as session:
        if find_by_sha256(session, tenant_id, writer.sha256) is not None:
            return None
    return describe_model_file(writer.temp_path, writer.size)


def save_model(
    session: Session, tenant_id: int, writer: BlobWriter, name: str, info: ModelInfo | None
) -> tuple[Model, bool]:
    """The tenant's model with these bytes, and whether it is new (publishing the blob if so)."""
    existing = find_by_sha256(session, tenant_id, writer.sha256)
    if existing is not None:
        return existing, False
    if info is None:  # the copy check_upload saw was deleted since
        info = describe_model_file(writer.temp_path, writer.size)
    model = Model(
        tenant_id=tenant_id,
        name=name,
        sha256=writer.sha256,
        size_bytes=writer.size,
        opset=info.opset,
        inputs=[vars(t) for t in info.inputs],
        outputs=[vars(t) for t in info.outputs],
        blob_key=writer.publish(),
    )
    try:
        with session.begin_nested():
            session.add(model)
    except IntegrityError:
        # A concurrent upload of the same bytes committed first: answer with its model.
        existing = find_by_sha256(session, tenant_id, writer.sha256)
        if existing is None:
            raise
        return existing, False
    return model, True


def list_models(
    session: Session, tenant_id: int, limit: int, cursor: str | None
) -> tuple[list[Model], str | None]:
    stmt = select(Model).where(Model.tenant_id == tenant_id)
    return paginate(session, stmt, Model.created_at, Model.id, limit, cursor)


def delete_model(session: Session, tenant_id: int, model_id: str) -> None:
    """Delete a model and its finished jobs; 409 while it has queued or running jobs.

    The blobs are removed later by the blob sweep, once nothing references them.
    """
    model = find_model(session, tenant_id, model_id, lock="update")
    active = session.scalar(
        select(func.count()).select_from(Job).where(Job.model_id == model.id, Job.status.in_(ACTIVE_STATUSES))
    )
    if active:
        raise ConflictError(
            f"model '{model_id}' has {active} queued or running job(s); cancel them "
            "(POST /v1/jobs/{id}/cancel) or let them finish, then delete the model"
        )
    session.execute(delete(Job).where(Job.model_id == model.id))
    session.delete(model)
