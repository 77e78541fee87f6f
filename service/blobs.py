"""Content-addressed blob store on the local filesystem: `blob_dir/<sha[:2]>/<sha>`.

Blobs are written through a temp file in `blob_dir/tmp` and published by an atomic rename, so a
reader never sees half a file. The sha256 is computed while the bytes stream in; nothing is ever held
whole in memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType

_SHA256 = re.compile(r"[0-9a-f]{64}")


class BlobStore:
    """Files named by the sha256 of their content."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp_dir = root / "tmp"
        self.tmp_dir.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        if not _SHA256.fullmatch(key):
            raise ValueError(f"not a blob key (64 lowercase hex digits): {key!r}")
        return self.root / key[:2] / key

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    @contextlib.contextmanager
    def lock(self, exclusive: bool) -> Iterator[None]:
        # Publishing (shared) and sweeping (exclusive) exclude each other, also across processes.
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def writer(self) -> BlobWriter:
        return BlobWriter(self)

    def keys(self) -> Iterable[str]:
        for shard in self.root.iterdir():
            if shard.is_dir() and len(shard.name) == 2:
                yield from (p.name for p in shard.iterdir() if _SHA256.fullmatch(p.name))

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def sweep(self, referenced: set[str], grace_seconds: float) -> list[str]:
        """Delete blobs no row references and nobody touched in `grace_seconds`; returns their keys.

        The grace period protects a blob whose upload renamed it into place but has not committed
        its row yet (a publish refreshes the file's mtime).
        """
        cutoff = time.time() - grace_seconds
        removed = []
        with self.lock(exclusive=True):
            for key in list(self.keys()):
                if key in referenced:
                    continue
                path = self.path(key)
                try:
                    if path.stat().st_mtime <= cutoff:
                        path.unlink()
                        removed.append(key)
                except FileNotFoundError:
                    continue
        return removed


class BlobWriter:
    """Stream bytes into a temp file while hashing them; `publish()` moves it to its content address.

    Use as a context manager: leaving it without publishing removes the temp file.
    """

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        fd, name = tempfile.mkstemp(dir=store.tmp_dir, prefix="upload-")
        self._file = os.fdopen(fd, "wb")
        self.temp_path = Path(name)
        self._hash = hashlib.sha256()
        self.size = 0
        self._head = b""

    @property
    def head(self) -> bytes:
        """The first few bytes written (enough to check a file's magic number)."""
        return self._head

    def write(self, chunk: bytes) -> None:
        if len(self._head) < 8:
            self._head += chunk[: 8 - len(self._head)]
        self._file.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    def close(self) -> None:
        """Finish writing (flushed and fsynced); the temp file stays readable until publish/discard."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def publish(self) -> str:
        """Move the bytes to `<sha[:2]>/<sha>` (atomically) and return the key."""
        self.close()
        key = self.sha256
        target = self._store.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._store.lock(exclusive=False):
            if target.exists():
                # Same content is already there; refresh its mtime so a sweep leaves it alone.
                self.temp_path.unlink(missing_ok=True)
                os.utime(target)
            else:
                os.replace(self.temp_path, target)
        return key

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.temp_path.unlink(missing_ok=True)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.discard()
