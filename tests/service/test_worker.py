"""The worker protocol: claim, model download, heartbeat, artifact, complete/fail, leases, fencing."""

from __future__ import annotations

import hashlib
import json
import threading
from datetime import timedelta

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update

from service import maintenance, queue
from service.clock import utcnow
from service.db import make_engine, make_session_factory
from service.models import Job
from service.settings import Settings

from .bundles import real_bundle
from .conftest import Keys, bearer, create_job
from .onnx_models import mlp, to_bytes

REPORT = {
    "device": {"kind": "cpu-interpreter", "name": "cpu"},
    "precision": "fp32",
    "kernels": {"before": 3, "after": 1},
    "before": {"latency_ms": {"p50": 2.0, "p90": 2.5}, "peak_memory_bytes": 4096},
    "after": {"latency_ms": {"p50": 1.0, "p90": 1.2}, "peak_memory_bytes": 2048},
    "speedup": 2.0,
    "verification": {"passed": True},
}


def bundle() -> bytes:
    """A bundle opfuse made: the API checks an artifact's kernels before it stores it."""
    return real_bundle()


class Worker:
    """A worker talking to the TestClient, as workers/ does over HTTP."""

    def __init__(self, client: TestClient, key: str, worker_id: str = "w1") -> None:
        self.client, self.headers, self.worker_id = client, bearer(key), worker_id

    def claim(self):
        return self.client.post(
            "/v1/worker/claim", json={"worker_id": self.worker_id, "device": "cpu"}, headers=self.headers
        )

    def heartbeat(self, job_id: str, token: str, stage: str | None = "profiling", progress: float = 0.5):
        body = {"lease_token": token, "stage": stage, "progress": progress}
        return self.client.post(f"/v1/worker/jobs/{job_id}/heartbeat", json=body, headers=self.headers)

    def model(self, job_id: str, token: str):
        return self.client.get(
            f"/v1/worker/jobs/{job_id}/model", headers={**self.headers, "Lease-Token": token}
        )

    def artifact(self, job_id: str, token: str, data: bytes):
        headers = {**self.headers, "Lease-Token": token, "Content-Type": "application/zip"}
        return self.client.put(f"/v1/worker/jobs/{job_id}/artifact", content=data, headers=headers)

    def complete(self, job_id: str, token: str, report: dict | None = None):
        body = {"lease_token": token, "report": REPORT if report is None else report}
        # json.dumps, not httpx's json=: a report may carry NaN (Python's json writes it).
        headers = {**self.headers, "Content-Type": "application/json"}
        return self.client.post(
            f"/v1/worker/jobs/{job_id}/complete", content=json.dumps(body), headers=headers
        )

    def fail(self, job_id: str, token: str, error: str = "boom", retryable: bool = False):
        body = {"lease_token": token, "error": error, "retryable": retryable}
        return self.client.post(f"/v1/worker/jobs/{job_id}/fail", json=body, headers=self.headers)


def expire_lease(settings: Settings, job_id: str) -> None:
    """Move the job's lease into the past, as if its worker stopped heartbeating long ago."""
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(
                update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1))
            )
    finally:
        engine.dispose()


def get_job(client: TestClient, keys: Keys, job_id: str) -> dict:
    response = client.get(f"/v1/jobs/{job_id}", headers=bearer(keys.user))
    assert response.status_code == 200
    job: dict = response.json()
    return job


