"""FastAPI dependencies as `Annotated` aliases: settings, metrics, the request's session, the caller
(rate-limited per key).

`SessionDep` is the request's one transaction: committed when the route returns normally, rolled back
when it raises, and (scope "function") finished before the response is sent, so a client that sees
a 2xx can rely on the write being durable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from service.auth import InvalidKeyError, Principal, authenticate
from service.errors import ForbiddenError
from service.metrics import Metrics
from service.models import Scope
from service.rate_limit import FailedAuthLimiter, RateLimiter
from service.settings import Settings

# Declared for the OpenAPI docs ("Authorize" button); the key itself is checked in get_principal.
_bearer = HTTPBearer(auto_error=False, description="an API key: `opf_...`")


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def get_session_factory(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.session_factory
    return factory


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_session_factory)]


def get_session(factory: SessionFactoryDep) -> Iterator[Session]:
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


# Where BodyLimitsMiddleware leaves the principal it resolved before reading a body (scope["state"]).
PRINCIPAL_STATE = "opfuse_principal"


def authenticate_request(
    failures: FailedAuthLimiter, factory: sessionmaker[Session], authorization: str | None, address: str
) -> Principal:
    """The caller of a request, or UnauthorizedError / 429 (too many failed attempts from `address`)."""
    failures.check(address)
    # Its own short transaction: the request's transaction starts only when the route needs it
    # (an upload streams for a long time before that).
    with factory() as session:
        try:
            return authenticate(session, authorization)
        except InvalidKeyError:
            failures.failed(address)
            raise


def get_principal(
    request: Request,
    factory: SessionFactoryDep,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    principal = request.scope.get("state", {}).get(PRINCIPAL_STATE)
    if not isinstance(principal, Principal):  # a request without a body: not resolved before
        address = request.client.host if request.client is not None else ""
        principal = authenticate_request(
            request.app.state.auth_failures, factory, request.headers.get("authorization"), address
        )
    if principal.scope != Scope.WORKER:  # workers poll by design; their pace is the fleet's
        limiter: RateLimiter = request.app.state.rate_limiter
        limiter.take(principal.key_id)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def _require(*scopes: Scope) -> Callable[[Principal], Principal]:
    def check(principal: PrincipalDep) -> Principal:
        if principal.scope not in scopes:
            wanted = " or ".join(f"'{s.value}'" for s in scopes)
            raise ForbiddenError(
                f"this endpoint needs an API key with scope {wanted}; yours has scope '{principal.scope.value}'"
            )
        return principal

    return check


# A tenant's admin and the platform admin may also do what a user of their tenant does.
UserDep = Annotated[Principal, Depends(_require(Scope.USER, Scope.ADMIN, Scope.PLATFORM))]
AdminDep = Annotated[Principal, Depends(_require(Scope.ADMIN, Scope.PLATFORM))]
WorkerDep = Annotated[Principal, Depends(_require(Scope.WORKER))]
