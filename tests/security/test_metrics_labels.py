"""/metrics stays bounded whatever clients send: every label value of every metric comes from a
fixed set (standard methods else "other", route templates never raw paths, real status codes,
the stage and status enums, a bounded number of worker names)."""

from __future__ import annotations

import random
import string

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.models import JobStatus, Stage
from tests.service.conftest import Keys, bearer

MAX_WORKERS_SHOWN = 256  # documented in docs/api.md (service.metrics.MAX_WORKERS_SHOWN)
METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}


def _junk(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=n))


def _labels(client: TestClient) -> tuple[int, dict[str, set[str]]]:
    text = client.get("/metrics").text
    values: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        family.name = family.name.removesuffix("_created")  # a counter's creation time: same labels
        for sample in family.samples:
            for name, value in sample.labels.items():
                if name != "le":  # histogram buckets: fixed by the metric
                    values.setdefault(f"{family.name}.{name}", set()).add(value)
    return len(text.encode()), values


def test_made_up_methods_paths_and_worker_ids_do_not_grow_metrics(client: TestClient, keys: Keys) -> None:
    rng = random.Random(4)
    size_before, _ = _labels(client)
    app = client.app
    routes = {getattr(r, "path", "") for r in app.routes} | set(app.openapi()["paths"])  # type: ignore[attr-defined]
    for i in range(300):
        method = _junk(rng, 12_000) if i % 3 else _junk(rng, 7)  # 12 kB methods, as the probe sent
        path = rng.choice([f"/v1/models/{_junk(rng, 40)}", f"/{_junk(rng, 200)}", f"/v1/jobs/{i}"])
        response = client.request(method, path)
        assert response.status_code in (401, 404, 405), response.status_code
        client.get(f"/v1/jobs/{_junk(rng, 30)}", headers=bearer(keys.user))  # 404 on a templated route
    for i in range(MAX_WORKERS_SHOWN + 44):  # a worker key naming a new worker on every claim
        claim = {"worker_id": f"w{i}-{_junk(rng, 200)}", "device": "cpu"}
        assert client.post("/v1/worker/claim", json=claim, headers=bearer(keys.worker)).status_code == 204
    size_after, labels = _labels(client)
    # Every label value comes from a fixed set.
    for name in ("opfuse_http_requests.method", "opfuse_http_request_duration_seconds.method"):
        assert labels[name] <= METHODS, labels[name] - METHODS
        assert "other" in labels[name]
    for name in ("opfuse_http_requests.route", "opfuse_http_request_duration_seconds.route"):
        assert labels[name] <= routes | {"unmatched"}, labels[name] - routes
    assert all(s.isdigit() and 100 <= int(s) <= 599 for s in labels["opfuse_http_requests.status"])
    assert labels.get("opfuse_jobs.status", set()) <= {s.value for s in JobStatus}
    assert labels.get("opfuse_job_stage_duration_seconds.stage", set()) <= {s.value for s in Stage} | {
        "other"
    }
    workers = labels["opfuse_worker_last_seen_timestamp_seconds.worker_id"]
    assert len(workers) == MAX_WORKERS_SHOWN and all(len(w) <= 255 for w in workers)
    assert f"w{MAX_WORKERS_SHOWN + 43}" in {w.split("-")[0] for w in workers}  # the latest is kept
    known = {
        "opfuse_http_requests.method",
        "opfuse_http_request_duration_seconds.method",
        "opfuse_http_requests.route",
        "opfuse_http_request_duration_seconds.route",
        "opfuse_http_requests.status",
        "opfuse_jobs.status",
        "opfuse_job_stage_duration_seconds.stage",
        "opfuse_job_duration_seconds.status",
        "opfuse_webhook_deliveries.outcome",
        "opfuse_worker_last_seen_timestamp_seconds.worker_id",
    }
    assert set(labels) <= known, set(labels) - known  # a new label must be added (and bounded) here
    # 300 requests with made-up 12 kB methods took the old /metrics from 0.3 MB to 73 MB.
    print(f"/metrics: {size_before} -> {size_after} bytes")
    assert size_after < 200_000, size_after
