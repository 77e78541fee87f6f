"""Content-addressed blobs in the database: `blobs` (key, size) and `blob_chunks` (the bytes in
pieces of `blob_chunk_bytes`, each with its own sha256).

A blob's key is its bytes' sha256 (bundles), or, for a tenant's upload, the sha256 of the tenant
and the bytes' sha256 (`scoped_key`): tenants share no blob, so an upload does the same work
whether or not another tenant holds the same bytes, and its timing tells nothing about them.

A blob is written in the caller's transaction, so it appears together with the row that references
it, or not at all. It is read back one chunk per short transaction (a download never holds the
database), every chunk checked against its sha256 before it is handed out, and the whole blob's
sha256 checked before its last chunk is: a damaged blob is never served whole.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

from sqlalchemy import ColumnElement, and_, exists, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.logging import get_logger
from service.models import Blob, BlobChunk, Job, Model
from service.spool import UploadSpool

log = get_logger("blobs")


class BlobCorruptError(Exception):
    """Stored bytes do not match their sha256 (or pieces are missing): the database is damaged."""


def scoped_key(scope: str, content_sha256: str) -> str:
    """The key of bytes with `content_sha256` stored for `scope` (e.g. `tenant:7`)."""
    return hashlib.sha256(b"opfuse-blob-v1\0" + scope.encode() + b"\0" + content_sha256.encode()).hexdigest()


def tenant_scope(tenant_id: int) -> str:
    return f"tenant:{tenant_id}"


def store_blob(session: Session, spool: UploadSpool, chunk_bytes: int, scope: str | None = None) -> str:
    """Store the spool's bytes under their sha256, or under `scoped_key(scope, sha256)` (once per
    key: the same bytes again are not copied); returns the key. Runs in the caller's transaction."""
    key = spool.sha256 if scope is None else scoped_key(scope, spool.sha256)
    if session.get(Blob, key) is not None:
        return key
    try:
        with session.begin_nested():
            session.add(Blob(sha256=key, size_bytes=spool.size, chunk_count=-(-spool.size // chunk_bytes)))
    except IntegrityError:
        return key  # a concurrent upload of the same bytes committed first
    with spool.path.open("rb") as f:
        for seq, chunk in enumerate(iter(lambda: f.read(chunk_bytes), b"")):
            # One row at a time: a big blob never sits in memory.
            session.execute(
                insert(BlobChunk).values(
                    blob_sha256=key, seq=seq, sha256=hashlib.sha256(chunk).hexdigest(), data=chunk
                )
            )
    return key


def _read_chunk(session: Session, key: str, seq: int) -> BlobChunk | None:
    return session.scalar(select(BlobChunk).where(BlobChunk.blob_sha256 == key, BlobChunk.seq == seq))


class BlobReader:
    """Reads one blob chunk by chunk, verified. `first()` reads and checks the first chunk up front,
    so a damaged small blob is refused before a response starts."""

    def __init__(
        self, session_factory: sessionmaker[Session], blob: Blob, content_sha256: str | None = None
    ) -> None:
        self._session_factory = session_factory
        self.key = blob.sha256
        self.content_sha256 = content_sha256 or blob.sha256
        self.size = blob.size_bytes
        self.chunk_count = blob.chunk_count
        self._whole = hashlib.sha256()
        self._seen = 0
        self._next_seq = 0
        self._held: bytes | None = None

    def _corrupt(self, why: str) -> BlobCorruptError:
        log.error("blob is damaged; download aborted", extra={"blob_key": self.key, "reason": why})
        return BlobCorruptError(f"blob {self.key} is damaged: {why}")

    def _next(self, session: Session | None = None) -> bytes | None:
        """The next verified chunk (read in `session`, else in a short one of its own); the last
        one only once the whole sha256 matched."""
        seq = self._next_seq
        if seq >= self.chunk_count:
            return None
        if session is not None:
            chunk = _read_chunk(session, self.key, seq)
        else:
            with self._session_factory() as own:
                chunk = _read_chunk(own, self.key, seq)
        if chunk is None:
            raise self._corrupt(f"chunk {seq} of {self.chunk_count} is missing")
        data = bytes(chunk.data)
        if hashlib.sha256(data).hexdigest() != chunk.sha256:
            raise self._corrupt(f"chunk {seq} does not match its sha256")
        self._whole.update(data)
        self._seen += len(data)
        self._next_seq += 1
        if self._next_seq == self.chunk_count:
            if self._seen != self.size:
                raise self._corrupt(f"its chunks hold {self._seen} bytes, not {self.size}")
            if self._whole.hexdigest() != self.content_sha256:
                raise self._corrupt("the bytes do not match the blob's sha256")
        return data

    def first(self, session: Session) -> None:
        """Read (and hold) the first chunk now, in the request's session (on SQLite a second
        transaction would wait for the request's own)."""
        if self._held is None:
            self._held = self._next(session)

    def __iter__(self) -> Iterator[bytes]:
        if self._held is not None:
            yield self._held
            self._held = None
        while (data := self._next()) is not None:
            yield data


def content_sha256(session: Session, key: str) -> str:
    """The sha256 of blob `key`'s bytes: the model's, for a model's (scoped) blob; else the key."""
    found = session.scalar(select(Model.sha256).where(Model.blob_key == key).limit(1))
    return found or key


def open_blob(session: Session, session_factory: sessionmaker[Session], key: str) -> BlobReader:
    """A reader for blob `key`; its first chunk is read and verified already. A model's blob is
    checked against the model's sha256 (its key may be scoped), any other against its key."""
    blob = session.get(Blob, key)
    if blob is None:
        log.error("blob missing", extra={"blob_key": key})
        raise BlobCorruptError(f"blob {key} is referenced but missing from the database")
    reader = BlobReader(session_factory, blob, content_sha256(session, key))
    reader.first(session)
    return reader


def _unreferenced() -> ColumnElement[bool]:
    return and_(
        ~exists().where(Model.blob_key == Blob.sha256),
        ~exists().where(Job.artifact_blob_key == Blob.sha256),
    )


def delete_unreferenced(session: Session, keys: Iterable[str]) -> list[str]:
    """Delete those of `keys` that no model or job references; returns the deleted keys.

    A blob that a concurrent transaction has just started to reference is kept: its foreign key
    refuses the delete.
    """
    deleted = []
    for key in sorted(set(keys)):
        blob = session.scalar(select(Blob).where(Blob.sha256 == key, _unreferenced()))
        if blob is None:
            continue
        try:
            with session.begin_nested():
                session.delete(blob)
        except IntegrityError:
            continue
        deleted.append(key)
    return deleted


def unreferenced_keys(session: Session, limit: int = 1000) -> list[str]:
    """Blobs that nothing references (left behind by replaced or abandoned artifacts)."""
    return list(session.scalars(select(Blob.sha256).where(_unreferenced()).limit(limit)))
