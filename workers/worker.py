"""The opfuse worker: claim a job over HTTP, run the pipeline in a killable child, heartbeat, upload.

    python -m workers.worker --api http://127.0.0.1:8000 --key-file .opfuse/worker_key [--gpu 0] [--once]

A job never takes the worker down: a model error fails the job for good, a crash or internal error
fails the attempt as retryable, and the worker goes on to the next job. SIGTERM/SIGINT stop it
cleanly: the running child is killed and its job handed back (retryable) for another worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TypeVar

from client.config import ConfigError, opfuse_home, read_key_file, resolve_url
from client.sdk import (
    Claim,
    LeaseLostError,
    OpfuseAPIError,
    OpfuseClient,
    OpfuseClientError,
    OpfuseConnectionError,
)
from workers.child import PipelineProcess, describe_exit
from workers.logs import JobLog, setup_logging

T = TypeVar("T")

DEFAULT_JOB_TIMEOUT_S = 1800.0
PIPELINE_ARGV = (sys.executable, "-m", "workers.pipeline")


@dataclass
class WorkerConfig:
    api_url: str
    api_key: str
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    gpu: int | None = None
    job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S
    once: bool = False
    idle_min_s: float = 0.5  # claim backoff while the queue is empty
    idle_max_s: float = 5.0
    heartbeat_s: float | None = None  # default: a third of the lease
    pipeline_argv: Sequence[str] = PIPELINE_ARGV
    work_root: Path | None = None  # where per-job temp dirs go; default the system temp dir


def detect_device(gpu: int | None = None) -> str:
    """`cuda:N (name)` for the GPU this worker uses, or `cpu` (the Triton interpreter)."""
    # No NVIDIA device nodes and no CUDA_VISIBLE_DEVICES: skip importing torch (seconds) to learn "cpu".
    if not (
        os.path.exists("/dev/nvidiactl")
        or os.path.exists("/dev/dxg")
        or os.environ.get("CUDA_VISIBLE_DEVICES")
    ):
        return "cpu"
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    index = gpu if gpu is not None else 0
    try:
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    except Exception:  # a bad --gpu index; the pipeline will say so on the first job
        return f"cuda:{index}"


def _lease_seconds(expires_at: str | None) -> float | None:
    if not expires_at:
        return None
    try:
        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return (when - datetime.now(UTC)).total_seconds()


class Worker:
    """Claims and runs jobs until stopped (or after one job with `once`)."""

    def __init__(self, config: WorkerConfig, client: OpfuseClient | None = None) -> None:
        self.config = config
        self.client = client or OpfuseClient(config.api_url, config.api_key, timeout=60.0)
        self.device = detect_device(config.gpu)
        self.log = JobLog(logging.getLogger("opfuse.worker"), {"worker_id": config.worker_id})
        self._stop = threading.Event()

    # -- lifecycle --------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to finish: the running job is handed back and run() returns."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> int:
        """The claim loop. Returns the process exit code (0, or 2 when the API refuses our key)."""
        self.log.info("worker started", extra={"api": self.client.api_url, "device": self.device})
        idle = self.config.idle_min_s
        unreachable_since: float | None = None
        while not self.stopping:
            try:
                claim = self.client.claim(self.config.worker_id, self.device)
            except OpfuseAPIError as exc:
                if exc.status in (401, 403):
                    self.log.error(
                        "the API refused the worker key; pass a key with scope `worker` "
                        "(--key-file $OPFUSE_HOME/worker_key)",
                        extra={"status": exc.status, "detail": exc.detail},
                    )
                    return 2
                self.log.warning("claim failed", extra={"status": exc.status, "detail": exc.detail})
                self._stop.wait(idle)
                idle = min(idle * 2, self.config.idle_max_s)
                continue
            except OpfuseConnectionError as exc:
                if unreachable_since is None:
                    unreachable_since = time.monotonic()
                    self.log.warning("API unreachable; retrying", extra={"error": str(exc)})
                self._stop.wait(idle)
                idle = min(idle * 2, self.config.idle_max_s)
                continue
            except Exception:  # e.g. a proxy answering HTML: keep the worker alive and try again
                self.log.exception("claim failed unexpectedly; retrying")
                self._stop.wait(self.config.idle_max_s)
                continue
            if unreachable_since is not None:
                self.log.info(
                    "API reachable again", extra={"down_s": round(time.monotonic() - unreachable_since, 1)}
                )
                unreachable_since = None
            if claim is None:
                if self.config.once:
                    self.log.info("queue empty; exiting (--once)")
                    break
                self._stop.wait(idle)
                idle = min(idle * 2, self.config.idle_max_s)
                continue
            idle = self.config.idle_min_s
            self.handle(claim)
            if self.config.once:
                break
        self.log.info("worker stopped")
        return 0

    def handle(self, claim: Claim) -> str:
        """Run one claimed job to its end; never raises. Returns the outcome, for logs and tests."""
        job_id = str(claim["job"]["id"])
        log = self.log.bind(job_id=job_id)
        token = claim["lease_token"]
        workdir: Path | None = None
        try:
            log.info("job claimed", extra={"attempt": claim["job"].get("attempts")})
            # mkdtemp makes it mode 0700: the model is the user's.
            workdir = Path(tempfile.mkdtemp(prefix=f"opfuse-job-{job_id[:12]}-", dir=self.config.work_root))
            return self._run_job(claim, workdir, log)
        except LeaseLostError:
            log.warning("lease lost; dropping the job")
            return "lease_lost"
        except OpfuseAPIError as exc:
            # e.g. 404: the model was deleted since the claim. Another attempt would see the same.
            log.error("the server refused a job call", extra={"status": exc.status, "detail": exc.detail})
            retryable = exc.status >= 500 or exc.status in (401, 403, 429)
            self._fail(
                job_id,
                token,
                f"the server refused a worker call ({exc.status}): {exc.detail}",
                retryable,
                log,
            )
            return "failed"
        except Exception as exc:
            log.exception("job handling failed inside the worker")
            self._fail(job_id, token, f"internal error in the worker: {type(exc).__name__}: {exc}", True, log)
            return "failed"
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    # -- one job ----------------------------------------------------------------------------

    def _run_job(self, claim: Claim, workdir: Path, log: JobLog) -> str:
        job = claim["job"]
        job_id, token = str(job["id"]), claim["lease_token"]
        model_path = workdir / "model.onnx"
        out = workdir / "out"
        self._with_retries(lambda: self.client.download_model(job_id, token, model_path), log)

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.config.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.config.gpu)
        if self.device == "cpu":
            env.setdefault("TRITON_INTERPRET", "1")  # no GPU: the kernels run in Triton's interpreter
        options = job.get("options") or {}
        argv = [
            *self.config.pipeline_argv,
            "--model",
            str(model_path),
            "--options-json",
            json.dumps(options),
            "--out",
            str(out),
        ]
        child = PipelineProcess(argv, env, workdir)
        log.info("pipeline started", extra={"pid": child.pid})
        try:
            outcome = self._supervise(
                child, job_id, token, _lease_seconds(claim.get("lease_expires_at")), log
            )
            if outcome is not None:
                return outcome
            return self._finish(child, job_id, token, out, log)
        finally:
            if child.poll() is None:
                child.kill()
            child.close()

    def _heartbeat_interval(self, lease_s: float | None) -> float:
        if self.config.heartbeat_s is not None:
            return self.config.heartbeat_s
        if lease_s is None or lease_s <= 0:
            return 10.0
        return min(max(lease_s / 3.0, 1.0), 30.0)

    def _supervise(
        self, child: PipelineProcess, job_id: str, token: str, lease_s: float | None, log: JobLog
    ) -> str | None:
        """Heartbeat while the child runs. None when it exited by itself, else why it was stopped."""
        interval = self._heartbeat_interval(lease_s)
        started = time.monotonic()
        deadline = started + self.config.job_timeout_s
        next_beat = started  # the first heartbeat marks the job as started right away
        last_beat = 0.0
        sent: tuple[str | None, float] | None = None  # the last state a heartbeat delivered
        logged: tuple[str | None, float] | None = None
        while child.poll() is None:
            now = time.monotonic()
            if self.stopping:
                child.kill()
                log.info("worker stopping; handing the job back")
                self._fail(
                    job_id,
                    token,
                    f"worker {self.config.worker_id} shut down while running the job; it will be retried",
                    True,
                    log,
                )
                return "stopped"
            if now >= deadline:
                rc = child.kill()
                log.warning("job timed out", extra={"limit_s": self.config.job_timeout_s, "returncode": rc})
                self._fail(
                    job_id,
                    token,
                    f"the job ran longer than this worker's limit of {self.config.job_timeout_s:g} s "
                    "and was stopped; try smaller input shapes, or ask the operator to raise --job-timeout",
                    False,
                    log,
                )
                return "timeout"
            latest = child.latest()
            if latest != logged and latest[0] is not None:
                log.info("stage", extra={"stage": latest[0], "progress": latest[1]})
                logged = latest
            if now >= next_beat or (latest != sent and now - last_beat >= 1.0):
                try:
                    answer = self.client.heartbeat(job_id, token, latest[0], latest[1])
                except LeaseLostError:
                    child.kill()
                    log.warning("lease lost (409); the child is killed and the job dropped")
                    return "lease_lost"
                except OpfuseAPIError as exc:
                    if exc.status == 404:  # the job is gone (its model was deleted)
                        child.kill()
                        log.warning("job no longer exists; the child is killed", extra={"detail": exc.detail})
                        return "lease_lost"
                    log.warning(
                        "heartbeat refused; retrying", extra={"status": exc.status, "detail": exc.detail}
                    )
                    next_beat = now + min(interval, 2.0)
                except OpfuseClientError as exc:
                    log.warning("heartbeat failed; retrying", extra={"error": str(exc)})
                    next_beat = now + min(interval, 2.0)
                else:
                    sent, last_beat = latest, now
                    lease_left = _lease_seconds(answer.get("lease_expires_at"))
                    if self.config.heartbeat_s is None and lease_left:
                        interval = self._heartbeat_interval(lease_left)
                    next_beat = now + interval
                    if answer.get("cancel"):
                        child.kill()
                        log.info("canceled by the user; child killed")
                        self._fail(job_id, token, "canceled by user", False, log)
                        return "canceled"
            child.changed.wait(0.2)
            child.changed.clear()
        return None

    def _finish(self, child: PipelineProcess, job_id: str, token: str, out: Path, log: JobLog) -> str:
        """The child exited on its own: upload and complete, or fail with its reason."""
        rc = child.wait()
        report_path, bundle_path, error_path = out / "report.json", out / "bundle.zip", out / "error.json"
        if rc == 0 and report_path.is_file() and bundle_path.is_file():
            report = json.loads(report_path.read_text())
            log.info("uploading artifact", extra={"bytes": bundle_path.stat().st_size})
            try:
                self._with_retries(lambda: self.client.upload_artifact(job_id, token, bundle_path), log)
                self._with_retries(lambda: self.client.complete(job_id, token, report), log)
            except LeaseLostError:
                raise
            except OpfuseAPIError as exc:
                log.error("the server refused the result", extra={"status": exc.status, "detail": exc.detail})
                self._fail(
                    job_id, token, f"the server refused the result ({exc.status}): {exc.detail}", False, log
                )
                return "failed"
            log.info(
                "job succeeded", extra={"speedup": report.get("speedup"), "kernels": report.get("kernels")}
            )
            return "succeeded"
        if error_path.is_file():
            try:
                error = json.loads(error_path.read_text())
                message, kind = str(error["error"]), str(error.get("kind", "internal"))
            except (ValueError, KeyError, TypeError):
                message, kind = "internal error: the pipeline wrote an unreadable error.json", "internal"
            retryable = kind != "model"
            log.info("job failed", extra={"kind": kind, "error": message, "retryable": retryable})
            self._fail(job_id, token, message, retryable, log)
            return "failed"
        reason = f"internal error: the pipeline process {describe_exit(rc)}"
        if rc == 0:
            reason = "internal error: the pipeline process exited without writing a bundle and report"
        tail = child.stderr_tail()
        if tail:
            reason += f"; last output:\n{tail}"
        log.warning("pipeline crashed", extra={"returncode": rc, "stderr_tail": tail})
        self._fail(job_id, token, reason, True, log)
        return "crashed"

    # -- server calls that must get through -------------------------------------------------

    def _with_retries(self, call: Callable[[], T], log: JobLog, attempts: int = 5) -> T:
        """Retry a call through connection errors and 5xx answers (the server may be restarting)."""
        delay = 1.0
        for attempt in range(1, attempts + 1):
            try:
                return call()
            except LeaseLostError:
                raise
            except (OpfuseConnectionError, OpfuseAPIError) as exc:
                transient = isinstance(exc, OpfuseConnectionError) or exc.status >= 500
                if not transient or attempt == attempts:
                    raise
                log.warning("server call failed; retrying", extra={"error": str(exc), "attempt": attempt})
                time.sleep(delay)
                delay = min(delay * 2, 8.0)
        raise AssertionError("unreachable")

    def _fail(self, job_id: str, token: str, error: str, retryable: bool, log: JobLog) -> None:
        try:
            self._with_retries(lambda: self.client.fail(job_id, token, error, retryable), log, attempts=3)
        except LeaseLostError:
            log.info("fail not recorded: the lease is gone (the job was canceled or re-queued)")
        except OpfuseClientError as exc:
            log.error("could not report the failure; the lease will expire", extra={"error": str(exc)})


def install_signal_handlers(worker: Worker) -> None:
    """SIGTERM/SIGINT: stop after handing back the running job (a second one exits at once)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if worker.stopping:
            os._exit(128 + signum)
        worker.log.info("signal received; stopping", extra={"signal": signal.Signals(signum).name})
        worker.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def resolve_worker_key(key: str | None, key_file: str | None) -> str | None:
    """--key, then --key-file, then OPFUSE_WORKER_KEY, then $OPFUSE_HOME/worker_key."""
    if key:
        return key
    if key_file:
        return read_key_file(key_file)
    if os.environ.get("OPFUSE_WORKER_KEY"):
        return os.environ["OPFUSE_WORKER_KEY"]
    default = opfuse_home() / "worker_key"
    return read_key_file(default) if default.is_file() else None


