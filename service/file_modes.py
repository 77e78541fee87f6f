"""The server's files are its owner's only: folders 0700, files 0600, whatever the umask, and also
when they exist already (an OPFUSE_HOME made by hand, a database from an older version).

The SQLite database holds tenants' webhook secrets, the key files hold keys: nobody else on the
host may read them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sqlalchemy.engine import make_url

from service.logging import get_logger

log = get_logger("files")

DIR_MODE = 0o700
FILE_MODE = 0o600
# SQLite's companions of a database file (it creates them with the database file's mode).
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")


def _restrict(path: Path, mode: int) -> None:
    try:
        info = path.stat()
    except FileNotFoundError:
        return
    if stat.S_IMODE(info.st_mode) & ~mode == 0:
        return
    if info.st_uid != os.geteuid():
        log.warning("cannot restrict a file owned by another user", extra={"path": str(path)})
        return
    os.chmod(path, stat.S_IMODE(info.st_mode) & mode)


def private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) 0700, or take away group and other access if it exists."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    _restrict(path, DIR_MODE)
    return path


def private_sqlite_file(database_url: str) -> None:
    """Create a SQLite URL's database file 0600 before SQLite opens it, and restrict an existing one
    and its -wal/-shm/-journal files to 0600. Other URLs: nothing to do."""
    url = make_url(database_url)
    name = url.database
    if url.get_backend_name() != "sqlite" or not name or name == ":memory:" or name.startswith("file:"):
        return
    path = Path(name)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, FILE_MODE))
    for suffix in SQLITE_SUFFIXES:
        _restrict(path.with_name(path.name + suffix), FILE_MODE)
