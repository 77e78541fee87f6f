"""/v1/admin: API keys and tenants' webhook secrets."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Path, status

from service.api.deps import AdminDep, SessionDep
from service.auth import create_key, get_or_create_tenant
from service.schemas import TENANT_PATTERN, ApiKeyCreate, ApiKeyOut, WebhookSecretOut

router = APIRouter(prefix="/v1/admin", tags=["admin"])

TenantPath = Annotated[str, Path(pattern=TENANT_PATTERN, description="a tenant name (created if new)")]


@router.post("/api-keys", status_code=status.HTTP_201_CREATED)
def create_api_key(body: ApiKeyCreate, principal: AdminDep, session: SessionDep) -> ApiKeyOut:
    """A new key for `tenant` (created if new) with `scope`. The key is in this response only."""
    key = create_key(session, get_or_create_tenant(session, body.tenant), body.scope)
    return ApiKeyOut(key=key, tenant=body.tenant, scope=body.scope)


@router.post("/tenants/{tenant}/webhook-secret", status_code=status.HTTP_201_CREATED)
def rotate_webhook_secret(tenant: TenantPath, principal: AdminDep, session: SessionDep) -> WebhookSecretOut:
    """A new secret that signs the tenant's webhooks from now on (replacing its previous one)."""
    secret = "whsec_" + secrets.token_urlsafe(32)
    get_or_create_tenant(session, tenant).webhook_secret = secret
    return WebhookSecretOut(tenant=tenant, webhook_secret=secret)


@router.delete("/tenants/{tenant}/webhook-secret", status_code=status.HTTP_204_NO_CONTENT)
def clear_webhook_secret(tenant: TenantPath, principal: AdminDep, session: SessionDep) -> None:
    """Sign the tenant's webhooks with the server's OPFUSE_WEBHOOK_SECRET again."""
    get_or_create_tenant(session, tenant).webhook_secret = None
