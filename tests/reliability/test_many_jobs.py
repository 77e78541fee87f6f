"""Four workers draining forty jobs: each job is claimed once, completed once, and has exactly one
bundle; no two workers ever run the same job (SKIP LOCKED on PostgreSQL, the conditional update on
SQLite).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from client.sdk import OpfuseClient

from .harness import (
    ApiServer,
    WorkerPool,
    mlp_model,
    model_bytes,
    query,
    record_jobs,
    stored_bundle_count,
    submit_jobs,
    upload,
    wait_all,
    wait_until,
)

pytestmark = pytest.mark.e2e

WORKERS = 4
JOBS = 40
# Four pipelines at once on two cores: a lease that no heartbeat misses for want of CPU.
SERVER_SETTINGS = {"OPFUSE_LEASE_SECONDS": "15"}


@pytest.fixture(autouse=True)
def _postgres_only(database_url: str) -> None:
    # The heaviest reliability runs go against PostgreSQL only, to keep `make test` short; SQLite's
    # claim path is covered by tests/service (concurrent claims) and the other modules here.
    if database_url.startswith("sqlite"):
        pytest.skip("run against PostgreSQL only")


def test_four_workers_forty_jobs_each_once(
    server: ApiServer, user: OpfuseClient, workers: WorkerPool, tmp_path: Path
) -> None:
    bundles_before = stored_bundle_count(server.database_url)
    model_id = upload(user, model_bytes(mlp_model(seed=21)), tmp_path / "mlp.onnx")
    pool = workers.start_many([f"w{i}" for i in range(WORKERS)])
    t0 = time.monotonic()
    jobs = submit_jobs(user, model_id, JOBS)

    done = wait_all(user, jobs, timeout_s=400)
    elapsed = time.monotonic() - t0
    record_jobs(done)
    failed = [(j["id"], j.get("error")) for j in done if j["status"] != "succeeded"]
    assert not failed, f"{failed}\n{workers.diagnostics()}"
    assert all(j["attempts"] == 1 for j in done), [j["attempts"] for j in done]

    ids = [str(j["id"]) for j in done]

    def completes() -> Counter[str]:
        return Counter(e["job_id"] for w in pool for e in w.events("job succeeded"))

    # A worker logs a completion just after the API recorded it.
    wait_until(lambda: sum(completes().values()) >= JOBS, 10, "the workers to log every completion")
    claims = Counter(e["job_id"] for w in pool for e in w.events("job claimed"))
    completed = completes()
    assert all(claims[i] == 1 for i in ids), "a job was claimed twice"
    assert all(completed[i] == 1 for i in ids), "a job was completed twice"
    assert sum(completed.values()) == JOBS
    busy = [w.name for w in pool if w.events("job succeeded")]
    assert len(busy) >= 2, f"the jobs were spread over the workers (only {busy} ran any)"

    artifacts = query(
        server.database_url,
        "SELECT id, artifact_sha256 FROM jobs WHERE model_id = :model_id",
        model_id=model_id,
    )
    shas = [sha for _, sha in artifacts]
    assert len(shas) == JOBS and all(shas) and len(set(shas)) == JOBS, "one distinct bundle per job"
    assert stored_bundle_count(server.database_url) - bundles_before == JOBS
    print(f"{JOBS} jobs on {WORKERS} workers in {elapsed:.0f} s")
