"""The worker against a real API server (a subprocess on a free port, SQLite in a temp OPFUSE_HOME),
over real HTTP, running the real pipeline child: success, a model error, a crashing child, cancel,
timeout, shutdown mid-job, and the worker as its own process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
from client.sdk import Claim, Job, OpfuseClient
from workers.config import WorkerConfig
from workers.worker import Worker

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 16


@dataclass
class Server:
    url: str
    user_key: str
    worker_key: str
    proc: subprocess.Popen[bytes]

    def user(self) -> OpfuseClient:
        return OpfuseClient(self.url, self.user_key)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("opfuse-home")
    env = dict(
        os.environ,
        OPFUSE_HOME=str(home),
        OPFUSE_PORT="0",
        OPFUSE_HOST="127.0.0.1",
        OPFUSE_LEASE_SECONDS="6",
        OPFUSE_MAX_ATTEMPTS="2",
        OPFUSE_REQUEUE_INTERVAL_SECONDS="1",
        OPFUSE_LOG_LEVEL="WARNING",
    )
    env.pop("OPFUSE_DATABASE_URL", None)
    log = (home / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        url = _wait_for_server(home, proc)
        yield Server(
            url=url,
            user_key=(home / "api_key").read_text().strip(),
            worker_key=(home / "worker_key").read_text().strip(),
            proc=proc,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _wait_for_server(home: Path, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the API server exited with {proc.returncode}: {(home / 'server.log').read_text()}"
            )
        try:
            info = json.loads((home / "server.json").read_text())
            if (
                info.get("pid") == proc.pid
                and httpx.get(info["url"] + "/readyz", timeout=2).status_code == 200
            ):
                return str(info["url"])
        except (OSError, ValueError, httpx.TransportError):
            pass
        time.sleep(0.2)
    raise RuntimeError("the API server did not become ready in time")


# -- models ---------------------------------------------------------------------------------------


def mlp_model(path: Path) -> Path:
    """x[batch, 16] → MatMul + Add → Relu → Mul(b): a GEMM with a pointwise epilogue."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["a"]),
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node("Mul", ["r", "b"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", HIDDEN])],
        [
            numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) * 0.3).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def unsupported_model(path: Path) -> Path:
    """A valid ONNX model with an op of a custom domain, which opfuse never runs: a ModelError."""
    graph = helper.make_graph(
        [
            helper.make_node("Frobnicate", ["x"], ["d"], domain="com.example"),
            helper.make_node("Relu", ["d"], ["y"]),
        ],
        "custom_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)]
    )
    model.ir_version = 9
    onnx.save(model, path)
    return path


# -- pipelines the tests swap in (the real pipeline, with a fault injected around it) ---------------

_WRAPPER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import workers.pipeline as pipeline

real = pipeline.run_pipeline

def run_pipeline(model, options, out, progress, *limits):
    def hooked(stage, frac):
        progress(stage, frac)
        if stage == {stage!r}:
{action}
    return real(model, options, out, hooked, *limits)

pipeline.run_pipeline = run_pipeline
with open(os.path.join(os.path.dirname(sys.argv[sys.argv.index("--out") + 1]), "child.pid"), "w") as f:
    f.write(str(os.getpid()))
sys.exit(pipeline.main(sys.argv[1:]))
"""

CRASH = """\
print("simulated native crash in codegen", file=sys.stderr, flush=True)
os._exit(3)"""
HANG = "time.sleep(120)"


def faulty_pipeline(tmp_path: Path, stage: str, action: str) -> list[str]:
    script = tmp_path / f"pipeline_{stage}.py"
    script.write_text(_WRAPPER.format(repo=str(REPO), stage=stage, action=textwrap.indent(action, " " * 12)))
    return [sys.executable, str(script)]


# -- running a worker on a thread -----------------------------------------------------------------


@dataclass
class RunningWorker:
    worker: Worker
    thread: threading.Thread
    outcomes: list[str]
    work_root: Path

    def child_pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.work_root.glob("*/child.pid") if p.read_text()]


StartWorker = Callable[..., RunningWorker]


@pytest.fixture
def start_worker(server: Server, tmp_path: Path) -> Iterator[StartWorker]:
    running: list[RunningWorker] = []

    def start(pipeline_argv: Sequence[str] | None = None, **overrides: object) -> RunningWorker:
        work_root = tmp_path / f"work{len(running)}"
        work_root.mkdir()
        config = WorkerConfig(
            api_url=server.url,
            api_key=server.worker_key,
            worker_id=f"test-worker-{len(running)}",
            idle_min_s=0.1,
            idle_max_s=0.5,
            heartbeat_s=0.5,
            work_root=work_root,
        )
        if pipeline_argv is not None:
            config.pipeline_argv = list(pipeline_argv)
        for key, value in overrides.items():
            setattr(config, key, value)
        worker = Worker(config)
        outcomes: list[str] = []
        handle = worker.handle

        def recording_handle(claim: Claim) -> str:
            outcome = handle(claim)
            outcomes.append(outcome)
            return outcome

        worker.handle = recording_handle  # type: ignore[method-assign]
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        rw = RunningWorker(worker, thread, outcomes, work_root)
        running.append(rw)
        return rw

    yield start
    for rw in running:
        rw.worker.stop()
        rw.thread.join(30)
        rw.worker.client.close()


def submit(server: Server, model: Path, shapes: dict[str, list[int]] | None = None) -> Job:
    with server.user() as client:
        uploaded = client.upload_model(model)
        return client.create_job(str(uploaded["id"]), input_shapes=shapes)


def wait(server: Server, job: Job, timeout_s: float = 120.0) -> Job:
    with server.user() as client:
        return client.wait_job(str(job["id"]), poll_s=0.2, timeout_s=timeout_s)


def wait_until(predicate: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- tests ----------------------------------------------------------------------------------------


def test_success_uploads_bundle_and_report(server: Server, start_worker: StartWorker, tmp_path: Path) -> None:
    model = mlp_model(tmp_path / "mlp.onnx")
    job = submit(server, model, {"x": [2, HIDDEN]})
    start_worker()
    done = wait(server, job)
    assert done["status"] == "succeeded", done.get("error")
    assert done["attempts"] == 1
    summary = done["summary"] or {}
    assert summary["kernels_after"] < summary["kernels_before"]

    with server.user() as client:
        report = client.get_report(str(job["id"]))
        got = client.download_artifact(str(job["id"]), tmp_path / "bundle.zip")
    assert report["verification"]["passed"] is True
    assert report["device"]["kind"] in ("cpu-interpreter", "cuda")
    cm = opfuse.load(got.path, device="cpu")
    x = np.random.default_rng(3).standard_normal((2, HIDDEN)).astype(np.float32)
    import onnxruntime as ort

    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = np.asarray(cm.run({"x": x})["y"])
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 1e-4


def test_model_error_fails_job_and_worker_goes_on(
    server: Server, start_worker: StartWorker, tmp_path: Path
) -> None:
    bad = submit(server, unsupported_model(tmp_path / "custom_op.onnx"))
    good = submit(server, mlp_model(tmp_path / "mlp.onnx"), {"x": [3, HIDDEN]})
    rw = start_worker()
    bad_done, good_done = wait(server, bad), wait(server, good)

    assert bad_done["status"] == "failed"
    assert bad_done["attempts"] == 1, "a model error is the user's to fix: no retry"
    assert "com.example::Frobnicate" in (bad_done["error"] or "")
    assert "does not support" in (bad_done["error"] or "")
    assert good_done["status"] == "succeeded", good_done.get("error")
    wait_until(lambda: len(rw.outcomes) == 2, 10)
    assert rw.outcomes == ["failed", "succeeded"]
    assert rw.thread.is_alive()


def test_crashing_child_fails_attempt_with_readable_reason(
    server: Server, start_worker: StartWorker, tmp_path: Path
) -> None:
    job = submit(server, mlp_model(tmp_path / "mlp.onnx"), {"x": [2, HIDDEN]})
    rw = start_worker(faulty_pipeline(tmp_path, "codegen", CRASH))
    done = wait(server, job)
    assert done["status"] == "failed"
    assert done["attempts"] == 2, "a crash is retried (max_attempts=2 on this server)"
    error = done["error"] or ""
    assert "the pipeline process exited with code 3" in error
    assert "simulated native crash in codegen" in error  # the child's last stderr lines
    assert "gave up after 2 attempts" in error
    wait_until(lambda: len(rw.outcomes) == 2, 10)
    assert rw.outcomes == ["crashed", "crashed"]
    assert rw.thread.is_alive()


@pytest.mark.parametrize("stage", ["fusing", "codegen"])
def test_a_bug_in_opfuse_fails_the_job_once_and_says_so(
    stage: str, server: Server, start_worker: StartWorker, tmp_path: Path
) -> None:
    """A deterministic internal error fails the same way on every attempt: it is not retried,
    and the error says it is a bug in opfuse, with the exception's type and message."""
    job = submit(server, mlp_model(tmp_path / "mlp.onnx"), {"x": [2, HIDDEN]})
    action = f'raise TypeError("simulated bug in {stage}")'
    rw = start_worker(faulty_pipeline(tmp_path, stage, action))
    done = wait(server, job)
    assert done["status"] == "failed"
    assert done["attempts"] == 1, "a bug fails every attempt alike: no retry"
    error = done["error"] or ""
    assert "a bug in opfuse" in error and f"TypeError: simulated bug in {stage}" in error
    assert "Traceback" not in error
    wait_until(lambda: len(rw.outcomes) == 1, 10)
    assert rw.outcomes == ["failed"] and rw.thread.is_alive()


def test_only_host_faults_count_as_retryable() -> None:
    from workers.pipeline import is_host_fault

    assert is_host_fault(OSError(28, "No space left on device"))
    assert is_host_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_host_fault(ValueError("input of shape (2,) varies along only part of the row"))
    assert not is_host_fault(StopIteration())
    assert not is_host_fault(KeyError("k3"))


def test_cancel_kills_the_running_child(server: Server, start_worker: StartWorker, tmp_path: Path) -> None:
    job = submit(server, mlp_model(tmp_path / "mlp.onnx"), {"x": [2, HIDDEN]})
    rw = start_worker(faulty_pipeline(tmp_path, "verifying", HANG))
    with server.user() as client:
        wait_until(lambda: client.get_job(str(job["id"])).get("stage") == "verifying")
        pids = rw.child_pids()
        assert pids and all(_pid_alive(p) for p in pids)
        t0 = time.monotonic()
        client.cancel_job(str(job["id"]))
        done = client.wait_job(str(job["id"]), poll_s=0.2, timeout_s=30)
    assert done["status"] == "canceled"
    assert time.monotonic() - t0 < 15
    wait_until(lambda: rw.outcomes == ["canceled"], 10)
    assert not any(_pid_alive(p) for p in pids)
    assert rw.thread.is_alive()


def test_job_timeout_kills_child_and_fails(server: Server, start_worker: StartWorker, tmp_path: Path) -> None:
    job = submit(server, mlp_model(tmp_path / "mlp.onnx"), {"x": [2, HIDDEN]})
    rw = start_worker(faulty_pipeline(tmp_path, "verifying", HANG), job_timeout_s=8.0)
    done = wait(server, job, timeout_s=60)
    assert done["status"] == "failed"
    assert "longer than this worker's limit of 8 s" in (done["error"] or "")
    wait_until(lambda: len(rw.outcomes) == 1, 10)
    assert rw.outcomes == ["timeout"]


def test_stop_mid_job_hands_it_back(server: Server, start_worker: StartWorker, tmp_path: Path) -> None:
    job = submit(server, mlp_model(tmp_path / "mlp.onnx"), {"x": [2, HIDDEN]})
    rw = start_worker(faulty_pipeline(tmp_path, "verifying", HANG))
    with server.user() as client:
        wait_until(lambda: client.get_job(str(job["id"])).get("stage") == "verifying")
        pids = rw.child_pids()
        rw.worker.stop()
        rw.thread.join(20)
        assert not rw.thread.is_alive()
        back = client.get_job(str(job["id"]))
        assert back["status"] == "queued", back
        assert "shut down while running the job" in (back["error"] or "")
        assert not any(_pid_alive(p) for p in pids)
        client.cancel_job(str(job["id"]))  # leave the queue empty for the next test


def test_worker_process_once_and_json_logs(server: Server, tmp_path: Path) -> None:
    job = submit(server, mlp_model(tmp_path / "mlp.onnx"), {"x": [2, HIDDEN]})
    key_file = tmp_path / "worker_key"
    key_file.write_text(server.worker_key + "\n")
    proc = subprocess.run(
        [
            sys.executable, "-m", "workers.worker", "--api", server.url, "--key-file", str(key_file),
            "--worker-id", "proc-worker", "--once",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    logs = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert logs and all(entry["worker_id"] == "proc-worker" for entry in logs)
    assert any(entry.get("job_id") == job["id"] and entry["msg"] == "job succeeded" for entry in logs)
    assert wait(server, job)["status"] == "succeeded"


def test_worker_process_exits_on_sigterm_and_bad_key(server: Server, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "workers.worker", "--api", server.url]
    proc = subprocess.Popen([*argv, "--key", server.worker_key], cwd=REPO, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # wait until it polls the queue
        if '"worker started"' in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0

    bad = subprocess.run([*argv, "--key", "opf_wrong"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "refused the worker key" in bad.stderr

    missing = subprocess.run(
        [*argv, "--key-file", str(tmp_path / "nope")], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr
