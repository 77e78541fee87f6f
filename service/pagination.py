"""Keyset (cursor) pagination, newest first, over rows with `created_at` and a string `id`.

A cursor is opaque to clients: base64url of the last row's (created_at, id). Keyset pages stay
correct while rows are inserted, unlike offsets.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session

from service.errors import BadRequestError

RowT = TypeVar("RowT")

DEFAULT_LIMIT = 50
MAX_LIMIT = 200


def encode_cursor(created_at: datetime, row_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, row_id = json.loads(raw)
        when = datetime.fromisoformat(created_at)
        if when.tzinfo is None or not isinstance(row_id, str):
            raise ValueError("bad cursor fields")
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise BadRequestError(
            "invalid cursor: pass the `next_cursor` of the previous page unchanged, or omit it to start over"
        ) from None
    return when, row_id


def paginate(
    session: Session,
    stmt: Select[RowT],
    created_at: InstrumentedAttribute[Any],
    row_id: InstrumentedAttribute[Any],
    limit: int,
    cursor: str | None,
) -> tuple[list[RowT], str | None]:
    """One page of `stmt`'s rows and the cursor of the next page (None on the last)."""
    if cursor is not None:
        after_created, after_id = decode_cursor(cursor)
        stmt = stmt.where(
            or_(created_at < after_created, and_(created_at == after_created, row_id < after_id))
        )
    rows = list(session.scalars(stmt.order_by(created_at.desc(), row_id.desc()).limit(limit + 1)))
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1]
    return rows, encode_cursor(getattr(last, created_at.key), getattr(last, row_id.key))
