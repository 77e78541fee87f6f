"""Real processes for the reliability tests: the API server (`opfuse serve --no-worker`) and workers
(`opfuse worker`) as subprocesses on a free port, a fresh database for each test module (SQLite
file or a new PostgreSQL database), tiny models, and the figures the suite reports at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from sqlalchemy import create_engine, text

from client.sdk import Job, OpfuseClient

OPFUSE = str(Path(sys.executable).with_name("opfuse"))
REPO = Path(__file__).resolve().parents[2]
HIDDEN = 8
# A job of a few seconds in the interpreter (the tiny one takes well under one): for faults that
# must land while a job runs.
SLOW_HIDDEN, SLOW_BATCH = 128, 2048


# -- figures for the closing summary -------------------------------------------------------------


@dataclass
class Figures:
    faults: Counter[str] = field(default_factory=Counter)  # fault → times survived
    jobs_run: int = 0  # jobs that reached an end (succeeded or failed with a reason)
    jobs_succeeded: int = 0
    jobs_lost: int = 0  # jobs that never ended or ended twice
    bad_inputs: Counter[str] = field(default_factory=Counter)  # "refused (4xx)" / "failed job"
    uploads: int = 0
    fuzz_requests: int = 0

    def summary(self) -> str:
        faults = ", ".join(f"{name} ×{n}" for name, n in sorted(self.faults.items())) or "none"
        bad = sum(self.bad_inputs.values())
        how = ", ".join(f"{n} {k}" for k, n in sorted(self.bad_inputs.items()))
        return (
            f"faults survived: {sum(self.faults.values())} ({faults}); "
            f"jobs run: {self.jobs_run} ({self.jobs_succeeded} succeeded exactly once); "
            f"bad inputs tried: {bad} ({how or 'none'}); uploads: {self.uploads}; "
            f"schema-fuzz requests: {self.fuzz_requests}; jobs lost: {self.jobs_lost}"
        )


FIGURES = Figures()


def record_jobs(jobs: list[Job]) -> None:
    """Count finished jobs into FIGURES (a job not finished counts as lost)."""
    for job in jobs:
        if job.get("status") in ("succeeded", "failed"):
            FIGURES.jobs_run += 1
            FIGURES.jobs_succeeded += job.get("status") == "succeeded"
        else:
            FIGURES.jobs_lost += 1


# -- polling -------------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    """Poll until `predicate()` is truthy (and return it); AssertionError naming `what` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; waits for it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- databases (throw-away PostgreSQL databases: tests/postgres.py) -----------------------------


def query(database_url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(text(sql), params)]
    finally:
        engine.dispose()


def stored_bundle_count(database_url: str) -> int:
    """Blobs stored that are no model's bytes: the bundles workers uploaded (content-addressed, and
    every bundle differs: its manifest has a creation time)."""
    rows = query(
        database_url,
        "SELECT COUNT(*) FROM blobs WHERE sha256 NOT IN (SELECT blob_key FROM models)",
    )
    return int(rows[0][0])


# -- the API server ------------------------------------------------------------------------------


@dataclass
class ApiServer:
    """`opfuse serve --no-worker` in a subprocess, on a fixed free port (so it can restart there)."""

    home: Path
    database_url: str
    settings: dict[str, str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.home / "server.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPFUSE_")}
        env.update(
            OPFUSE_HOME=str(self.home),
            OPFUSE_DATABASE_URL=self.database_url,
            OPFUSE_HOST="127.0.0.1",
            OPFUSE_PORT=str(self.port),
            OPFUSE_LOG_LEVEL="INFO",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.settings)
        return env

    def start(self, timeout_s: float = 90.0) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [OPFUSE, "serve", "--no-worker"],
                cwd=self.home,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        self.starts += 1
        proc = self.proc

        def ready() -> bool:
            assert proc.poll() is None, f"the API server exited early:\n{self.log_tail()}"
            try:
                return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, timeout_s, "the API server to answer /readyz", poll_s=0.2)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def restart(self) -> float:
        """SIGTERM the server, start it again on the same port and database; returns seconds down."""
        t0 = time.monotonic()
        self.stop()
        self.start()
        return time.monotonic() - t0

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def rss_kib(self) -> dict[str, int]:
        """VmRSS and VmHWM of the server process, KiB."""
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        out = {}
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
        return out

    @property
    def admin_key(self) -> str:
        return (self.home / "api_key").read_text().strip()

    @property
    def worker_key_file(self) -> Path:
        return self.home / "worker_key"

    def make_key(self, tenant: str, scope: str = "user") -> str:
        response = httpx.post(
            f"{self.url}/v1/admin/api-keys",
            json={"tenant": tenant, "scope": scope},
            headers={"Authorization": f"Bearer {self.admin_key}"},
            timeout=30,
        )
        assert response.status_code in (200, 201), response.text
        return str(response.json()["key"])

    def client(self, key: str) -> OpfuseClient:
        return OpfuseClient(self.url, key, timeout=120)


# -- workers -------------------------------------------------------------------------------------


