"""API keys: how they look, how they are stored (sha256 only) and how a bearer key is resolved."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import UnauthorizedError
from service.models import ApiKey, Scope, Tenant

KEY_PREFIX = "opf_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: resolved from the bearer key once per request, before the route runs."""

    key_id: int
    tenant_id: int
    tenant: str
    scope: Scope


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_key(session: Session, tenant: Tenant, scope: Scope) -> str:
    """Store a new key's hash and return the key itself (the only time it exists in clear)."""
    key = new_key()
    session.add(ApiKey(key_hash=hash_key(key), tenant_id=tenant.id, scope=scope.value))
    session.flush()
    return key


def find_key(session: Session, key: str) -> tuple[ApiKey, Tenant] | None:
    """The live (not revoked) key row and its tenant, or None."""
    row = session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked.is_(False))
    ).first()
    return None if row is None else (row[0], row[1])


def parse_bearer(authorization: str | None) -> str:
    if not authorization:
        raise UnauthorizedError(
            "missing API key: send the header 'Authorization: Bearer <key>' "
            "(a local server writes its key to $OPFUSE_HOME/api_key)"
        )
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise UnauthorizedError("malformed Authorization header: use 'Authorization: Bearer <key>'")
    return key


def authenticate(session: Session, authorization: str | None) -> Principal:
    key = parse_bearer(authorization)
    found = find_key(session, key) if key.startswith(KEY_PREFIX) else None
    if found is None:
        raise UnauthorizedError("invalid or revoked API key; ask an admin for a new one")
    api_key, tenant = found
    return Principal(key_id=api_key.id, tenant_id=tenant.id, tenant=tenant.name, scope=Scope(api_key.scope))
