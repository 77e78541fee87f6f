"""/v1/models: upload (streamed, validated, deduplicated), list, get, download, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from service import model_registry
from service.api.deps import BlobsDep, SessionDep, SessionFactoryDep, SettingsDep, UserDep
from service.api.files import blob_response
from service.pagination import DEFAULT_LIMIT, MAX_LIMIT
from service.schemas import ModelOut, Page
from service.uploads import receive_body, require_content_type

router = APIRouter(prefix="/v1/models", tags=["models"])

LimitQuery = Annotated[int, Query(ge=1, le=MAX_LIMIT)]

_ONNX_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    openapi_extra=_ONNX_BODY,
    responses={200: {"model": ModelOut, "description": "these bytes were uploaded before"}},
)
async def upload_model(
    request: Request,
    response: Response,
    principal: UserDep,
    session: SessionDep,
    session_factory: SessionFactoryDep,
    blobs: BlobsDep,
    settings: SettingsDep,
    name: Annotated[str, Query(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f]+$")] = (
        model_registry.DEFAULT_MODEL_NAME
    ),
) -> ModelOut:
    """Upload the raw bytes of an .onnx file; 201 for a new model, 200 if the tenant has these bytes."""
    require_content_type(request, "application/octet-stream")
    with blobs.writer() as writer:
        await receive_body(request, writer, settings.max_upload_bytes, "model", "OPFUSE_MAX_UPLOAD_BYTES")
        info = await run_in_threadpool(
            model_registry.check_upload, session_factory, principal.tenant_id, writer
        )
        model, created = await run_in_threadpool(
            model_registry.save_model, session, principal.tenant_id, writer, name, info
        )
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


@router.get("/{model_id}/content", response_class=FileResponse)
def get_model_content(
    model_id: str, request: Request, principal: UserDep, session: SessionDep, blobs: BlobsDep
) -> Response:
    """The original bytes, streamed; ETag is their sha256."""
    model = model_registry.find_model(session, principal.tenant_id, model_id)
    return blob_response(request, blobs, model.blob_key, "application/octet-stream", model.name)


@router.delete("/{model_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_model(model_id: str, principal: UserDep, session: SessionDep) -> None:
    """Delete the model and its finished jobs; 409 while it has queued or running jobs."""
    model_registry.delete_model(session, principal.tenant_id, model_id)
