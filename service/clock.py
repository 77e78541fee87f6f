"""The service's notion of now: timezone-aware UTC, in one place so tests and code agree."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)
