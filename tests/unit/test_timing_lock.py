"""OPFUSE_TIMING_LOCK: processes that share a GPU take turns to time (opfuse/runtime/timing_lock.py).

Real processes and a real lock file: each writes when its timing sections start and end, and no
two sections overlap; without the setting nothing is locked; a lock held past the wait is given
up on, not waited for forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opfuse.runtime import timing_lock
from opfuse.runtime.timing_lock import TIMING_LOCK_ENV, timing_section

_SECTIONS = """
import sys, time
from opfuse.runtime.timing_lock import timing_section
log, name = sys.argv[1:3]
for i in range(5):
    with timing_section() as held:
        assert held
        with open(log, "a") as f:
            f.write(f"start {name} {time.monotonic()}\\n")
        time.sleep(0.02)
        with open(log, "a") as f:
            f.write(f"end {name} {time.monotonic()}\\n")
    time.sleep(0.005)  # between sections another process may take its turn
"""


def test_timing_sections_of_processes_sharing_a_lock_never_overlap(tmp_path: Path) -> None:
    script, log = tmp_path / "sections.py", tmp_path / "log.txt"
    script.write_text(_SECTIONS)
    log.write_text("")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, TIMING_LOCK_ENV: str(tmp_path / "gpu.lock"), "PYTHONPATH": root}
    procs = [subprocess.Popen([sys.executable, str(script), str(log), f"p{i}"], env=env) for i in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    events = sorted(
        (float(t), kind, name) for kind, name, t in (line.split() for line in log.read_text().splitlines())
    )
    assert len(events) == 4 * 5 * 2
    inside = None
    for _, kind, name in events:  # in time order: start and end alternate, by the same process
        if kind == "start":
            assert inside is None, f"{name} started while {inside} was timing"
            inside = name
        else:
            assert inside == name
            inside = None
    assert {name for _, _, name in events} == {"p0", "p1", "p2", "p3"}


def test_without_the_setting_nothing_is_locked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(TIMING_LOCK_ENV, raising=False)
    with timing_section() as held, timing_section() as again:
        assert held is False and again is False
    assert list(tmp_path.iterdir()) == []


def test_a_lock_held_past_the_wait_is_given_up_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import fcntl

    path = tmp_path / "gpu.lock"
    monkeypatch.setenv(TIMING_LOCK_ENV, str(path))
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file description: flock excludes it
    try:
        t0 = time.monotonic()
        with timing_section(wait_s=0.2) as held:
            assert held is False
        assert 0.2 <= time.monotonic() - t0 < 5
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        os.close(holder)
    with timing_section() as held:  # free again: taken at once
        assert held is True
    assert timing_lock.WAIT_S >= 10  # a normal wait outlasts any one section
