"""One run of `workers.pipeline` as a killable child: its own process group, progress read from its
stdout on a thread, stderr kept in a file for the failure reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

# The stage names the API accepts in heartbeats (DESIGN.md §3, Job.stage).
STAGES = frozenset(
    {"loading", "profiling", "fusing", "codegen", "tuning", "verifying", "benchmarking", "packaging"}
)


class PipelineProcess:
    """A running pipeline child. `latest()` is the last (stage, progress) it printed."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], workdir: Path) -> None:
        self.stderr_path = workdir / "pipeline.stderr"
        self._stderr: IO[bytes] = self.stderr_path.open("wb")
        self._lock = threading.Lock()
        self._stage: str | None = None
        self._progress = 0.0
        self.changed = threading.Event()
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=dict(env),
            start_new_session=True,  # its own process group: kill() takes its children too
        )
        self._reader = threading.Thread(target=self._read_progress, name="pipeline-progress", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_progress(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
                stage, progress = str(msg["stage"]), float(msg["progress"])
            except (ValueError, KeyError, TypeError):
                continue  # not a progress line; the pipeline keeps stdout for progress only
            with self._lock:
                if stage in STAGES:  # an unknown name would make the API refuse the heartbeat
                    self._stage = stage
                self._progress = min(max(progress, 0.0), 1.0)
            self.changed.set()

    def latest(self) -> tuple[str | None, float]:
        with self._lock:
            return self._stage, self._progress

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def kill(self, grace_s: float = 2.0) -> int:
        """SIGTERM the whole process group, SIGKILL it after `grace_s`; returns the exit status."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                return self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            self._signal_group(signal.SIGKILL)
        return self.proc.wait()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stderr_tail(self, lines: int = 15, max_chars: int = 3000) -> str:
        self._stderr.flush()
        try:
            text = self.stderr_path.read_bytes()[-64_000:].decode("utf-8", "replace")
        except OSError:
            return ""
        tail = "\n".join(line for line in text.splitlines() if line.strip())
        return "\n".join(tail.splitlines()[-lines:])[-max_chars:]

    def close(self) -> None:
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


def describe_exit(returncode: int) -> str:
    """'exited with code 3' / 'was killed by signal 9 (SIGKILL, e.g. out of memory)'."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    sig = -returncode
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    hint = {
        "SIGKILL": ", e.g. the machine ran out of memory",
        "SIGSEGV": ", a crash in native code",
        "SIGABRT": ", a crash in native code",
    }.get(name, "")
    return f"was killed by signal {sig} ({name}{hint})"
