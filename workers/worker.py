"""The opfuse worker: claim a job over HTTP, run the pipeline in a killable child, heartbeat, upload.

    python -m workers.worker --api http://127.0.0.1:8000 --key-file .opfuse/worker_key [--gpu 0] [--once]

One worker per GPU (`--gpu N`); it reports its device when it claims, and the API hands it only
jobs whose target is that device's kind or `any`. Each job runs in a child process under a
wall-time limit (--job-timeout) and a memory limit (--job-memory-gb), and checks the untrusted
model against node-count, depth and tensor-size limits before compiling it (workers.limits).

A job never takes the worker down: a model error, running out of memory or time, or a
deterministic internal error (a bug in opfuse) fails the job for good; a crash (a signal, a native
error) or a fault of the host (file system, GPU driver) fails the attempt as retryable, and the
worker goes on to the next job. Calls to the API are retried with backoff through outages
(a restarting server) for up to --api-retry seconds. SIGTERM/SIGINT stop it cleanly: the running
child is killed and its job handed back (retryable) for another worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TypeVar

from client.config import ConfigError
from client.sdk import (
    Claim,
    LeaseLostError,
    OpfuseAPIError,
    OpfuseClient,
    OpfuseClientError,
    OpfuseConnectionError,
)
from workers.child import (
    ForkedPipeline,
    PipelineHandle,
    PipelineProcess,
    describe_exit,
    start_forkserver,
    warm_forkserver,
)
from workers.config import PIPELINE_ARGV, WorkerConfig, build_parser, worker_config
from workers.devices import choose_device
from workers.job_dirs import make_job_dir, remove_job_dir, sweep_stale_job_dirs
from workers.logs import JobLog, setup_logging
from workers.pipeline import limits_json

T = TypeVar("T")


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
        self.device_choice = config.device or choose_device(config.gpu)
        self.device = self.device_choice.device
        self.child_env = self.device_choice.child_env(dict(os.environ, PYTHONUNBUFFERED="1"))
        self._forked = config.forkserver and tuple(config.pipeline_argv) == PIPELINE_ARGV
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
        self.log.info(
            "worker started",
            extra={
                "api": self.client.api_url,
                "device": self.device,
                "job_timeout_s": self.config.job_timeout_s,
                "job_memory_bytes": self.config.job_memory_bytes,
            },
        )
        stale = sweep_stale_job_dirs(self.config.work_root)
        if stale:
            self.log.warning(
                "removed job directories of a worker that died mid-job",
                extra={"count": len(stale), "paths": [str(p) for p in stale]},
            )
        if self._forked and not self._start_forkserver():
            return 0  # stopped while the forkserver was starting
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
        lock_fd: int | None = None
        try:
            log.info("job claimed", extra={"attempt": claim["job"].get("attempts")})
            workdir, lock_fd = make_job_dir(job_id, self.config.work_root)
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
            # Every way out of here removes it; a killed worker's is swept at the next start.
            if workdir is not None:
                remove_job_dir(workdir, lock_fd)

    # -- one job ----------------------------------------------------------------------------

    def _run_job(self, claim: Claim, workdir: Path, log: JobLog) -> str:
        job = claim["job"]
        job_id, token = str(job["id"]), claim["lease_token"]
        model_path = workdir / "model.onnx"
        out = workdir / "out"
        lease_s = _lease_seconds(claim.get("lease_expires_at"))
        interval = self._heartbeat_interval(lease_s)

        options = job.get("options") or {}
        args = [
            "--model",
            str(model_path),
            "--options-json",
            json.dumps(options),
            "--out",
            str(out),
            "--limits-json",
            limits_json(self.config.model_limits),
        ]
        if self.config.job_memory_bytes:
            args += ["--memory-limit-bytes", str(self.config.job_memory_bytes)]
        # A big model's download can outlast a lease: heartbeat through it.
        with self._lease_kept(job_id, token, "loading", 0.0, interval, log):
            self._with_retries(lambda: self.client.download_model(job_id, token, model_path), log)
            child = self._start_child(args, workdir, log)
        log.info("pipeline started", extra={"pid": child.pid, "forked": isinstance(child, ForkedPipeline)})
        try:
            outcome = self._supervise(child, job_id, token, lease_s, log)
            if outcome is not None:
                return outcome
            with self._lease_kept(job_id, token, "packaging", 1.0, interval, log):
                return self._finish(child, job_id, token, out, log)
        finally:
            if child.poll() is None:
                child.kill()
            child.close()

    def _start_forkserver(self) -> bool:
        """Start the forkserver and wait until it has imported torch and opfuse (seconds), so that
        no claimed job waits on it; False if the worker was stopped meanwhile."""
        if not start_forkserver(self.child_env):
            self.log.warning("the forkserver runs for another device; jobs start as new processes")
            self._forked = False
            return True
        ready = threading.Event()
        started = time.monotonic()

        def warm() -> None:
            try:
                warm_forkserver()
            except Exception as exc:
                self.log.warning("forkserver failed; jobs start as new processes", extra={"error": str(exc)})
                self._forked = False
            ready.set()

        threading.Thread(target=warm, name="forkserver-warmup", daemon=True).start()
        while not ready.wait(0.2):
            if self.stopping:
                return False
        self.log.info("forkserver ready", extra={"seconds": round(time.monotonic() - started, 1)})
        return True

    @contextlib.contextmanager
    def _lease_kept(
        self, job_id: str, token: str, stage: str, progress: float, interval: float, log: JobLog
    ) -> Iterator[None]:
        """Heartbeat on a thread while the block runs (downloads, uploads: no child to watch)."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self.client.heartbeat(job_id, token, stage, progress)
                except LeaseLostError:
                    log.warning("lease lost (409) while transferring; the next call will say so")
                    return
                except OpfuseClientError as exc:
                    log.warning("heartbeat failed; retrying", extra={"error": str(exc)})

        keeper = threading.Thread(target=beat, name="lease-keeper", daemon=True)
        keeper.start()
        try:
            yield
        finally:
            stop.set()
            keeper.join(timeout=5)

    def _start_child(self, args: list[str], workdir: Path, log: JobLog) -> PipelineHandle:
        if self._forked:
            try:
                return ForkedPipeline(args, workdir)
            except (OSError, EOFError, ValueError) as exc:  # the forkserver is gone or broken
                log.warning("forkserver failed; starting the job as a new process", extra={"error": str(exc)})
        return PipelineProcess([*self.config.pipeline_argv, *args], self.child_env, workdir)

    def _heartbeat_interval(self, lease_s: float | None) -> float:
        if self.config.heartbeat_s is not None:
            return self.config.heartbeat_s
        if lease_s is None or lease_s <= 0:
            return 10.0
        return min(max(lease_s / 3.0, 1.0), 30.0)

    def _supervise(
        self, child: PipelineHandle, job_id: str, token: str, lease_s: float | None, log: JobLog
    ) -> str | None:
        """Heartbeat while the child runs. None when it exited by itself, else why it was stopped."""
        interval = self._heartbeat_interval(lease_s)
        started = time.monotonic()
        deadline = started + self.config.job_timeout_s
        next_beat = started  # the first heartbeat marks the job as started right away
        last_beat = 0.0  # when a heartbeat was last sent, answered or not
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
                last_beat = now
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
                    sent = latest
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

    def _finish(self, child: PipelineHandle, job_id: str, token: str, out: Path, log: JobLog) -> str:
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
            # The same model fails the same way again: a model error, memory, a bug in opfuse
            # (kind "bug"); only a host fault ("internal") is worth another attempt.
            retryable = kind not in ("model", "memory", "bug")
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

    def _with_retries(self, call: Callable[[], T], log: JobLog, window_s: float | None = None) -> T:
        """Retry a call through connection errors, 5xx and 429 answers (the server may be
        restarting or busy) with jittered exponential backoff, for up to `window_s` (default
        --api-retry); then the last error is raised. A refusal (4xx) is raised at once."""
        deadline = time.monotonic() + (self.config.api_retry_s if window_s is None else window_s)
        delay = 0.25
        attempt = 0
        while True:
            attempt += 1
            try:
                return call()
            except LeaseLostError:
                raise
            except (OpfuseConnectionError, OpfuseAPIError) as exc:
                transient = isinstance(exc, OpfuseConnectionError) or exc.status >= 500 or exc.status == 429
                pause = delay * random.uniform(0.5, 1.0)
                if not transient or time.monotonic() + pause > deadline:
                    raise
                log.warning("server call failed; retrying", extra={"error": str(exc), "attempt": attempt})
                time.sleep(pause)
                delay = min(delay * 2, 5.0)

    def _fail(self, job_id: str, token: str, error: str, retryable: bool, log: JobLog) -> None:
        try:
            self._with_retries(lambda: self.client.fail(job_id, token, error, retryable), log)
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


def run_worker(config: WorkerConfig) -> int:
    """Run a worker in this process until SIGTERM/SIGINT (or one job with `once`)."""
    setup_logging()
    worker = Worker(config)
    install_signal_handlers(worker)
    try:
        return worker.run()
    finally:
        worker.client.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = worker_config(
            args.api,
            args.key,
            args.key_file,
            args.worker_id,
            args.gpu,
            once=args.once,
            job_timeout_s=args.job_timeout,
            job_memory_gb=args.job_memory_gb,
            max_nodes=args.max_nodes,
            max_depth=args.max_depth,
            api_retry_s=args.api_retry,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_worker(config)


if __name__ == "__main__":
    sys.exit(main())