def worker_config(
    api: str | None, key: str | None, key_file: str | None, worker_id: str | None, gpu: int | None
) -> WorkerConfig:
    """A WorkerConfig from command-line values; ConfigError says what is missing."""
    api_url, _ = resolve_url(api)
    api_key = resolve_worker_key(key, key_file)
    if api_key is None:
        raise ConfigError(
            "no worker key: pass --key or --key-file, set OPFUSE_WORKER_KEY, or run where "
            f"{opfuse_home()}/worker_key exists (`opfuse serve` writes it)"
        )
    config = WorkerConfig(api_url=api_url, api_key=api_key, gpu=gpu)
    if worker_id:
        config.worker_id = worker_id
    return config


def run_worker(config: WorkerConfig) -> int:
    """Run a worker in this process until SIGTERM/SIGINT (or one job with `once`)."""
    setup_logging()
    worker = Worker(config)
    install_signal_handlers(worker)
    try:
        return worker.run()
    finally:
        worker.client.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--api", help="API URL (default: OPFUSE_API_URL or $OPFUSE_HOME/server.json)")
    parser.add_argument("--key", help="worker API key (scope worker)")
    parser.add_argument(
        "--key-file", help="file holding the worker API key (default $OPFUSE_HOME/worker_key)"
    )
    parser.add_argument("--worker-id", help="a name for this worker in the job records (default host-pid)")
    parser.add_argument("--gpu", type=int, help="GPU index to use (default: the first, or CPU if none)")
    parser.add_argument(
        "--once", action="store_true", help="run one job and exit (at once if none is queued)"
    )
    parser.add_argument(
        "--job-timeout", type=float, default=DEFAULT_JOB_TIMEOUT_S, help="wall-time limit per job, seconds"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = worker_config(args.api, args.key, args.key_file, args.worker_id, args.gpu)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config.once = args.once
    config.job_timeout_s = args.job_timeout
    return run_worker(config)


if __name__ == "__main__":
    sys.exit(main())
