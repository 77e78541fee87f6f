"""Health, readiness, metrics, error responses and structured logs."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from service.logging import JsonFormatter, request_id_var

from .conftest import Keys, bearer, create_job


def test_healthz_and_readyz(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200


def test_readyz_is_503_without_a_database(client: TestClient) -> None:
    app: FastAPI = client.app  # type: ignore[assignment]
    working = app.state.engine
    app.state.engine = create_engine(
        "postgresql+psycopg://nobody@127.0.0.1:1/none", connect_args={"connect_timeout": 1}
    )
    try:
        response = client.get("/readyz")
    finally:
        app.state.engine = working
    assert response.status_code == 503
    assert "database unreachable" in response.json()["detail"]
    assert client.get("/healthz").status_code == 200


def test_metrics_count_jobs_and_requests(client: TestClient, keys: Keys, model: dict) -> None:
    create_job(client, keys.user, model["id"])
    create_job(client, keys.user, model["id"])
    text = client.get("/metrics").text
    assert 'opfuse_jobs{status="queued"} 2.0' in text
    assert 'opfuse_jobs{status="running"} 0.0' in text
    assert "opfuse_queue_depth 2.0" in text
    assert 'opfuse_http_requests_total{method="POST",route="/v1/jobs",status="202"} 2.0' in text
    assert 'route="/v1/models/{model_id}"' not in text  # labels are route templates, never raw ids


def test_unhandled_error_is_a_json_500_and_serving_goes_on(client: TestClient, caplog) -> None:
    app: FastAPI = client.app  # type: ignore[assignment]

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("kaboom")

    with caplog.at_level(logging.ERROR, logger="opfuse.service.http"):
        response = client.get("/boom", headers={"X-Request-ID": "req-123"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "req-123"
    assert "req-123" in response.json()["detail"]
    assert any(r.exc_info and "kaboom" in str(r.exc_info[1]) for r in caplog.records)
    assert client.get("/healthz").status_code == 200


def test_unknown_route_and_method_are_json(client: TestClient, keys: Keys) -> None:
    assert client.get("/v1/nothing", headers=bearer(keys.user)).json() == {"detail": "Not Found"}
    assert client.put("/v1/models", headers=bearer(keys.user)).status_code == 405


def test_log_lines_are_json_with_request_and_job_ids() -> None:
    record = logging.LogRecord("opfuse.service.queue", logging.INFO, __file__, 1, "job claimed", (), None)
    record.job_id = "abc"
    token = request_id_var.set("req-9")
    try:
        line = JsonFormatter().format(record)
    finally:
        request_id_var.reset(token)
    entry = json.loads(line)
    assert entry["msg"] == "job claimed" and entry["job_id"] == "abc" and entry["request_id"] == "req-9"
    assert entry["level"] == "info" and entry["ts"].endswith("+00:00")


class _JsonLines(logging.Handler):
    """Formats each record as it is logged (the request's bound fields are live only then)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


def test_job_stages_workers_and_logs_are_observed(client: TestClient, keys: Keys, model: dict) -> None:
    from .test_worker import Worker, bundle

    job = create_job(client, keys.user, model["id"])
    worker = Worker(client, keys.worker, worker_id="gpu-7")
    token = worker.claim().json()["lease_token"]
    lines = _JsonLines()
    logger = logging.getLogger("opfuse.service")
    logger.addHandler(lines)
    previous_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        for stage in ("profiling", "profiling", "verifying"):
            assert worker.heartbeat(job["id"], token, stage=stage).status_code == 200
    finally:
        logger.removeHandler(lines)
        logger.setLevel(previous_level)
    worker.artifact(job["id"], token, bundle())
    assert worker.complete(job["id"], token).status_code == 200

    beats = [line for line in lines.lines if line["msg"] == "request"]
    assert len(beats) == 3
    assert all(line["job_id"] == job["id"] and line["worker_id"] == "gpu-7" for line in beats)

    text = client.get("/metrics").text
    for stage in ("loading", "profiling", "verifying"):  # each ended once (the last at completion)
        assert f'opfuse_job_stage_duration_seconds_count{{stage="{stage}"}} 1.0' in text
    assert 'opfuse_job_duration_seconds_count{status="succeeded"} 1.0' in text
    assert 'opfuse_worker_last_seen_timestamp_seconds{worker_id="gpu-7"}' in text
    for name in (
        "opfuse_jobs{",
        "opfuse_queue_depth",
        "opfuse_http_requests_total",
        "opfuse_webhook_deliveries",
    ):
        assert name in text, name
