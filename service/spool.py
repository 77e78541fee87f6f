"""A temporary file that an upload streams into while its sha256 is computed.

Uploads are spooled to disk, never held whole in memory: a model must be parsed and checked before
it is stored, and the bytes go into the database only once they are known to be good.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from types import TracebackType

MAGIC_BYTES = 8


class UploadSpool:
    """Write bytes to a temp file in `directory`, hashing them; the file is removed on exit.

    Use as a context manager.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, prefix="upload-")
        self._file = os.fdopen(fd, "wb")
        self.path = Path(name)
        self._hash = hashlib.sha256()
        self.size = 0
        self._head = b""

    @classmethod
    def of_bytes(cls, directory: Path, data: bytes) -> UploadSpool:
        """A closed spool holding `data` (e.g. a model made self-contained from a zip)."""
        spool = cls(directory)
        try:
            spool.write(data)
            spool.close()
        except BaseException:
            spool.discard()
            raise
        return spool

    @property
    def head(self) -> bytes:
        """The first few bytes written (enough to check a file's magic number)."""
        return self._head

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def write(self, chunk: bytes) -> None:
        if len(self._head) < MAGIC_BYTES:
            self._head += chunk[: MAGIC_BYTES - len(self._head)]
        self._file.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    def close(self) -> None:
        """Finish writing; the file stays readable at `path` until `discard()`."""
        if not self._file.closed:
            self._file.close()

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> UploadSpool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.discard()
