"""API keys: how they look, how they are stored (sha256 only) and how a bearer key is resolved.

A key is refused (401) as soon as it is revoked or past its `expires_at`: every request looks it up.
Its `last_used_at` is written at most once a minute, so a busy key costs no write per request.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from service.clock import utcnow
from service.errors import UnauthorizedError
from service.models import ApiKey, Scope, Tenant

KEY_PREFIX = "opf_"
# How much of a key is stored in clear to recognise it: "opf_" and 8 of its 43 random characters.
SHOWN_PREFIX_CHARS = len(KEY_PREFIX) + 8
LAST_USED_RESOLUTION = timedelta(minutes=1)


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


def issue_key(
    session: Session, tenant: Tenant, scope: Scope, expires_at: datetime | None = None
) -> tuple[ApiKey, str]:
    """Store a new key's hash; return its row and the key itself (the only time it exists in clear)."""
    key = new_key()
    row = ApiKey(
        key_hash=hash_key(key),
        tenant_id=tenant.id,
        scope=scope.value,
        prefix=key[:SHOWN_PREFIX_CHARS],
        expires_at=expires_at,
    )
    session.add(row)
    session.flush()
    return row, key


def create_key(session: Session, tenant: Tenant, scope: Scope, expires_at: datetime | None = None) -> str:
    """Store a new key's hash and return the key itself (the only time it exists in clear)."""
    return issue_key(session, tenant, scope, expires_at)[1]


def find_key(session: Session, key: str, now: datetime | None = None) -> tuple[ApiKey, Tenant] | None:
    """The live (not revoked, not expired) key row and its tenant, or None."""
    now = now or utcnow()
    row = session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(
            ApiKey.key_hash == hash_key(key),
            ApiKey.revoked.is_(False),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
        )
    ).first()
    return None if row is None else (row[0], row[1])


def revoke(session: Session, api_key: ApiKey) -> None:
    if not api_key.revoked:
        api_key.revoked = True
        api_key.revoked_at = utcnow()


def _touch(session: Session, api_key: ApiKey, now: datetime) -> None:
    """Record that the key was used, unless that was recorded less than a minute ago. The condition
    is in the UPDATE, so concurrent requests write it once."""
    if api_key.last_used_at is not None and now - api_key.last_used_at < LAST_USED_RESOLUTION:
        return
    session.execute(
        update(ApiKey)
        .where(
            ApiKey.id == api_key.id,
            or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at <= now - LAST_USED_RESOLUTION),
        )
        .values(last_used_at=now)
        .execution_options(synchronize_session=False)
    )
    session.commit()


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


class InvalidKeyError(UnauthorizedError):
    """A well-formed header whose key is unknown, revoked or expired (what a guesser gets)."""


def authenticate(session: Session, authorization: str | None) -> Principal:
    key = parse_bearer(authorization)
    now = utcnow()
    found = find_key(session, key, now) if key.startswith(KEY_PREFIX) else None
    if found is None:
        raise InvalidKeyError("invalid, expired or revoked API key; ask an admin for a new one")
    api_key, tenant = found
    _touch(session, api_key, now)
    return Principal(key_id=api_key.id, tenant_id=tenant.id, tenant=tenant.name, scope=Scope(api_key.scope))
