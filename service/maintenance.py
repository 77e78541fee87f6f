"""Background work of the API process: requeue expired leases, sweep unreferenced blobs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service import queue
from service.blobs import BlobStore
from service.clock import utcnow
from service.logging import get_logger
from service.models import Job, Model

log = get_logger("maintenance")


def requeue_expired_leases(session_factory: sessionmaker[Session]) -> int:
    """One transaction of `queue.requeue_expired`; returns how many jobs it changed."""
    with session_factory.begin() as session:
        return len(queue.requeue_expired(session, utcnow()))


def referenced_blobs(session: Session) -> set[str]:
    keys = set(session.scalars(select(Model.blob_key)))
    keys.update(
        k
        for k in session.scalars(select(Job.artifact_blob_key).where(Job.artifact_blob_key.is_not(None)))
        if k
    )
    return keys


def sweep_blobs(session_factory: sessionmaker[Session], blobs: BlobStore, grace_seconds: float) -> list[str]:
    """Delete blobs that no model or job references (deleted models, replaced artifacts)."""
    with session_factory() as session:
        referenced = referenced_blobs(session)
    removed = blobs.sweep(referenced, grace_seconds)
    if removed:
        log.info("swept unreferenced blobs", extra={"count": len(removed)})
    return removed


async def run_every(seconds: float, name: str, work: Callable[[], object]) -> None:
    """Call `work` in a thread every `seconds` until cancelled; an error is logged, not fatal."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await asyncio.to_thread(work)
        except Exception:
            log.exception("periodic task failed; retrying next round", extra={"task": name})
