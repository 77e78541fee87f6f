"""A worker killed mid-job (SIGKILL, the OOM killer) left the tenant's model in a temporary
directory for good. Job directories are removed on every exit path of a job, and a worker sweeps,
when it starts, the job directories that no live worker holds (a lock the kernel drops when its
holder dies), keeping those of workers still running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.service.conftest import Keys

REPO = Path(__file__).resolve().parents[2]

# A stand-in for a worker mid-job: it makes its job directory as the worker does, puts a model in
# it, says so, and waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from workers.job_dirs import make_job_dir
workdir, _fd = make_job_dir(sys.argv[2], Path(sys.argv[1]))
(workdir / "model.onnx").write_bytes(b"the tenant's model")
print(workdir, flush=True)
time.sleep(600)
"""


@pytest.fixture
def database_url(sqlite_database_url: str) -> str:
    return sqlite_database_url  # job directories are the worker host's matter


def _holder(root: Path, job_id: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), job_id], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the job holder did not start"
    return proc, Path(line)


def test_a_killed_workers_job_dir_is_swept_at_the_next_start(
    tmp_path: Path, api_url: str, keys: Keys
) -> None:
    from workers.config import WorkerConfig
    from workers.worker import Worker

    root = tmp_path / "work"
    root.mkdir()
    killed, killed_dir = _holder(root, "a" * 32)
    alive, alive_dir = _holder(root, "b" * 32)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert (killed_dir / "model.onnx").is_file()  # nothing ran on its way out

        # The next worker start (a real Worker against the real API, queue empty, --once).
        config = WorkerConfig(api_url=api_url, api_key=keys.worker, once=True, work_root=root)
        assert Worker(config).run() == 0
        assert not killed_dir.exists()  # the dead worker's model is gone
        assert (alive_dir / "model.onnx").is_file()  # a live worker's job is left alone
    finally:
        alive.kill()
        alive.wait(30)
    from workers.job_dirs import sweep_stale_job_dirs

    assert sweep_stale_job_dirs(root) == [alive_dir]  # dead now: swept too
    assert list(root.iterdir()) == []


def test_an_unlocked_dir_is_kept_while_young_and_foreign_names_untouched(tmp_path: Path) -> None:
    from workers.job_dirs import JOB_DIR_PREFIX, UNLOCKED_JOB_DIR_GRACE_S, sweep_stale_job_dirs

    young = tmp_path / f"{JOB_DIR_PREFIX}young"
    old = tmp_path / f"{JOB_DIR_PREFIX}old"
    other = tmp_path / "someone-elses-dir"
    for path in (young, old, other):
        path.mkdir()
        (path / "model.onnx").write_bytes(b"x")
    past = time.time() - UNLOCKED_JOB_DIR_GRACE_S - 10
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    assert sweep_stale_job_dirs(tmp_path) == [old]
    assert young.is_dir() and other.is_dir()


def test_a_job_dir_is_removed_on_every_way_out_of_a_job(tmp_path: Path) -> None:
    from workers.job_dirs import make_job_dir, remove_job_dir, sweep_stale_job_dirs

    workdir, fd = make_job_dir("c" * 32, tmp_path)
    assert sweep_stale_job_dirs(tmp_path) == []  # held by this live process
    remove_job_dir(workdir, fd)
    assert not workdir.exists()
    with pytest.raises(OSError):
        os.fstat(fd)  # the lock's fd is closed too
