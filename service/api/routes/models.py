"""/v1/models: upload (streamed, validated, deduplicated; raw .onnx or a zip with external data),
list, get, download, delete."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from starlette.concurrency import run_in_threadpool

from service import model_registry
from service.api.deps import SessionDep, SessionFactoryDep, SettingsDep, UserDep
from service.api.files import blob_response
from service.logging import bind_log_fields
from service.model_checks import ModelLimits
from service.model_registry import ONNX_CONTENT_TYPE, ZIP_CONTENT_TYPE
from service.pagination import DEFAULT_LIMIT, MAX_LIMIT
from service.schemas import ModelOut, Page
from service.spool import UploadSpool
from service.uploads import receive_body, require_content_type

router = APIRouter(prefix="/v1/models", tags=["models"])

LimitQuery = Annotated[int, Query(ge=1, le=MAX_LIMIT)]
NameQuery = Annotated[str, Query(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f]+$")]

_BINARY = {"schema": {"type": "string", "format": "binary"}}
_MODEL_BODY = {
    "requestBody": {
        "required": True,
        "content": {ONNX_CONTENT_TYPE: _BINARY, ZIP_CONTENT_TYPE: _BINARY},
    }
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    openapi_extra=_MODEL_BODY,
    responses={200: {"model": ModelOut, "description": "these bytes were uploaded before"}},
)
async def upload_model(
    request: Request,
    response: Response,
    principal: UserDep,
    session: SessionDep,
    session_factory: SessionFactoryDep,
    settings: SettingsDep,
    name: NameQuery = model_registry.DEFAULT_MODEL_NAME,
) -> ModelOut:
    """Upload the raw bytes of an .onnx file, or a zip of an .onnx file and its external data files;
    201 for a new model, 200 if the tenant has these bytes."""
    kind = require_content_type(request, ONNX_CONTENT_TYPE, ZIP_CONTENT_TYPE)
    limits = ModelLimits.of(settings)
    quota = model_registry.StorageQuota(settings.tenant_storage_bytes, settings.tenant_max_models)
    with ExitStack() as stack:
        upload = stack.enter_context(UploadSpool(settings.tmp_dir))
        await receive_body(request, upload, settings.max_upload_bytes, "model", "OPFUSE_MAX_UPLOAD_BYTES")
        prepared = await run_in_threadpool(
            model_registry.prepare_upload,
            session_factory,
            principal.tenant_id,
            upload,
            kind,
            limits,
            request.app.state.check_budget,
            stack,
            quota,
        )
        model, created = await run_in_threadpool(
            model_registry.save_model,
            session,
            principal.tenant_id,
            prepared,
            name,
            limits,
            settings.blob_chunk_bytes,
            quota,
        )
    bind_log_fields(model_id=model.id)
    if not created:
        response.status_code = status.HTTP_200_OK
    return ModelOut.from_row(model)


@router.get("")
def list_models(
    principal: UserDep, session: SessionDep, limit: LimitQuery = DEFAULT_LIMIT, cursor: str | None = None
) -> Page[ModelOut]:
    """The tenant's models, newest first."""
    rows, next_cursor = model_registry.list_models(session, principal.tenant_id, limit, cursor)
    return Page[ModelOut](items=[ModelOut.from_row(m) for m in rows], next_cursor=next_cursor)


@router.get("/{model_id}")
def get_model(model_id: str, principal: UserDep, session: SessionDep) -> ModelOut:
    return ModelOut.from_row(model_registry.find_model(session, principal.tenant_id, model_id))


@router.get("/{model_id}/content", response_class=Response)
def get_model_content(
    model_id: str,
    request: Request,
    principal: UserDep,
    session: SessionDep,
    session_factory: SessionFactoryDep,
) -> Response:
    """The stored bytes (the self-contained .onnx), streamed; ETag is their sha256."""
    model = model_registry.find_model(session, principal.tenant_id, model_id)
    return blob_response(request, session, session_factory, model.blob_key, ONNX_CONTENT_TYPE, model.name)


@router.delete("/{model_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_model(model_id: str, principal: UserDep, session: SessionDep) -> None:
    """Delete the model, its finished jobs and the stored bytes nothing else uses; 409 while it
    has queued or running jobs."""
    model_registry.delete_model(session, principal.tenant_id, model_id)
