"""Prometheus metrics: HTTP requests, jobs by status and queue depth (counted in the database at
scrape time), job and stage durations (observed as jobs move), workers' last contact.

Durations are observed where jobs change (service.queue), but only counted once the change is
committed: code records them with `record_stage` / `record_job`, and the request (or background
task) that made the change applies them after its transaction with `Metrics.collecting()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.logging import get_logger
from service.models import Job, JobStatus, Stage

log = get_logger("metrics")

# Stages run from milliseconds (loading a small model) to tens of minutes (tuning a big one).
DURATION_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, float("inf"))
WORKER_FORGET_SECONDS = 24 * 3600
# Every label value comes from a fixed set, whatever a client sends: a method outside the standard
# ones is "other", a path is its route template ("unmatched" when none), a status is its code when
# it is a real HTTP code (100-599), else "other"; stages and job statuses are the enums' values.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
STAGES = frozenset(stage.value for stage in Stage)
JOB_STATUSES = frozenset(status.value for status in JobStatus)
# Workers are named by their hosts; a worker key could name thousands. The most recently seen ones
# are kept, each name cut to its schema's length.
MAX_WORKERS_SHOWN = 256
MAX_WORKER_ID_CHARS = 255


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else "other"


def status_label(status: int) -> str:
    return str(status) if 100 <= status <= 599 else "other"


# (kind, label, seconds) observations waiting for their transaction to commit.
_pending: ContextVar[list[tuple[str, str, float]] | None] = ContextVar("opfuse_pending_metrics", default=None)


def record_stage(stage: str, seconds: float) -> None:
    """A job's stage ended after `seconds` (counted if the current transaction commits)."""
    pending = _pending.get()
    if pending is not None:
        pending.append(("stage", stage, max(seconds, 0.0)))


def record_job(status: str, seconds: float) -> None:
    """A job ended with `status`, `seconds` after it was created."""
    pending = _pending.get()
    if pending is not None:
        pending.append(("job", status, max(seconds, 0.0)))


class JobsCollector(Collector):
    """Counts jobs by status in the database each time /metrics is scraped."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory

    def describe(self) -> Iterable[Metric]:
        # Names only, so registering does not query the database.
        return [
            GaugeMetricFamily("opfuse_jobs", "Jobs by status", labels=["status"]),
            GaugeMetricFamily("opfuse_queue_depth", "Jobs waiting for a worker"),
        ]

    def collect(self) -> Iterable[Metric]:
        try:
            with self._session_factory() as session:
                rows = session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
        except Exception:
            log.exception("cannot count jobs for /metrics")
            return []
        counts = {status: int(count) for status, count in rows}
        jobs = GaugeMetricFamily("opfuse_jobs", "Jobs by status", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status.value, 0))
        depth = GaugeMetricFamily(
            "opfuse_queue_depth", "Jobs waiting for a worker", value=counts.get(JobStatus.QUEUED.value, 0)
        )
        return [jobs, depth]


class WorkersCollector(Collector):
    """When this API process last heard from each worker (claims and heartbeats)."""

    NAME = "opfuse_worker_last_seen_timestamp_seconds"
    HELP = "Unix time of a worker's last claim or heartbeat seen by this API process"

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def seen(self, worker_id: str) -> None:
        with self._lock:
            self._seen.pop(worker_id[:MAX_WORKER_ID_CHARS], None)  # re-insert: the dict stays in seen order
            self._seen[worker_id[:MAX_WORKER_ID_CHARS]] = time.time()
            while len(self._seen) > MAX_WORKERS_SHOWN:
                del self._seen[next(iter(self._seen))]  # the least recently seen

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=["worker_id"])]

    def collect(self) -> Iterable[Metric]:
        cutoff = time.time() - WORKER_FORGET_SECONDS
        with self._lock:
            for worker_id in [w for w, t in self._seen.items() if t < cutoff]:
                del self._seen[worker_id]
            seen = sorted(self._seen.items())
        gauge = GaugeMetricFamily(self.NAME, self.HELP, labels=["worker_id"])
        for worker_id, when in seen:
            gauge.add_metric([worker_id], when)
        return [gauge]


class Metrics:
    """One registry per app (tests build many apps in one process)."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "opfuse_http_requests",
            "HTTP requests served",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "opfuse_http_request_duration_seconds",
            "Time to serve a request",
            ["method", "route"],
            registry=self.registry,
        )
        self.stage_duration = Histogram(
            "opfuse_job_stage_duration_seconds",
            "Time a job spent in a pipeline stage, from the stage changes its worker's heartbeats report",
            ["stage"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.job_duration = Histogram(
            "opfuse_job_duration_seconds",
            "Time from a job's creation to its end, by how it ended",
            ["status"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.webhooks = Counter(
            "opfuse_webhook_deliveries",
            "Webhook delivery attempts by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.workers = WorkersCollector()
        self.registry.register(JobsCollector(session_factory))
        self.registry.register(self.workers)

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        method = method_label(method)
        self.http_requests.labels(method, route, status_label(status)).inc()
        self.http_duration.labels(method, route).observe(seconds)

    @contextmanager
    def collecting(self) -> Iterator[list[tuple[str, str, float]]]:
        """Gather record_stage/record_job calls made inside; the caller applies them with `apply`
        once it knows the transaction committed."""
        pending: list[tuple[str, str, float]] = []
        token = _pending.set(pending)
        try:
            yield pending
        finally:
            _pending.reset(token)

    def apply(self, pending: list[tuple[str, str, float]]) -> None:
        for kind, label, seconds in pending:
            histogram = self.stage_duration if kind == "stage" else self.job_duration
            known = STAGES if kind == "stage" else JOB_STATUSES
            histogram.labels(label if label in known else "other").observe(seconds)
        pending.clear()

    def render(self) -> bytes:
        return generate_latest(self.registry)
