"""The API going away under running jobs: restarted mid-job (SIGTERM, start again on the same
database and port), and down for the rest of a job's pipeline. The worker retries its calls with
backoff across the outage, keeps its lease, and every job completes once with nothing lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from client.sdk import OpfuseClient

from .harness import (
    FIGURES,
    SLOW_HIDDEN,
    SLOW_SHAPES,
    ApiServer,
    WorkerPool,
    model_bytes,
    record_jobs,
    slow_model,
    stored_bundle_count,
    upload,
    wait_all,
    wait_until,
)

pytestmark = pytest.mark.e2e

# A lease longer than an outage: the worker must come through it on the same lease (attempts 1).
SERVER_SETTINGS = {"OPFUSE_LEASE_SECONDS": "30"}


def test_restart_mid_job_loses_nothing(
    server: ApiServer, user: OpfuseClient, workers: WorkerPool, tmp_path: Path
) -> None:
    bundles_before = stored_bundle_count(server.database_url)
    model_id = upload(user, model_bytes(slow_model(seed=11)), tmp_path / "mlp.onnx")
    worker = workers.start()
    job = user.create_job(model_id, input_shapes=SLOW_SHAPES)
    job_id = str(job["id"])
    wait_until(lambda: worker.events("pipeline started", job_id), 60, "the job to start")
    assert user.get_job(job_id)["status"] == "running"

    down_s = server.restart()
    FIGURES.faults["API restart mid-job"] += 1

    [done] = wait_all(user, [job], timeout_s=120)
    record_jobs([done])
    assert done["status"] == "succeeded", f"{done.get('error')}\n{workers.diagnostics()}"
    assert done["attempts"] == 1, f"the lease outlived a {down_s:.1f} s restart"
    assert workers.completions(job_id) == 1
    assert stored_bundle_count(server.database_url) - bundles_before == 1

    # The same worker serves the next job from the restarted server.
    [after] = wait_all(user, [user.create_job(model_id, input_shapes={"x": [3, SLOW_HIDDEN]})], timeout_s=120)
    record_jobs([after])
    assert after["status"] == "succeeded", after.get("error")
    assert worker.alive()


def test_api_down_until_the_result_is_ready(
    server: ApiServer, user: OpfuseClient, workers: WorkerPool, tmp_path: Path
) -> None:
    bundles_before = stored_bundle_count(server.database_url)
    model_id = upload(user, model_bytes(slow_model(seed=12)), tmp_path / "mlp.onnx")
    worker = workers.start()
    job = user.create_job(model_id, input_shapes=SLOW_SHAPES)
    job_id = str(job["id"])
    wait_until(lambda: worker.events("pipeline started", job_id), 60, "the job to start")

    server.stop()  # the pipeline goes on in the worker; heartbeats and then the upload fail
    wait_until(
        lambda: worker.events("server call failed; retrying", job_id), 90, "the worker to retry its upload"
    )
    server.start()
    FIGURES.faults["API down while a job finished"] += 1

    [done] = wait_all(user, [job], timeout_s=120)
    record_jobs([done])
    assert done["status"] == "succeeded", f"{done.get('error')}\n{workers.diagnostics()}"
    assert done["attempts"] == 1
    assert workers.completions(job_id) == 1
    assert stored_bundle_count(server.database_url) - bundles_before == 1
    assert worker.alive()
