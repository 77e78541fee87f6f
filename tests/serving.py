"""`opfuse serve` for the tests that need a real server: the API and one worker on a free port, in
a process group of their own, stopped with SIGTERM and then, whatever of the group is left, with
SIGKILL, so that no server or worker outlives the tests that started it (tests/e2e, tests/docs)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

OPFUSE = str(Path(sys.executable).with_name("opfuse"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def opfuse_serve(
    workdir: Path, home: Path, ready_s: float = 90.0
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """(the `opfuse serve` process, its URL, its log) once /readyz answers and the API key is
    written; the environment's OPFUSE_* settings are left out, kernels run in the interpreter."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPFUSE_")}
    env.update(OPFUSE_HOME=str(home), OPFUSE_PORT=str(port), TRITON_INTERPRET="1")
    log_path = workdir / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [OPFUSE, "serve"], cwd=workdir, env=env, stdout=log, stderr=log, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            assert proc.poll() is None, f"opfuse serve exited early:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"opfuse serve not ready:\n{log_path.read_text()[-4000:]}"
            try:
                ready = httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                ready = False
            if ready and (home / "api_key").is_file():
                break
            time.sleep(0.3)
        yield proc, url, log_path
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `opfuse serve` (it stops its API and worker), then SIGKILL to its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
