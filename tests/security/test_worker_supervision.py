"""`opfuse serve` left its worker dead when it died (killed, out of memory): jobs waited forever.
It now supervises it: the worker child is started again (with backoff, each restart said on
stderr) and a job submitted afterwards still completes. Against the real `opfuse serve`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import onnx

from tests.e2e.test_e2e import _alive, _children
from tests.service.onnx_models import mlp
from tests.serving import OPFUSE, free_port


def _worker_pid(serve_pid: int) -> int | None:
    for pid in _children(serve_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"workers.worker" in cmdline and _alive(pid):
            return pid
    return None


def _wait_for(what: str, check, timeout_s: float, log: Path):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout_s:g} s; serve log:\n{log.read_text()[-4000:]}")


def test_a_killed_worker_is_restarted_and_jobs_still_complete(tmp_path: Path) -> None:
    home, port, log_path = tmp_path / "home", free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPFUSE_")}
    env.update(OPFUSE_HOME=str(home), OPFUSE_PORT=str(port), TRITON_INTERPRET="1")
    with log_path.open("wb") as log:
        proc = subprocess.Popen([OPFUSE, "serve"], cwd=tmp_path, env=env, stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return (
                    httpx.get(f"{url}/readyz", timeout=2).status_code == 200 and (home / "api_key").is_file()
                )
            except httpx.TransportError:
                return False

        _wait_for("opfuse serve ready", ready, 120, log_path)
        first = _wait_for("the worker started", lambda: _worker_pid(proc.pid), 120, log_path)
        os.kill(first, signal.SIGKILL)
        second = _wait_for(
            "a new worker",
            lambda: (p := _worker_pid(proc.pid)) is not None and p != first and p,
            60,
            log_path,
        )
        assert second != first and proc.poll() is None
        assert "restarting it" in log_path.read_text()

        model = tmp_path / "mlp.onnx"
        onnx.save(mlp(), model)
        done = subprocess.run(
            [OPFUSE, "submit", str(model), "--shape", "x=8x4", "--wait", "--json"],
            cwd=tmp_path,
            env={**env, "OPFUSE_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=540,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["job"]["status"] == "succeeded"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
