"""One run of `workers.pipeline` as a killable child, in its own process group, with its progress
read on a thread and its stderr kept in a file for the failure reason. Two ways to start it:

- `ForkedPipeline` (the default): forked from the worker's forkserver, a process that imported
  torch, triton, onnx and opfuse once, so a job starts in milliseconds instead of seconds; progress
  comes over a pipe.
- `PipelineProcess`: a fresh `python -m workers.pipeline` (or any command: tests wrap the pipeline
  to inject faults); progress comes on its stdout.

Both answer the same calls (`PipelineHandle`): pid, latest, poll, wait, kill, stderr_tail, close.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Protocol

# The stage names the API accepts in heartbeats (DESIGN.md §3, Job.stage).
STAGES = frozenset(
    {"loading", "profiling", "fusing", "codegen", "tuning", "verifying", "benchmarking", "packaging"}
)

# What the forkserver imports once, so that each forked job need not: the compiler and what it
# imports on first use (opset conversion, shape inference, the Triton interpreter), which is most of
# a small job's time. The main module is imported again in each child (multiprocessing), hence the
# worker and the CLI. A name that fails to import is skipped (the child imports it if it must).
FORKSERVER_PRELOAD = [
    "torch",
    "triton",
    "triton.runtime.interpreter",
    "onnx",
    "onnx.reference",
    "onnx.shape_inference",
    "onnx.version_converter",
    "onnx_ir",
    "onnxscript",
    "onnxruntime",
    "sympy",
    "opfuse.compiler",
    "workers.pipeline",
    "workers.worker",
    "client.cli",
]


class PipelineHandle(Protocol):
    changed: threading.Event
    stderr_path: Path

    @property
    def pid(self) -> int: ...

    def latest(self) -> tuple[str | None, float]: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self, grace_s: float = 2.0) -> int: ...

    def stderr_tail(self, lines: int = 15, max_chars: int = 3000) -> str: ...

    def close(self) -> None: ...


class _Progress:
    """The last (stage, progress) a child reported, updated from its progress lines."""

    def __init__(self, workdir: Path) -> None:
        self.stderr_path = workdir / "pipeline.stderr"
        self._lock = threading.Lock()
        self._stage: str | None = None
        self._progress = 0.0
        self.changed = threading.Event()

    def _update(self, raw: bytes | str) -> None:
        try:
            msg = json.loads(raw)
            stage, progress = str(msg["stage"]), float(msg["progress"])
        except (ValueError, KeyError, TypeError):
            return  # not a progress line; the pipeline keeps that channel for progress only
        with self._lock:
            if stage in STAGES:  # an unknown name would make the API refuse the heartbeat
                self._stage = stage
            self._progress = min(max(progress, 0.0), 1.0)
        self.changed.set()

    def latest(self) -> tuple[str | None, float]:
        with self._lock:
            return self._stage, self._progress

    def stderr_tail(self, lines: int = 15, max_chars: int = 3000) -> str:
        try:
            text = self.stderr_path.read_bytes()[-64_000:].decode("utf-8", "replace")
        except OSError:
            return ""
        tail = "\n".join(line for line in text.splitlines() if line.strip())
        return "\n".join(tail.splitlines()[-lines:])[-max_chars:]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:  # not (yet) the leader of its own group
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class PipelineProcess(_Progress):
    """A pipeline child started as a new process (`argv`); progress is read from its stdout."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], workdir: Path) -> None:
        super().__init__(workdir)
        self._stderr: IO[bytes] = self.stderr_path.open("wb")
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
            self._update(raw)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def kill(self, grace_s: float = 2.0) -> int:
        """SIGTERM the whole process group, SIGKILL it after `grace_s`; returns the exit status."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    def stderr_tail(self, lines: int = 15, max_chars: int = 3000) -> str:
        self._stderr.flush()
        return super().stderr_tail(lines, max_chars)

    def close(self) -> None:
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


_forkserver_lock = threading.Lock()
_forkserver_env: dict[str, str] | None = None


def start_forkserver(env: Mapping[str, str]) -> bool:
    """Give this process its job children's environment (`env`: CUDA_VISIBLE_DEVICES,
    TRITON_INTERPRET; the worker never uses the GPU itself) and start its forkserver, which imports
    FORKSERVER_PRELOAD once. The forkserver, and one multiprocessing restarts should it die, inherit
    that environment. False if another environment was set before (a second worker in this
    process): that worker's jobs then start as new processes."""
    global _forkserver_env
    wanted = dict(env)
    with _forkserver_lock:
        if _forkserver_env is not None:
            return _forkserver_env == wanted
        os.environ.clear()
        os.environ.update(wanted)
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
        multiprocessing.forkserver.ensure_running()
        _forkserver_env = wanted
        return True


def _forked_noop() -> None:
    return None


def warm_forkserver() -> None:
    """Block until the forkserver has imported FORKSERVER_PRELOAD and forks (a no-op child): a
    worker claims no job before it can start one at once."""
    context = multiprocessing.get_context("forkserver")
    probe = context.Process(target=_forked_noop, name="opfuse-forkserver-probe")
    probe.start()
    probe.join()
    probe.close()


class ForkedPipeline(_Progress):
    """A pipeline child forked from the forkserver (start_forkserver first); it runs
    `workers.pipeline.run_forked(args)` and sends progress over a pipe."""

    def __init__(self, args: Sequence[str], workdir: Path) -> None:
        from workers.pipeline import run_forked

        super().__init__(workdir)
        context = multiprocessing.get_context("forkserver")
        reader, writer = context.Pipe(duplex=False)
        self.proc = context.Process(
            target=run_forked, args=(list(args), str(self.stderr_path), writer), name="opfuse-pipeline"
        )
        self.proc.start()
        writer.close()
        self._conn: Connection = reader
        self._reader = threading.Thread(target=self._read_progress, name="pipeline-progress", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def _read_progress(self) -> None:
        while True:
            try:
                raw = self._conn.recv_bytes()
            except (EOFError, OSError):
                return
            self._update(raw)

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        code = self.proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired("workers.pipeline (forked)", timeout or 0.0)
        return code

    def kill(self, grace_s: float = 2.0) -> int:
        """SIGTERM the whole process group, SIGKILL it after `grace_s`; returns the exit status."""
        if self.proc.exitcode is None:
            _signal_group(self.pid, signal.SIGTERM)
            self.proc.join(grace_s)
            if self.proc.exitcode is None:
                _signal_group(self.pid, signal.SIGKILL)
        return self.wait()

    def close(self) -> None:
        self._reader.join(timeout=5)
        self._conn.close()
        if self.proc.exitcode is not None:
            self.proc.close()


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
