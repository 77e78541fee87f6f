"""Per-job working directories: private (0700), locked for the job's life, and swept when a killed
worker left them behind (the tenant's model is inside)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

JOB_DIR_PREFIX = "opfuse-job-"
JOB_DIR_LOCK = ".owner.lock"
# A job dir without its lock file yet is a worker between mkdtemp and locking: left alone this long.
UNLOCKED_JOB_DIR_GRACE_S = 60.0


def make_job_dir(job_id: str, root: Path | None) -> tuple[Path, int]:
    """A fresh job directory (mode 0700: the model is the user's) and the fd of the lock that marks
    it as this process's while it runs. The kernel drops the lock when the process dies, however
    it dies, so `sweep_stale_job_dirs` knows a dead worker's directory from a live one's."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{JOB_DIR_PREFIX}{job_id[:12]}-", dir=root))
    try:
        fd = os.open(workdir / JOB_DIR_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return workdir, fd


def remove_job_dir(workdir: Path, lock_fd: int | None) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
    if lock_fd is not None:
        os.close(lock_fd)


def sweep_stale_job_dirs(root: Path | None) -> list[Path]:
    """Remove the job directories in `root` (default: the temp dir) that no live process holds: a
    worker killed mid-job (SIGKILL, OOM, power) left them with the tenant's model inside. Another
    live worker's directories are kept (their lock is held); so are other users'."""
    base = Path(tempfile.gettempdir()) if root is None else root
    removed: list[Path] = []
    try:
        candidates = sorted(base.glob(f"{JOB_DIR_PREFIX}*"))
    except OSError:
        return removed
    for path in candidates:
        try:
            info = path.lstat()
        except OSError:
            continue
        if not path.is_dir() or path.is_symlink() or info.st_uid != os.geteuid():
            continue
        try:
            fd = os.open(path / JOB_DIR_LOCK, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            if time.time() - info.st_mtime > UNLOCKED_JOB_DIR_GRACE_S:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live worker's job
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
