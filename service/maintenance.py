"""Background work of the API process: requeue expired leases, delete blobs nothing references
(bundles of abandoned attempts), remove upload spools a crash left behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service import queue
from service.blobs import delete_unreferenced, unreferenced_keys
from service.clock import utcnow
from service.logging import get_logger
from service.metrics import Metrics

log = get_logger("maintenance")

STALE_SPOOL_SECONDS = 24 * 3600


def requeue_expired_leases(session_factory: sessionmaker[Session], metrics: Metrics | None = None) -> int:
    """One transaction of `queue.requeue_expired`; returns how many jobs it changed."""
    if metrics is None:
        with session_factory.begin() as session:
            return len(queue.requeue_expired(session, utcnow()))
    with metrics.collecting() as pending:
        with session_factory.begin() as session:
            changed = len(queue.requeue_expired(session, utcnow()))
        metrics.apply(pending)
    return changed


def sweep_blobs(session_factory: sessionmaker[Session]) -> list[str]:
    """Delete blobs that no model or job references; returns their keys."""
    with session_factory.begin() as session:
        removed = delete_unreferenced(session, unreferenced_keys(session))
    if removed:
        log.info("deleted unreferenced blobs", extra={"count": len(removed)})
    return removed


def remove_stale_spools(tmp_dir: Path, older_than_seconds: float = STALE_SPOOL_SECONDS) -> int:
    """Delete upload spools older than a day (a live upload writes to its spool all the time)."""
    cutoff = time.time() - older_than_seconds
    removed = 0
    for path in tmp_dir.glob("upload-*"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed


async def run_every(seconds: float, name: str, work: Callable[[], object]) -> None:
    """Call `work` in a thread every `seconds` until cancelled; an error is logged, not fatal."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await asyncio.to_thread(work)
        except Exception:
            log.exception("periodic task failed; retrying next round", extra={"task": name})
