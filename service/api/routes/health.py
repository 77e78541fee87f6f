"""Liveness, readiness and Prometheus metrics (no API key needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from sqlalchemy import Engine
from starlette.responses import JSONResponse

from service.clock import utcnow
from service.db import ping
from service.logging import get_logger
from service.metrics import Metrics
from service.queue import ClaimHealth

router = APIRouter(tags=["health"])
log = get_logger("health")

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "the database is unreachable, or claims fail"}})
def readyz(request: Request) -> Response:
    """Ready to serve: the database answers `SELECT 1`, and the latest worker claim did not fail."""
    engine: Engine = request.app.state.engine
    try:
        ping(engine)
    except Exception as exc:
        log.warning("not ready: database unreachable", extra={"error": str(exc)})
        return JSONResponse({"detail": f"database unreachable: {type(exc).__name__}"}, status_code=503)
    health: ClaimHealth = request.app.state.claim_health
    problem = health.problem(utcnow())
    if problem is not None:
        log.warning("not ready", extra={"error": problem})
        return JSONResponse({"detail": problem}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    registry: Metrics = request.app.state.metrics
    return Response(registry.render(), media_type=PROMETHEUS_TEXT)
