"""/v1/admin: API keys (make, list, revoke) and tenants' webhook secrets.

Two admin scopes: a tenant's `admin` key manages its own tenant only (another tenant's keys and
secret answer 404, as if they did not exist); the `platform` key (the operator) manages every
tenant, creates tenants, and is the only one that makes worker and platform keys (a worker key
claims every tenant's jobs).
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Path, Query, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api.deps import AdminDep, SessionDep
from service.auth import Principal, get_or_create_tenant, issue_key, revoke
from service.clock import utcnow
from service.errors import BadRequestError, ForbiddenError, NotFoundError, UnprocessableError
from service.models import ApiKey, Scope, Tenant
from service.schemas import TENANT_PATTERN, ApiKeyCreate, ApiKeyInfo, ApiKeyOut, Page, WebhookSecretOut

router = APIRouter(prefix="/v1/admin", tags=["admin"])

TenantPath = Annotated[str, Path(pattern=TENANT_PATTERN, description="a tenant name")]
KeyIdPath = Annotated[int, Path(ge=1, le=2**31 - 1, description="the key's id (from the list)")]
# Scopes a tenant's admin may hand out in its own tenant.
TENANT_ADMIN_GRANTS = (Scope.USER, Scope.ADMIN)


def _is_platform(principal: Principal) -> bool:
    return principal.scope == Scope.PLATFORM


def _tenant_for(session: Session, principal: Principal, name: str) -> Tenant:
    """The tenant `name` as `principal` may manage it: a platform key gets it (created if new), a
    tenant admin only its own (another tenant is 404, existing or not)."""
    if _is_platform(principal):
        return get_or_create_tenant(session, name)
    if name != principal.tenant:
        raise NotFoundError(f"no tenant '{name}' that this key manages (a tenant admin key manages its own)")
    tenant = session.get(Tenant, principal.tenant_id)
    assert tenant is not None  # the principal's key references it
    return tenant


def _info(key: ApiKey, tenant: str) -> ApiKeyInfo:
    return ApiKeyInfo(
        id=key.id,
        prefix=key.prefix,
        tenant=tenant,
        scope=Scope(key.scope),
        created_at=key.created_at,
        last_used_at=key.last_used_at,
        expires_at=key.expires_at,
        revoked=key.revoked,
        revoked_at=key.revoked_at,
    )


@router.post("/api-keys", status_code=status.HTTP_201_CREATED)
def create_api_key(body: ApiKeyCreate, principal: AdminDep, session: SessionDep) -> ApiKeyOut:
    """A new key with `scope` for `tenant` (default: the caller's). The key is in this response only."""
    name = body.tenant or principal.tenant
    if not _is_platform(principal):
        if name != principal.tenant:
            raise ForbiddenError(
                f"a tenant admin key makes keys for its own tenant ('{principal.tenant}') only; keys for "
                "other or new tenants need a platform key (scope 'platform')"
            )
        if body.scope not in TENANT_ADMIN_GRANTS:
            raise ForbiddenError(
                f"a tenant admin key makes 'user' and 'admin' keys only; a '{body.scope.value}' key needs a "
                "platform key (scope 'platform'): worker keys claim every tenant's jobs"
            )
    if body.expires_at is not None and body.expires_at <= utcnow():
        raise UnprocessableError("expires_at is in the past: give a time in the future, or omit it")
    tenant = _tenant_for(session, principal, name)
    row, key = issue_key(session, tenant, body.scope, body.expires_at)
    assert row.prefix is not None
    return ApiKeyOut(
        id=row.id,
        key=key,
        prefix=row.prefix,
        tenant=tenant.name,
        scope=body.scope,
        created_at=row.created_at,
        expires_at=row.expires_at,
    )


@router.get("/api-keys")
def list_api_keys(
    principal: AdminDep,
    session: SessionDep,
    tenant: Annotated[
        str | None,
        Query(
            pattern=TENANT_PATTERN, description="only this tenant's keys (a tenant admin sees its own only)"
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[
        str | None, Query(max_length=16, description="`next_cursor` of the previous page")
    ] = None,
) -> Page[ApiKeyInfo]:
    """Keys, newest first: id, prefix, tenant, scope, created, last used, expiry, revoked. Never the
    keys themselves."""
    stmt = select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
    if not _is_platform(principal):
        if tenant is not None and tenant != principal.tenant:
            raise NotFoundError(
                f"no tenant '{tenant}' that this key manages (a tenant admin key manages its own)"
            )
        stmt = stmt.where(ApiKey.tenant_id == principal.tenant_id)
    elif tenant is not None:
        stmt = stmt.where(Tenant.name == tenant)
    if cursor is not None:
        if not cursor.isdigit() or not 1 <= int(cursor) <= 2**31 - 1:
            raise BadRequestError(
                "invalid cursor: pass the `next_cursor` of the previous page unchanged, or omit it to start over"
            )
        stmt = stmt.where(ApiKey.id < int(cursor))
    rows = session.execute(stmt.order_by(ApiKey.id.desc()).limit(limit + 1)).all()
    more = len(rows) > limit
    rows = rows[:limit]
    return Page[ApiKeyInfo](
        items=[_info(key, name) for key, name in rows], next_cursor=str(rows[-1][0].id) if more else None
    )


def _managed_key(session: Session, principal: Principal, key_id: int) -> tuple[ApiKey, str]:
    row = session.execute(
        select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.id == key_id)
    ).first()
    if row is None or (not _is_platform(principal) and row[0].tenant_id != principal.tenant_id):
        raise NotFoundError(f"no API key {key_id} that this key manages; `opfuse keys list` shows them")
    return row[0], row[1]


def _revoke(session: Session, principal: Principal, key_id: int) -> ApiKeyInfo:
    key, tenant = _managed_key(session, principal, key_id)
    if not _is_platform(principal) and key.scope == Scope.PLATFORM.value:
        raise ForbiddenError("a platform key is revoked with a platform key")
    revoke(session, key)
    session.flush()
    return _info(key, tenant)


@router.post("/api-keys/{key_id}/revoke")
def revoke_api_key(key_id: KeyIdPath, principal: AdminDep, session: SessionDep) -> ApiKeyInfo:
    """Revoke a key: every request with it is refused (401) from now on. Revoking twice is a no-op."""
    return _revoke(session, principal, key_id)


@router.delete("/api-keys/{key_id}")
def delete_api_key(key_id: KeyIdPath, principal: AdminDep, session: SessionDep) -> ApiKeyInfo:
    """The same as POST /v1/admin/api-keys/{key_id}/revoke (the row stays, to be listed)."""
    return _revoke(session, principal, key_id)


@router.post("/tenants/{tenant}/webhook-secret", status_code=status.HTTP_201_CREATED)
def rotate_webhook_secret(tenant: TenantPath, principal: AdminDep, session: SessionDep) -> WebhookSecretOut:
    """A new secret that signs the tenant's webhooks from now on (replacing its previous one)."""
    secret = "whsec_" + secrets.token_urlsafe(32)
    _tenant_for(session, principal, tenant).webhook_secret = secret
    return WebhookSecretOut(tenant=tenant, webhook_secret=secret)


@router.delete("/tenants/{tenant}/webhook-secret", status_code=status.HTTP_204_NO_CONTENT)
def clear_webhook_secret(tenant: TenantPath, principal: AdminDep, session: SessionDep) -> None:
    """Sign the tenant's webhooks with the server's OPFUSE_WEBHOOK_SECRET again."""
    _tenant_for(session, principal, tenant).webhook_secret = None
