"""Downloads of stored blobs: streamed chunk by chunk from the database, ETag = the bytes' sha256."""

from __future__ import annotations

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker

from service.blobs import content_sha256, open_blob


def _quote_filename(filename: str) -> str:
    safe = "".join(c if c.isprintable() and c not in '"\\' else "_" for c in filename)
    return safe.encode("ascii", "replace").decode("ascii").replace("?", "_")


def blob_response(
    request: Request,
    session: Session,
    session_factory: sessionmaker[Session],
    key: str,
    media_type: str,
    filename: str,
) -> Response:
    """The blob streamed (ETag `"<sha256>"`), or 304 when the client's If-None-Match has it.

    Its first chunk is read and verified before the response starts, so a damaged blob of one chunk
    is a 500; a later damaged chunk aborts the download before any of its bytes are sent.
    """
    etag = f'"{content_sha256(session, key)}"'
    if etag in [t.strip() for t in request.headers.get("if-none-match", "").split(",")]:
        return Response(status_code=304, headers={"ETag": etag})
    reader = open_blob(session, session_factory, key)
    headers = {
        "ETag": etag,
        "Content-Length": str(reader.size),
        "Content-Disposition": f'attachment; filename="{_quote_filename(filename)}"',
    }
    return StreamingResponse(iter(reader), media_type=media_type, headers=headers)