def test_full_protocol(client: TestClient, keys: Keys, model: dict) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    claim = worker.claim()
    assert claim.status_code == 200, claim.text
    claimed = claim.json()
    token = claimed["lease_token"]
    assert claimed["job"]["id"] == job["id"] and claimed["job"]["options"] == job["options"]
    assert claimed["job"]["status"] == "running" and claimed["job"]["stage"] == "loading"
    assert claimed["job"]["attempts"] == 1 and claimed["lease_epoch"] == 1
    assert claimed["model"] == model
    assert worker.claim().status_code == 204  # nothing else queued

    download = worker.model(job["id"], token)
    assert download.status_code == 200
    assert hashlib.sha256(download.content).hexdigest() == model["sha256"]
    assert download.headers["etag"] == f'"{model["sha256"]}"'

    beat = worker.heartbeat(job["id"], token, stage="verifying", progress=0.75)
    assert beat.status_code == 200
    assert beat.json()["cancel"] is False and beat.json()["lease_expires_at"] > claimed["lease_expires_at"]
    running = get_job(client, keys, job["id"])
    assert (running["status"], running["stage"], running["progress"]) == ("running", "verifying", 0.75)

    early = worker.complete(job["id"], token)
    assert early.status_code == 409 and "artifact" in early.json()["detail"]

    data = bundle()
    uploaded = worker.artifact(job["id"], token, data)
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json() == {"sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}

    done = worker.complete(job["id"], token)
    assert done.status_code == 200, done.text
    assert worker.complete(job["id"], token).status_code == 200  # a retried complete is harmless
    final = get_job(client, keys, job["id"])
    assert final["status"] == "succeeded" and final["stage"] is None and final["progress"] == 1
    assert final["finished_at"] is not None and final["error"] is None
    assert final["summary"] == {
        "speedup": 2.0,
        "latency_ms_before": 2.0,
        "latency_ms_after": 1.0,
        "kernels_before": 3,
        "kernels_after": 1,
        "peak_memory_before": 4096,
        "peak_memory_after": 2048,
    }
    assert client.get(f"/v1/jobs/{job['id']}/report", headers=bearer(keys.user)).json() == REPORT
    artifact = client.get(f"/v1/jobs/{job['id']}/artifact", headers=bearer(keys.user))
    assert artifact.status_code == 200 and artifact.content == data
    assert artifact.headers["content-type"] == "application/zip"
    assert artifact.headers["etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert worker.heartbeat(job["id"], token).status_code == 409  # finished: the lease is over


def test_partial_report_leaves_summary_fields_null(client: TestClient, keys: Keys, model: dict) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    token = worker.claim().json()["lease_token"]
    worker.artifact(job["id"], token, bundle())
    report = {"speedup": float("nan"), "kernels": {"before": 3}, "before": None}
    assert worker.complete(job["id"], token, report).status_code == 200
    summary = get_job(client, keys, job["id"])["summary"]
    stored = client.get(f"/v1/jobs/{job['id']}/report", headers=bearer(keys.user)).json()
    assert stored == {"speedup": None, "kernels": {"before": 3}, "before": None}
    assert summary["kernels_before"] == 3
    assert (
        summary["speedup"] is None
        and summary["latency_ms_before"] is None
        and summary["kernels_after"] is None
    )


def test_stale_token_changes_nothing(client: TestClient, keys: Keys, model: dict, settings: Settings) -> None:
    worker, other = Worker(client, keys.worker, "w1"), Worker(client, keys.worker, "w2")
    job = create_job(client, keys.user, model["id"])
    stale = worker.claim().json()["lease_token"]
    expire_lease(settings, job["id"])
    fresh = other.claim().json()
    assert fresh["job"]["id"] == job["id"] and fresh["lease_epoch"] == 2
    before = get_job(client, keys, job["id"])

    for response in (
        worker.heartbeat(job["id"], stale, stage="packaging", progress=0.9),
        worker.model(job["id"], stale),
        worker.artifact(job["id"], stale, bundle()),
        worker.complete(job["id"], stale),
        worker.fail(job["id"], stale),
        worker.heartbeat(job["id"], "made-up-token"),
        worker.heartbeat(job["id"], "tökén"),
    ):
        assert response.status_code == 409, response.text
        assert "not leased to you" in response.json()["detail"]
    assert get_job(client, keys, job["id"]) == before
    assert other.heartbeat(job["id"], fresh["lease_token"]).status_code == 200


def test_expired_leases_requeue_until_max_attempts(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    for attempt in (1, 2, 3):
        claimed = worker.claim().json()
        assert claimed["job"]["id"] == job["id"] and claimed["job"]["attempts"] == attempt
        expire_lease(settings, job["id"])
        app: FastAPI = client.app  # type: ignore[assignment]
        changed = maintenance.requeue_expired_leases(app.state.session_factory)  # the periodic task
        assert changed == 1
        state = get_job(client, keys, job["id"])
        if attempt < 3:
            assert (state["status"], state["attempts"], state["stage"]) == ("queued", attempt, None)
    assert state["status"] == "failed"
    assert state["error"].startswith("lease expired 3 times; the worker running it stopped heartbeating")
    assert worker.claim().status_code == 204


def test_claim_requeues_expired_leases_itself(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    worker.claim()
    expire_lease(settings, job["id"])
    again = worker.claim()
    assert again.status_code == 200 and again.json()["job"]["attempts"] == 2


def test_fail_retryable_requeues_then_gives_up(client: TestClient, keys: Keys, model: dict) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    for attempt in (1, 2):
        token = worker.claim().json()["lease_token"]
        failed = worker.fail(job["id"], token, error="CUDA out of memory", retryable=True)
        assert failed.status_code == 200
        assert failed.json()["status"] == "queued" and failed.json()["attempts"] == attempt
        assert "CUDA out of memory" in failed.json()["error"]
    token = worker.claim().json()["lease_token"]
    last = worker.fail(job["id"], token, error="CUDA out of memory", retryable=True).json()
    assert last["status"] == "failed" and "gave up after 3 attempts" in last["error"]


def test_fail_not_retryable_fails_at_once(client: TestClient, keys: Keys, model: dict) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    token = worker.claim().json()["lease_token"]
    failed = worker.fail(job["id"], token, error="unsupported op Loop", retryable=False).json()
    assert (failed["status"], failed["error"], failed["attempts"]) == ("failed", "unsupported op Loop", 1)
    assert failed["finished_at"] is not None


def test_cancel_of_a_running_job_goes_through_the_worker(client: TestClient, keys: Keys, model: dict) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    token = worker.claim().json()["lease_token"]
    canceled = client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(keys.user)).json()
    assert canceled["status"] == "running" and canceled["cancel_requested"] is True
    assert worker.heartbeat(job["id"], token).json()["cancel"] is True
    assert (
        worker.fail(job["id"], token, error="canceled by user", retryable=True).json()["status"] == "canceled"
    )
    assert get_job(client, keys, job["id"])["finished_at"] is not None


def test_cancel_requested_and_lease_expired_is_canceled(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    worker.claim()
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(keys.user))
    expire_lease(settings, job["id"])
    assert worker.claim().status_code == 204
    assert get_job(client, keys, job["id"])["status"] == "canceled"


def test_artifact_must_be_a_zip(client: TestClient, keys: Keys, model: dict) -> None:
    worker = Worker(client, keys.worker)
    job = create_job(client, keys.user, model["id"])
    token = worker.claim().json()["lease_token"]
    response = worker.artifact(job["id"], token, b"not a zip at all")
    assert response.status_code == 422 and "zip" in response.json()["detail"]
    wrong_type = client.put(
        f"/v1/worker/jobs/{job['id']}/artifact",
        content=bundle(),
        headers={**bearer(keys.worker), "Lease-Token": token, "Content-Type": "text/plain"},
    )
    assert wrong_type.status_code == 415


def test_claims_take_the_oldest_job_first(client: TestClient, keys: Keys, model: dict) -> None:
    worker = Worker(client, keys.worker)
    other_model = client.post(
        "/v1/models",
        content=to_bytes(mlp()),
        headers={**bearer(keys.other), "Content-Type": "application/octet-stream"},
    ).json()
    first = create_job(client, keys.user, model["id"])
    second = create_job(client, keys.other, other_model["id"])  # workers are fleet-wide
    assert worker.claim().json()["job"]["id"] == first["id"]
    assert worker.claim().json()["job"]["id"] == second["id"]


def test_concurrent_claims_never_share_a_job(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    job_ids = {create_job(client, keys.user, model["id"])["id"] for _ in range(12)}
    engine = make_engine(settings.database_url)
    factory = make_session_factory(engine)
    claimed: list[str] = []
    lock = threading.Lock()

    def claim_until_empty(worker_id: str) -> None:
        while True:
            with factory.begin() as session:
                job = queue.claim_job(session, worker_id, "cpu", 30, utcnow())
                job_id = job.id if job else None
            if job_id is None:
                return
            with lock:
                claimed.append(job_id)

    threads = [threading.Thread(target=claim_until_empty, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    engine.dispose()
    assert sorted(claimed) == sorted(job_ids)
