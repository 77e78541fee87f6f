"""Prometheus metrics: HTTP requests by route and status, and jobs by status computed at scrape time."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.logging import get_logger
from service.models import Job, JobStatus

log = get_logger("metrics")


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
        self.registry.register(JobsCollector(session_factory))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_duration.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
