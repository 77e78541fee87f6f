"""/v1/admin: API keys."""

from __future__ import annotations

from fastapi import APIRouter, status

from service.api.deps import AdminDep, SessionDep
from service.auth import create_key, get_or_create_tenant
from service.schemas import ApiKeyCreate, ApiKeyOut

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.post("/api-keys", status_code=status.HTTP_201_CREATED)
def create_api_key(body: ApiKeyCreate, principal: AdminDep, session: SessionDep) -> ApiKeyOut:
    """A new key for `tenant` (created if new) with `scope`. The key is in this response only."""
    key = create_key(session, get_or_create_tenant(session, body.tenant), body.scope)
    return ApiKeyOut(key=key, tenant=body.tenant, scope=body.scope)
