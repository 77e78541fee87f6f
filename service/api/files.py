"""Streaming a stored blob as a download, with its sha256 as the ETag."""

from __future__ import annotations

from fastapi import Request, Response
from fastapi.responses import FileResponse

from service.blobs import BlobStore
from service.logging import get_logger

log = get_logger("files")


def blob_response(request: Request, blobs: BlobStore, key: str, media_type: str, filename: str) -> Response:
    """A streamed FileResponse (ETag = `"<sha256>"`), or 304 when the client's If-None-Match has it."""
    etag = f'"{key}"'
    if etag in [t.strip() for t in request.headers.get("if-none-match", "").split(",")]:
        return Response(status_code=304, headers={"ETag": etag})
    path = blobs.path(key)
    if not path.is_file():
        # The row exists but the file is gone: the store was damaged or pruned by hand.
        log.error("blob missing", extra={"blob_key": key})
        raise FileNotFoundError(f"blob {key} is missing from the blob store")
    return FileResponse(path, media_type=media_type, filename=filename, headers={"ETag": etag})
