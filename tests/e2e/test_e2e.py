"""End to end, as a user types it: `opfuse serve` (API + worker processes) on a free port with a
temp OPFUSE_HOME, driven by the `opfuse` console script: submit --wait, download, run the bundle
and compare with onnxruntime, errors users see, then SIGTERM and a clean exit of both processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest

from tests.builders import conv_bn_relu, residual_mlp
from tests.serving import OPFUSE, opfuse_serve

pytestmark = pytest.mark.e2e


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    home: Path
    workdir: Path
    url: str
    log_path: Path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPFUSE_")}
        env["OPFUSE_HOME"] = str(self.home)
        return env

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [OPFUSE, *args], cwd=self.workdir, env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def cli_json(self, *args: str, timeout: float = 300) -> Any:
        result = self.cli(*args, "--json", timeout=timeout)
        assert result.returncode == 0, f"opfuse {' '.join(args)} failed:\n{result.stderr}"
        return json.loads(result.stdout)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    workdir = tmp_path_factory.mktemp("e2e")
    home = workdir / "home"
    with opfuse_serve(workdir, home) as (proc, url, log_path):
        yield Served(proc, home, workdir, url, log_path)


def _rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))


def _submit_download_run(served: Served, model: onnx.ModelProto, name: str, x_shape: tuple[int, ...]) -> None:
    path = served.workdir / f"{name}.onnx"
    onnx.save(model, path)
    shape = "x".join(str(d) for d in x_shape)
    submitted = served.cli_json("submit", str(path), "--shape", f"x={shape}", "--wait")
    job = submitted["job"]
    assert job["status"] == "succeeded", job.get("error")
    job_id = job["id"]

    report = served.cli_json("report", job_id)
    assert report["kernels"]["after"] < report["kernels"]["before"], report["kernels"]
    assert report["verification"]["passed"] is True
    human = served.cli("report", job_id)
    assert human.returncode == 0 and "fusion groups" in human.stdout

    bundle = served.workdir / f"{name}.opfuse.zip"
    downloaded = served.cli_json("download", job_id, "-o", str(bundle))
    assert Path(downloaded["path"]) == bundle and bundle.is_file()

    import onnxruntime as ort

    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(7).standard_normal(x_shape).astype(np.float32)
    np.savez(served.workdir / f"{name}_in.npz", x=x)
    out_path = served.workdir / f"{name}_out.npz"
    ran = served.cli_json(
        "run", str(bundle), "--inputs", str(served.workdir / f"{name}_in.npz"), "-o", str(out_path)
    )
    ref = reference.run(None, {"x": x})[0]
    assert ran["outputs"]["y"]["shape"] == list(ref.shape)
    assert _rel_l2(np.load(out_path)["y"], ref) <= 1e-4


def test_residual_mlp_end_to_end(served: Served) -> None:
    _submit_download_run(served, residual_mlp(hidden=32, ffn=64), "mlp", (2, 32))


def test_conv_bn_relu_end_to_end(served: Served) -> None:
    _submit_download_run(served, conv_bn_relu(channels=3, out_channels=8, size=8), "conv", (2, 3, 8, 8))


def test_listing_and_status(served: Served) -> None:
    jobs = served.cli_json("jobs")
    assert len(jobs) >= 2 and all(j["status"] == "succeeded" for j in jobs)
    assert served.cli_json("status", jobs[0]["id"])["id"] == jobs[0]["id"]
    assert len(served.cli_json("models")) >= 2


def test_errors_users_see(served: Served) -> None:
    garbage = served.workdir / "garbage.onnx"
    garbage.write_bytes(b"this is not a protobuf \x00\xff" * 10)
    result = served.cli("submit", str(garbage))
    assert result.returncode == 1
    assert "not an ONNX model" in result.stderr and "HTTP 422" in result.stderr
    assert "Traceback" not in result.stderr

    no_key = httpx.get(f"{served.url}/v1/models", timeout=10)
    assert no_key.status_code == 401
    assert "API key" in no_key.json()["detail"]
    bad_key = served.cli("models", "--key", "opf_not_a_key")
    assert bad_key.returncode == 1 and "HTTP 401" in bad_key.stderr

    bad_shape = served.cli("submit", str(garbage), "--shape", "x=2xq")
    assert bad_shape.returncode == 2 and "'q' is not a whole number" in bad_shape.stderr


def test_sigterm_stops_server_and_worker(served: Served) -> None:
    workers = [pid for pid in _children(served.proc.pid) if _alive(pid)]
    assert workers, "opfuse serve should run a worker child"
    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(20) == 0, served.log_path.read_text()[-4000:]
    deadline = t0 + 20
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "the worker outlived the server"
    assert time.monotonic() - t0 < 20
    assert not (served.home / "server.json").exists()
