"""Keyset (cursor) pagination over rows with a string `id`, in any order of one column.

The order is a column and a direction (`-speedup`: largest first); rows with no value come last in
either direction, and `id` breaks ties. A cursor is opaque to clients: base64url of the order's
name and the last row's (value, id). Keyset pages stay correct while rows are inserted, unlike
offsets.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, Integer, Select, and_, or_
from sqlalchemy.orm import Session

from service.errors import BadRequestError, UnprocessableError
from service.models import is_id

DEFAULT_LIMIT = 50
MAX_LIMIT = 200


@dataclass(frozen=True)
class Ordering:
    """`column` ascending or descending; `is_time`: its values are datetimes (else numbers)."""

    column: str
    descending: bool
    is_time: bool = False

    @property
    def name(self) -> str:
        return f"-{self.column}" if self.descending else self.column


CREATED_DESC = Ordering("created_at", descending=True, is_time=True)


def parse_ordering(value: str, numeric: Iterable[str], times: Iterable[str]) -> Ordering:
    """`order_by` as given (`speedup`, `-speedup`, ...); 422 naming the choices if unknown."""
    numeric, times = list(numeric), list(times)
    column = value.removeprefix("-")
    if column not in numeric and column not in times:
        choices = ", ".join(f"{c}, -{c}" for c in [*times, *numeric])
        raise UnprocessableError(f"cannot order by '{value}'; order_by is one of: {choices}")
    return Ordering(column, descending=value.startswith("-"), is_time=column in times)


def encode_cursor(ordering: Ordering, value: Any, row_id: str) -> str:
    if isinstance(value, datetime):
        value = value.isoformat()
    raw = json.dumps([ordering.name, value, row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _bad_cursor() -> BadRequestError:
    return BadRequestError(
        "invalid cursor: pass the `next_cursor` of the previous page unchanged, or omit it to start over"
    )


# Numbers a cursor may carry: what a float holds exactly (every stored value is within it).
MAX_CURSOR_NUMBER = 2**53


def decode_cursor(cursor: str, ordering: Ordering) -> tuple[Any, str]:
    """The (value, id) a cursor of `ordering` holds; 400 for anything encode_cursor could not have
    written (bad base64 or JSON, another order, an id that is no id, a time or number out of range),
    so nothing a client forges reaches the database."""
    try:
        raw = base64.urlsafe_b64decode(cursor.encode("ascii") + b"=" * (-len(cursor) % 4))
        decoded = json.loads(raw)
    except (ValueError, TypeError, binascii.Error, UnicodeError, RecursionError):
        raise _bad_cursor() from None
    if not isinstance(decoded, list) or len(decoded) != 3:
        raise _bad_cursor()
    name, value, row_id = decoded
    if not isinstance(name, str) or not isinstance(row_id, str) or not is_id(row_id):
        raise _bad_cursor()
    if name != ordering.name:
        raise BadRequestError(
            f"this cursor is for order_by={name.encode('unicode_escape').decode('ascii')[:40]}, not "
            f"{ordering.name}; keep order_by the same while paging, or omit the cursor to start over"
        )
    if value is None:
        return None, row_id
    try:
        if ordering.is_time:
            if not isinstance(value, str):
                raise ValueError("not a time")
            when = datetime.fromisoformat(value)
            if when.tzinfo is None:
                raise ValueError("naive")
            return when.astimezone(UTC), row_id  # OverflowError for times UTC cannot hold
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("not a number")
        if not math.isfinite(value) or abs(value) > MAX_CURSOR_NUMBER:
            raise ValueError("out of range")
    except (ValueError, TypeError, OverflowError):
        raise _bad_cursor() from None
    return value, row_id


def _after(column: Any, row_id: Any, value: Any, after_id: str, descending: bool) -> ColumnElement[bool]:
    """Rows that come after (value, after_id) in the order; NULL values come last."""
    later_id = row_id < after_id if descending else row_id > after_id
    if value is None:
        return and_(column.is_(None), later_id)
    later_value = column < value if descending else column > value
    return or_(later_value, and_(column == value, later_id), column.is_(None))


def _within_column(column: Any, value: Any) -> Any:
    """`value` brought into an integer column's range (PostgreSQL refuses to compare an INTEGER with
    a number it cannot hold); a forged cursor past the range pages from the range's end."""
    if not isinstance(value, int | float) or not isinstance(column.type, Integer):
        return value
    bound = 2**63 - 1 if isinstance(column.type, BigInteger) else 2**31 - 1
    return max(-bound, min(bound, value))


def paginate(
    session: Session, stmt: Select[Any], entity: Any, ordering: Ordering, limit: int, cursor: str | None
) -> tuple[list[Any], str | None]:
    """One page of `stmt`'s rows (of `entity`) in `ordering`, and the cursor of the next page (None
    on the last)."""
    column, row_id = getattr(entity, ordering.column), entity.id
    if cursor is not None:
        value, after_id = decode_cursor(cursor, ordering)
        value = _within_column(column, value)
        stmt = stmt.where(_after(column, row_id, value, after_id, ordering.descending))
    if ordering.descending:
        stmt = stmt.order_by(column.desc().nulls_last(), row_id.desc())
    else:
        stmt = stmt.order_by(column.asc().nulls_last(), row_id.asc())
    rows = list(session.scalars(stmt.limit(limit + 1)))
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1]
    return rows, encode_cursor(ordering, getattr(last, ordering.column), last.id)