@dataclass
class WorkerProcess:
    """`opfuse worker` in a subprocess; its JSON log lines go to a file we read back."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def logs(self) -> list[dict[str, Any]]:
        entries = []
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        for line in lines:
            if line.startswith("{"):
                try:
                    entries.append(json.loads(line))
                except ValueError:
                    continue
        return entries

    def events(self, msg: str, job_id: str | None = None) -> list[dict[str, Any]]:
        return [
            e for e in self.logs() if e.get("msg") == msg and (job_id is None or e.get("job_id") == job_id)
        ]

    def alive(self) -> bool:
        return _alive(self.proc)


class WorkerPool:
    """Starts `opfuse worker` processes against a server; kills every one at teardown."""

    def __init__(self, server: ApiServer, root: Path) -> None:
        self.server = server
        self.root = root
        self.workers: list[WorkerProcess] = []

    def start(self, name: str | None = None) -> WorkerProcess:
        """One worker, ready to run a job (its forkserver has imported torch and opfuse)."""
        [worker] = self.start_many([name or f"worker-{len(self.workers)}"])
        return worker

    def start_many(self, names: list[str]) -> list[WorkerProcess]:
        """Start the workers at once, then wait until each is ready."""
        started = [self._spawn(name) for name in names]
        for worker in started:

            def ready(worker: WorkerProcess = worker) -> bool:
                return bool(worker.events("forkserver ready")) or not worker.alive()

            wait_until(ready, 120, f"{worker.name} to be ready")
            assert worker.alive(), f"{worker.name} exited at start:\n{worker.log_path.read_text()[-3000:]}"
        return started

    def _spawn(self, name: str) -> WorkerProcess:
        log_path = self.root / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPFUSE_")}
        env.update(PYTHONUNBUFFERED="1", TRITON_INTERPRET="1")
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [
                    OPFUSE, "worker", "--api", self.server.url, "--key-file", str(self.server.worker_key_file),
                    "--worker-id", name, "--job-timeout", "120", "--job-memory-gb", "4", "--api-retry", "60",
                ],
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )  # fmt: skip
        worker = WorkerProcess(name, proc, log_path)
        self.workers.append(worker)
        return worker

    def holder_of(self, job_id: str) -> WorkerProcess | None:
        """The live worker whose log says it claimed `job_id` last."""
        for worker in self.workers:
            if worker.alive() and worker.events("job claimed", job_id):
                return worker
        return None

    def completions(self, job_id: str) -> int:
        """How many workers logged completing the job, once at least one has: a worker logs it
        just after the API recorded it, so a test may see the job succeeded a moment earlier."""

        def count() -> int:
            return sum(len(w.events("job succeeded", job_id)) for w in self.workers)

        wait_until(count, 10, f"a worker to log that it completed {job_id}")
        return count()

    def diagnostics(self, lines: int = 25) -> str:
        """The end of every worker's log and the server's, for a failing assertion's message."""
        parts = []
        for worker in self.workers:
            try:
                tail = worker.log_path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                tail = []
            parts.append(f"--- {worker.name} (alive: {worker.alive()})\n" + "\n".join(tail))
        parts.append("--- server\n" + self.server.log_tail())
        return "\n".join(parts)

    def stop_all(self) -> None:
        for worker in self.workers:
            stop_process(worker.proc, grace_s=10)


# -- models --------------------------------------------------------------------------------------


def mlp_model(seed: int = 0, hidden: int = HIDDEN) -> onnx.ModelProto:
    """x[batch, hidden] → MatMul + Add → Relu: the smallest model with a fusion in it."""
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["a"]),
            helper.make_node("Relu", ["a"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        [
            numpy_helper.from_array((rng.standard_normal((hidden, hidden)) * 0.3).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def slow_model(seed: int = 0) -> onnx.ModelProto:
    """The MLP at SLOW_HIDDEN; run it with input_shapes SLOW_SHAPES."""
    return mlp_model(seed, hidden=SLOW_HIDDEN)


SLOW_SHAPES = {"x": [SLOW_BATCH, SLOW_HIDDEN]}


def model_bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()


def upload(client: OpfuseClient, data: bytes, path: Path) -> str:
    path.write_bytes(data)
    return str(client.upload_model(path)["id"])


def submit_jobs(client: OpfuseClient, model_id: str, count: int, **options: Any) -> list[Job]:
    return [client.create_job(model_id, input_shapes={"x": [2, HIDDEN]}, **options) for _ in range(count)]


def wait_all(client: OpfuseClient, jobs: list[Job], timeout_s: float) -> list[Job]:
    """Poll until every job has ended; returns them in the same order."""
    ids = [str(j["id"]) for j in jobs]
    done: dict[str, Job] = {}

    def all_done() -> bool:
        for job_id in ids:
            if job_id not in done:
                job = client.get_job(job_id)
                if job.get("status") in ("succeeded", "failed", "canceled"):
                    done[job_id] = job
        return len(done) == len(ids)

    wait_until(all_done, timeout_s, f"{len(ids) - len(done)} of {len(ids)} jobs to end", poll_s=0.3)
    return [done[i] for i in ids]
