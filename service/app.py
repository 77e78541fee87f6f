"""The FastAPI application factory: `create_app(settings)`.

At start (lifespan) it migrates the database to head and starts the background tasks: requeue of
expired leases, the blob sweep, webhook delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from service import maintenance, webhooks
from service.api.routes import admin, health, jobs, models, signing, worker
from service.body_limits import BodyLimitsMiddleware
from service.check_budget import CheckBudget
from service.db import make_engine, make_session_factory, upgrade_to_head
from service.errors import ServiceError
from service.file_modes import private_dir
from service.logging import get_logger
from service.metrics import Metrics
from service.middleware import RequestContextMiddleware
from service.queue import ClaimHealth
from service.rate_limit import FailedAuthLimiter, RateLimiter
from service.settings import Settings
from service.signing import load_signing_key
from service.storable import scrub, storable_json
from service.ui import docs as ui_docs
from service.ui import routes as ui_routes

log = get_logger("app")

API_VERSION = "1"

# Requests whose bodies stream into the server (each route enforces its own size limit).
STREAMED_UPLOADS = (("POST", r"/v1/models"), ("PUT", r"/v1/worker/jobs/[^/]+/artifact"))
# Bodies with their own size limit (OPFUSE_MAX_REPORT_BYTES), for worker keys only.
REPORT_BODIES = (("POST", r"/v1/worker/jobs/[^/]+/complete"),)


def _location(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "body"


async def _service_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return JSONResponse({"detail": scrub(exc.detail)}, status_code=exc.status_code, headers=exc.headers)


def _shallow(error: Any) -> Any:
    if isinstance(error, dict) and isinstance(error.get("input"), dict | list):
        error = {k: v for k, v in error.items() if k != "input"}
    if isinstance(error, dict) and "ctx" in error:
        error = {**error, "ctx": {k: str(v)[:200] for k, v in dict(error["ctx"]).items()}}
    return error


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    """422 with a readable `detail` string (and the structured `errors` for programs)."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    detail = "; ".join(f"{_location(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors)
    # The errors echo the input: only scalars are echoed (a report nested hundreds deep would be
    # echoed whole), and scrubbed (a lone surrogate cannot be encoded as UTF-8).
    echoed = storable_json(jsonable_encoder([_shallow(e) for e in errors]))
    return JSONResponse({"detail": scrub(f"invalid request: {detail}"), "errors": echoed}, status_code=422)


def create_app(settings: Settings | None = None, *, run_migrations: bool = True) -> FastAPI:
    """The API app for `settings` (default: from the environment). `run_migrations=False` when the
    caller already ran `service.db.upgrade_to_head`."""
    settings = settings or Settings()
    engine = make_engine(settings.database_url)
    session_factory = make_session_factory(engine)
    metrics = Metrics(session_factory)

    def background() -> list[Coroutine[Any, Any, None]]:
        return [
            maintenance.run_every(
                settings.requeue_interval_seconds,
                "requeue",
                partial(maintenance.requeue_expired_leases, session_factory, metrics),
            ),
            maintenance.run_every(
                settings.blob_gc_interval_seconds,
                "blob sweep",
                partial(maintenance.sweep_blobs, session_factory),
            ),
            webhooks.deliver_forever(session_factory, settings, metrics),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if run_migrations:
            await asyncio.to_thread(upgrade_to_head, settings.database_url, settings.legacy_blob_dir)
        private_dir(settings.tmp_dir)  # uploads of every tenant pass through it
        await asyncio.to_thread(maintenance.remove_stale_spools, settings.tmp_dir)
        tasks = [asyncio.create_task(work) for work in background()]
        log.info("api ready", extra={"database": engine.url.render_as_string(hide_password=True)})
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            engine.dispose()

    app = FastAPI(
        title="opfuse",
        version=API_VERSION,
        summary="Operator fusion as a service: upload an ONNX model, get back a fused, verified bundle.",
        lifespan=lifespan,
        docs_url=None,  # service/ui/docs.py serves /docs without a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = session_factory
    app.state.metrics = metrics
    app.state.rate_limiter = RateLimiter(settings.rate_limit_per_min)
    app.state.auth_failures = FailedAuthLimiter(settings.auth_failures_per_min)
    app.state.check_budget = CheckBudget(settings.check_budget_bytes)
    app.state.signing_key = load_signing_key(settings)
    app.state.claim_health = ClaimHealth()
    routers = (models.router, jobs.router, admin.router, worker.router, health.router, signing.router)
    for router in (*routers, ui_routes.router, ui_docs.router):
        app.include_router(router)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(
        BodyLimitsMiddleware,
        max_json_bytes=settings.max_json_bytes,
        timeout_seconds=settings.request_timeout_seconds,
        streamed=STREAMED_UPLOADS,
        idle_timeout_seconds=settings.body_idle_timeout_seconds,
        max_report_bytes=settings.max_report_bytes,
        reports=REPORT_BODIES,
    )
    app.add_middleware(RequestContextMiddleware, metrics=metrics)  # outermost
    return app
