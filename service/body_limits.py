"""Limits on request bodies, before any route sees them: a size limit on every body that is not a
streamed upload (JSON, mostly) → 413, and a deadline by which the whole body must have arrived → 408.

Streamed uploads (models, bundles) enforce their own size limit while they stream; here they only
get the deadline, raised from inside the route when it reads past it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import RequestTimeoutError


def _timeout_detail(seconds: float) -> str:
    return (
        f"the request body did not arrive within {seconds:g} s (OPFUSE_REQUEST_TIMEOUT_SECONDS); "
        "send it faster or in smaller pieces"
    )


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
    ) -> None:
        self.app = app
        self.max_json_bytes = max_json_bytes
        self.timeout_seconds = timeout_seconds
        self.streamed = [(method, re.compile(pattern)) for method, pattern in streamed]

    def _is_streamed(self, scope: Scope) -> bool:
        return any(scope["method"] == m and p.fullmatch(scope["path"]) for m, p in self.streamed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_seconds
        if self._is_streamed(scope):
            await self.app(scope, self._with_deadline(receive, deadline), send)
            return
        await self._buffered(scope, receive, send, deadline)

    def _with_deadline(self, receive: Receive, deadline: float) -> Receive:
        done = False

        async def receive_before_deadline() -> Message:
            nonlocal done
            if done:  # the body is in; later calls wait for a disconnect, with no deadline
                return await receive()
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.001))
            except TimeoutError:
                raise RequestTimeoutError(_timeout_detail(self.timeout_seconds)) from None
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return receive_before_deadline

    async def _buffered(self, scope: Scope, receive: Receive, send: Send, deadline: float) -> None:
        """Read the whole (small) body first, then hand it to the app; refuse it if too big or slow."""
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_json_bytes:
            if int(declared) <= self.max_json_bytes + LINGER_BYTES:
                await self._drain(receive, deadline)
            await self._refuse(scope, receive, send, 413, self._too_large())
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
            if len(body) > self.max_json_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, deadline)
                await self._refuse(scope, receive, send, 413, self._too_large())
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

    def _too_large(self) -> str:
        return (
            f"the request body is larger than this server's limit of {self.max_json_bytes} bytes for "
            "JSON bodies (OPFUSE_MAX_JSON_BYTES); send a smaller one"
        )

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, detail: str) -> None:
        # The body was not read to its end: the connection cannot be reused.
        response = JSONResponse({"detail": detail}, status_code=status, headers={"Connection": "close"})
        await response(scope, receive, send)
