"""Limits on request bodies, before any route sees them.

- A request that carries a body is authenticated first, from its headers: a missing or wrong key
  gets 401 (and the connection closed) without one byte of the body being read.
- A size limit on every body that is not a streamed upload (JSON, mostly) → 413: OPFUSE_MAX_JSON_BYTES,
  except the worker's complete-with-report under a worker key, OPFUSE_MAX_REPORT_BYTES.
- A deadline by which the whole body must have arrived, and an idle timeout between its pieces → 408.

Streamed uploads (models, bundles) enforce their own size limit while they stream; here they get
the authentication, the deadline and the idle timeout, raised from inside the route when it reads.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.deps import PRINCIPAL_STATE, authenticate_request
from service.auth import Principal
from service.errors import RequestTimeoutError, ServiceError
from service.models import Scope as KeyScope


def _timeout_detail(seconds: float) -> str:
    return (
        f"the request body did not arrive within {seconds:g} s (OPFUSE_REQUEST_TIMEOUT_SECONDS); "
        "send it faster or in smaller pieces"
    )


def _idle_detail(seconds: float) -> str:
    return (
        f"no byte of the request body arrived for {seconds:g} s (OPFUSE_BODY_IDLE_TIMEOUT_SECONDS); "
        "the connection stalled: send the request again"
    )


def has_body(scope: Scope) -> bool:
    """Whether the request says a body follows (a Content-Length other than 0, or chunked)."""
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


# How much of a refused oversized body is still read (and dropped) so that the client gets to
# read the refusal; past it the connection is closed on the client mid-upload.
LINGER_BYTES = 64 * 1024 * 1024


class BodyLimitsMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_json_bytes: int,
        timeout_seconds: float,
        streamed: Sequence[tuple[str, str]],
        idle_timeout_seconds: float | None = None,
        max_report_bytes: int | None = None,
        reports: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.app = app
        self.max_json_bytes = max_json_bytes
        self.max_report_bytes = max_report_bytes or max_json_bytes
        self.timeout_seconds = timeout_seconds
        self.idle_timeout_seconds = idle_timeout_seconds or timeout_seconds
        self.streamed = [(method, re.compile(pattern)) for method, pattern in streamed]
        self.reports = [(method, re.compile(pattern)) for method, pattern in reports]

    @staticmethod
    def _matches(scope: Scope, routes: list[tuple[str, re.Pattern[str]]]) -> bool:
        return any(scope["method"] == m and p.fullmatch(scope["path"]) for m, p in routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not has_body(scope):
            await self.app(scope, receive, send)
            return
        principal = await self._authenticate(scope, receive, send)
        if principal is None:
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_seconds
        if self._matches(scope, self.streamed):
            await self.app(scope, self._with_deadline(receive, deadline), send)
            return
        report = principal.scope == KeyScope.WORKER and self._matches(scope, self.reports)
        limit = self.max_report_bytes if report else self.max_json_bytes
        await self._buffered(scope, receive, send, deadline, limit)

    async def _authenticate(self, scope: Scope, receive: Receive, send: Send) -> Principal | None:
        """The caller, from the headers alone; None once a refusal was sent (the body unread)."""
        state = scope["app"].state
        headers = dict(scope.get("headers", ()))
        authorization = headers.get(b"authorization")
        client = scope.get("client")
        try:
            principal = await asyncio.to_thread(
                authenticate_request,
                state.auth_failures,
                state.session_factory,
                authorization.decode("latin-1") if authorization is not None else None,
                client[0] if client else "",
            )
        except ServiceError as exc:
            await self._refuse(scope, receive, send, exc.status_code, exc.detail, exc.headers)
            return None
        scope.setdefault("state", {})[PRINCIPAL_STATE] = principal
        return principal

    def _with_deadline(self, receive: Receive, deadline: float) -> Receive:
        done = False

        async def receive_before_deadline() -> Message:
            nonlocal done
            if done:  # the body is in; later calls wait for a disconnect, with no deadline
                return await receive()
            remaining = deadline - asyncio.get_running_loop().time()
            idle = remaining > self.idle_timeout_seconds
            try:
                message = await asyncio.wait_for(
                    receive(), max(min(remaining, self.idle_timeout_seconds), 0.001)
                )
            except TimeoutError:
                if idle:
                    raise RequestTimeoutError(_idle_detail(self.idle_timeout_seconds)) from None
                raise RequestTimeoutError(_timeout_detail(self.timeout_seconds)) from None
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return receive_before_deadline

    async def _buffered(
        self, scope: Scope, receive: Receive, send: Send, deadline: float, limit: int
    ) -> None:
        """Read the whole (small) body first, then hand it to the app; refuse it if too big or slow."""
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            if int(declared) <= limit + LINGER_BYTES:
                await self._drain(receive, deadline)
            await self._refuse(scope, receive, send, 413, self._too_large(limit))
            return
        body = bytearray()
        first: Message | None = None
        timed = self._with_deadline(receive, deadline)
        while first is None:
            try:
                message = await timed()
            except RequestTimeoutError as exc:
                await self._refuse(scope, receive, send, 408, exc.detail)
                return
            if message["type"] != "http.request":
                first = message  # the client went away; let the app see it
                break
            body += message.get("body", b"")
            if len(body) > limit:
                if message.get("more_body", False):
                    await self._drain(receive, deadline)
                await self._refuse(scope, receive, send, 413, self._too_large(limit))
                return
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": bytes(body), "more_body": False}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                assert first is not None
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive: Receive, deadline: float) -> None:
        """Read and drop the rest of a body about to be refused (at most LINGER_BYTES, within the
        request's deadline). A client still sending when the server closes gets a reset, and a
        reset loses the refusal it had not read yet; read to the end, the client sees the 413."""
        seen = 0
        timed = self._with_deadline(receive, deadline)
        while seen <= LINGER_BYTES:
            try:
                message = await timed()
            except RequestTimeoutError:
                return
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    def _too_large(self, limit: int) -> str:
        if limit == self.max_report_bytes and limit != self.max_json_bytes:
            return (
                f"the request body is larger than this server's limit of {limit} bytes for a job's "
                "report (OPFUSE_MAX_REPORT_BYTES); send a smaller one"
            )
        return (
            f"the request body is larger than this server's limit of {limit} bytes for "
            "JSON bodies (OPFUSE_MAX_JSON_BYTES); send a smaller one"
        )

    @staticmethod
    async def _refuse(
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        detail: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        # The body was not read to its end: the connection cannot be reused.
        response = JSONResponse(
            {"detail": detail}, status_code=status, headers={**(headers or {}), "Connection": "close"}
        )
        await response(scope, receive, send)
