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
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, or_
from sqlalchemy.orm import Session

from service.errors import BadRequestError, UnprocessableError

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


def decode_cursor(cursor: str, ordering: Ordering) -> tuple[Any, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        name, value, row_id = json.loads(raw)
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise _bad_cursor() from None
    if name != ordering.name:
        raise BadRequestError(
            f"this cursor is for order_by={name}, not {ordering.name}; keep order_by the same while "
            "paging, or omit the cursor to start over"
        )
    if not isinstance(row_id, str):
        raise _bad_cursor()
    if value is None:
        return None, row_id
    try:
        if ordering.is_time:
            when = datetime.fromisoformat(value)
            if when.tzinfo is None:
                raise ValueError("naive")
            return when, row_id
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("not a number")
    except (ValueError, TypeError):
        raise _bad_cursor() from None
    return value, row_id


def _after(column: Any, row_id: Any, value: Any, after_id: str, descending: bool) -> ColumnElement[bool]:
    """Rows that come after (value, after_id) in the order; NULL values come last."""
    later_id = row_id < after_id if descending else row_id > after_id
    if value is None:
        return and_(column.is_(None), later_id)
    later_value = column < value if descending else column > value
    return or_(later_value, and_(column == value, later_id), column.is_(None))


def paginate(
    session: Session, stmt: Select[Any], entity: Any, ordering: Ordering, limit: int, cursor: str | None
) -> tuple[list[Any], str | None]:
    """One page of `stmt`'s rows (of `entity`) in `ordering`, and the cursor of the next page (None
    on the last)."""
    column, row_id = getattr(entity, ordering.column), entity.id
    if cursor is not None:
        value, after_id = decode_cursor(cursor, ordering)
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
