"""The outermost layer of every request: a request id, log fields bound for the request (job and
worker ids), one structured log line, HTTP metrics, job metrics once the request's transaction
committed, and a JSON 500 (logged with its traceback) for any exception nothing else handled.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.logging import get_logger, log_fields_var, request_id_var
from service.metrics import Metrics

log = get_logger("http")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
MAX_LOGGED_METHOD_CHARS = 32  # a made-up method can be as long as a request line


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _REQUEST_ID.fullmatch(candidate):
                return candidate
    return uuid.uuid4().hex


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        token = request_id_var.set(request_id)
        fields_token = log_fields_var.set({})
        started = time.perf_counter()
        response: dict[str, Any] = {"status": 500, "started": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                response["started"] = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            with self.metrics.collecting() as pending:
                await self.app(scope, receive, send_with_id)
            if response["status"] < 400:  # the request's transaction committed
                self.metrics.apply(pending)
        except Exception:
            log.exception("unhandled error", extra=self._fields(scope, 500, started))
            if response["started"]:
                raise  # too late for an error response; the server closes the connection
            await self._send_500(send_with_id, request_id)
        finally:
            status = response["status"]
            self.metrics.observe_request(
                scope["method"], _route(scope), status, time.perf_counter() - started
            )
            log.info("request", extra=self._fields(scope, status, started))
            log_fields_var.reset(fields_token)
            request_id_var.reset(token)

    @staticmethod
    def _fields(scope: Scope, status: int, started: float) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "method": scope["method"][:MAX_LOGGED_METHOD_CHARS],
            "path": scope["path"],
            "route": _route(scope),
            "status": status,
            "duration_ms": round((time.perf_counter() - started) * 1000, 2),
        }
        params = scope.get("path_params") or {}
        for key in ("job_id", "model_id"):
            if key in params and key not in (log_fields_var.get() or {}):
                fields[key] = params[key]
        return fields

    @staticmethod
    async def _send_500(send: Send, request_id: str) -> None:
        body = json.dumps(
            {"detail": f"internal server error (request id {request_id}); it was logged, please report it"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 500,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
