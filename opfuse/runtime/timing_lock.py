"""Timings that never overlap across processes sharing one GPU.

A compile times things on the GPU: the per-step profile, the template against the library's
kernel per anchor group (both plans step by step), the before/after benchmark, and launch-config
candidates in its tuning worker. A worker owns its GPU (one worker per GPU), so nothing else runs
there while it times. Where several processes compile on one GPU at once (the corpus's GPU leg
compiles a wave of rows together), each one's timings would count the others' kernels, and the
choice between template and library would be made by noise.

With `OPFUSE_TIMING_LOCK` set to a file path, the compiler's own timing sections (each step of a
per-step timing, a benchmark's timed runs: Executor.time_steps, bench.protocol.measure) hold an
exclusive lock on that file (`fcntl.flock`): the processes' timings take turns while their
compiles (CPU work) still run side by side. Sections are short (one plan step, one benchmark), so
a process waits at most for one section of each of the others. A lock not taken within `WAIT_S`
(a process stuck in its section) is given up on: the section times as it would without the
setting. Unset (the default), nothing is locked.

The tuning worker's candidates do not take the lock: a wait there would count against the
worker's per-candidate timeout (OPFUSE_TUNE_TIMEOUT_S, past which the candidate is taken for a
hang) and the tuning budget, and the configs of one kernel are timed back to back, so what runs
beside them shifts them alike more than it reorders them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

TIMING_LOCK_ENV = "OPFUSE_TIMING_LOCK"
WAIT_S = 60.0
_POLL_S = 0.001


@contextlib.contextmanager
def timing_section(wait_s: float = WAIT_S) -> Iterator[bool]:
    """Hold the timing lock (where OPFUSE_TIMING_LOCK names one) for the `with` body; yields
    whether it is held (False: no lock is set, or it was not free within `wait_s`)."""
    path = os.environ.get(TIMING_LOCK_ENV, "")
    if not path:
        yield False
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    held = False
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(_POLL_S)
        yield held
    finally:
        if held:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
