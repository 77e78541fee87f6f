"""Receive a raw request body into an upload spool: streamed, hashed on the way, size-limited."""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from service.errors import BadRequestError, PayloadTooLargeError, UnsupportedMediaTypeError
from service.spool import UploadSpool

_FLUSH_BYTES = 1 << 20  # hand the disk 1 MiB at a time, off the event loop


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def require_content_type(request: Request, *allowed: str) -> str:
    """The request's content type if it is one of `allowed` (the first is the one to suggest), else 415."""
    given = content_type(request)
    if given not in allowed:
        others = "".join(f" or '{a}'" for a in allowed[1:])
        raise UnsupportedMediaTypeError(
            f"send the body as raw bytes with 'Content-Type: {allowed[0]}'{others} "
            f"(got '{given or 'no content type'}')"
        )
    return given


def too_large(limit: int, what: str, setting: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"the {what} is larger than this server's limit of {limit} bytes; "
        f"send a smaller one or ask the operator to raise the limit ({setting})"
    )


async def receive_body(request: Request, spool: UploadSpool, limit: int, what: str, setting: str) -> None:
    """Stream the body into `spool`; stop reading and raise 413 as soon as it crosses `limit`
    (`setting` names the environment variable that sets the limit, for the error message).
    A chunked body (no Content-Length) is counted the same way."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit, what, setting)
    buffer = bytearray()
    try:
        async for chunk in request.stream():
            if spool.size + len(buffer) + len(chunk) > limit:
                raise too_large(limit, what, setting)
            buffer += chunk
            if len(buffer) >= _FLUSH_BYTES:
                await run_in_threadpool(spool.write, bytes(buffer))
                buffer.clear()
    except ClientDisconnect:
        raise BadRequestError(
            f"the {what} upload broke off before the whole body arrived; upload it again"
        ) from None
    if buffer:
        await run_in_threadpool(spool.write, bytes(buffer))
    await run_in_threadpool(spool.close)
