"""Workers dying under a job: a SIGKILLed worker's job is finished by another once its lease
expires (one bundle, two attempts); a SIGKILLed pipeline child fails only that attempt; and jobs
with a target go only to workers of that device kind.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from client.sdk import OpfuseAPIError, OpfuseClient

from .harness import (
    FIGURES,
    HIDDEN,
    SLOW_SHAPES,
    ApiServer,
    WorkerPool,
    mlp_model,
    model_bytes,
    record_jobs,
    slow_model,
    stored_bundle_count,
    upload,
    wait_all,
    wait_until,
)

pytestmark = pytest.mark.e2e


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_worker_mid_job_another_finishes_it(
    server: ApiServer, user: OpfuseClient, workers: WorkerPool, tmp_path: Path
) -> None:
    bundles_before = stored_bundle_count(server.database_url)
    model_id = upload(user, model_bytes(slow_model(seed=1)), tmp_path / "mlp.onnx")
    first, second = workers.start_many(["victim", "survivor"])
    job = user.create_job(model_id, input_shapes=SLOW_SHAPES)
    job_id = str(job["id"])

    holder = wait_until(lambda: workers.holder_of(job_id), 60, "a worker to claim the job")
    assert user.get_job(job_id)["status"] == "running"
    children = [int(e["pid"]) for e in holder.events("pipeline started", job_id)]
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(10)
    FIGURES.faults["worker SIGKILL mid-job"] += 1

    [done] = wait_all(user, [job], timeout_s=120)
    record_jobs([done])
    assert done["status"] == "succeeded", f"{done.get('error')}\n{workers.diagnostics()}"
    assert done["attempts"] == 2, "one claim by the killed worker, one by the survivor"
    assert workers.completions(job_id) == 1
    other = second if holder is first else first
    assert other.events("job succeeded", job_id), "the surviving worker finished the job"
    assert stored_bundle_count(server.database_url) - bundles_before == 1, "exactly one bundle stored"
    # The killed worker's pipeline child died with it (PR_SET_PDEATHSIG), holding nothing.
    wait_until(lambda: not any(_pid_alive(p) for p in children), 10, "the orphaned child to exit")
    assert user.download_artifact(job_id, tmp_path / "bundle.zip").size_bytes > 0


def test_sigkill_pipeline_child_fails_only_that_attempt(
    server: ApiServer, user: OpfuseClient, workers: WorkerPool, tmp_path: Path
) -> None:
    model_id = upload(user, model_bytes(slow_model(seed=2)), tmp_path / "mlp.onnx")
    worker = workers.start()
    job = user.create_job(model_id, input_shapes=SLOW_SHAPES)
    job_id = str(job["id"])
    started = wait_until(lambda: worker.events("pipeline started", job_id), 60, "the pipeline child")
    os.kill(int(started[0]["pid"]), signal.SIGKILL)
    FIGURES.faults["pipeline child SIGKILL (as the OOM killer does)"] += 1

    [done] = wait_all(user, [job], timeout_s=120)
    record_jobs([done])
    assert done["status"] == "succeeded", f"{done.get('error')}\n{workers.diagnostics()}"
    assert done["attempts"] == 2
    [crash] = worker.events("pipeline crashed", job_id)
    assert crash["returncode"] == -signal.SIGKILL
    assert worker.alive(), "the worker survived its child's death"


def test_jobs_go_only_to_workers_of_their_target(
    server: ApiServer, user: OpfuseClient, workers: WorkerPool, tmp_path: Path
) -> None:
    model_id = upload(user, model_bytes(mlp_model(seed=3)), tmp_path / "mlp.onnx")
    with pytest.raises(OpfuseAPIError) as refused:
        user.create_job(model_id, input_shapes={"x": [2, HIDDEN]}, target="tpu-v9")
    assert refused.value.status == 422
    assert "h200" in refused.value.detail and "target" in refused.value.detail

    for_h200 = user.create_job(model_id, input_shapes={"x": [2, HIDDEN]}, target="h200")
    for_cpu = user.create_job(model_id, input_shapes={"x": [2, HIDDEN]}, target="cpu")
    for_any = user.create_job(model_id, input_shapes={"x": [2, HIDDEN]})
    assert for_any["options"]["target"] == "any"

    cpu_worker = workers.start("cpu-worker")
    done = wait_all(user, [for_cpu, for_any], timeout_s=120)
    record_jobs(done)
    assert [j["status"] for j in done] == ["succeeded", "succeeded"]
    h200_id = str(for_h200["id"])
    assert not cpu_worker.events("job claimed", h200_id), "a CPU worker never takes an h200 job"
    assert user.get_job(h200_id)["status"] == "queued"

    # Two more workers of other kinds, speaking the worker protocol over HTTP.
    worker_key = server.worker_key_file.read_text().strip()
    with OpfuseClient(server.url, worker_key) as fleet:
        assert fleet.claim("a100-box", "cuda:0 (NVIDIA A100-SXM4-80GB)") is None
        claim = fleet.claim("h200-box", "cuda:3 (NVIDIA H200)")
        assert claim is not None and claim["job"]["id"] == h200_id
        fleet.fail(h200_id, claim["lease_token"], "test: the h200 worker gives the job up", retryable=False)
    given_up = user.get_job(h200_id)
    assert given_up["status"] == "failed" and given_up["attempts"] == 1
    record_jobs([given_up])
