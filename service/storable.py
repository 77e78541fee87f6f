"""Text the database and JSON can hold: no NUL (PostgreSQL refuses U+0000 in text and cannot
de-escape `\\u0000` out of a JSON column) and no lone surrogates (not encodable as UTF-8).

Untrusted strings are checked where they enter (request bodies, query parameters, names read out of
an uploaded model) and refused with a 422 naming the field; free text that must not be lost (a
worker's error message, a report) is scrubbed instead.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator

from service.errors import UnprocessableError

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def unstorable_reason(text: str) -> str | None:
    """Why `text` cannot be stored, in words, or None."""
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    char = found.group()
    if char == "\x00":
        return f"it contains a NUL character (U+0000) at position {found.start()}"
    return f"it contains a lone surrogate (U+{ord(char):04X}) at position {found.start()}"


def check_storable(text: str, field: str) -> str:
    """`text`, or a 422 naming `field` when the database could not hold it."""
    reason = unstorable_reason(text)
    if reason is not None:
        raise UnprocessableError(f"{field} cannot be stored: {reason}; remove the character and try again")
    return text


def _validate(text: str) -> str:
    reason = unstorable_reason(text)
    if reason is not None:
        raise ValueError(f"cannot be stored: {reason}")
    return text


# A request field the database can hold: pydantic refuses anything else with a 422 naming the field.
StorableStr = Annotated[str, AfterValidator(_validate)]


def scrub(text: str) -> str:
    """`text` with every character the database cannot hold replaced by U+FFFD."""
    return _UNSTORABLE.sub(REPLACEMENT, text)


def storable_json(value: Any, depth: int = 0, max_depth: int = 64) -> Any:
    """A copy of a JSON value the database can hold: strings (keys too) scrubbed, NaN/±inf as
    null. Deeper than `max_depth` is refused (a report nested hundreds deep is no report)."""
    if depth > max_depth:
        raise ValueError(f"is nested more than {max_depth} levels deep")
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {scrub(str(k)): storable_json(v, depth + 1, max_depth) for k, v in value.items()}
    if isinstance(value, list):
        return [storable_json(v, depth + 1, max_depth) for v in value]
    return value
