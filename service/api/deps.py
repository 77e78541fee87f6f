"""FastAPI dependencies as `Annotated` aliases: settings, stores, the request's session, the caller.

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

from service.auth import Principal, authenticate
from service.blobs import BlobStore
from service.errors import ForbiddenError
from service.models import Scope
from service.settings import Settings

# Declared for the OpenAPI docs ("Authorize" button); the key itself is checked in get_principal.
_bearer = HTTPBearer(auto_error=False, description="an API key: `opf_...`")


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_blobs(request: Request) -> BlobStore:
    blobs: BlobStore = request.app.state.blobs
    return blobs


def get_session_factory(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.session_factory
    return factory


SettingsDep = Annotated[Settings, Depends(get_settings)]
BlobsDep = Annotated[BlobStore, Depends(get_blobs)]
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


def get_principal(
    request: Request,
    factory: SessionFactoryDep,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    # Its own short transaction: the request's transaction starts only when the route needs it
    # (an upload streams for a long time before that).
    with factory() as session:
        return authenticate(session, request.headers.get("authorization"))


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


UserDep = Annotated[Principal, Depends(_require(Scope.USER, Scope.ADMIN))]
AdminDep = Annotated[Principal, Depends(_require(Scope.ADMIN))]
WorkerDep = Annotated[Principal, Depends(_require(Scope.WORKER))]
