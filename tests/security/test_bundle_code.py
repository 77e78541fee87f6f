"""A worker key cannot run code on users' machines (issue 20, Medium 3): a bundle whose kernels or
plan carry what opfuse did not generate is refused by the API before it is stored (the job fails
saying why), and by `opfuse.load` after a download, without the planted line ever running. On
SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import opfuse
from opfuse.errors import BundleError
from tests.service.bundles import altered, real_bundle
from tests.service.conftest import Keys, bearer, create_job


def _planted_line(marker: Path) -> bytes:
    """A line that, were it ever run, leaves `marker` behind."""
    return f"\nopen({str(marker)!r}, 'w').write('ran')\n".encode()


def _planted_kernel(marker: Path) -> bytes:
    return altered(
        real_bundle(), lambda name, data: data + _planted_line(marker) if name == "kernels/k0.py" else data
    )


def _planted_plan_field() -> bytes:
    """plan.json's first kernel launched on the model's input as its output (a foreign field)."""

    def change(name: str, data: bytes) -> bytes:
        if name != "plan.json":
            return data
        plan = json.loads(data)
        plan["kernels"][0]["outputs"] = ["x"]
        return json.dumps(plan).encode()

    return altered(real_bundle(), change)


def _claim(client: TestClient, keys: Keys) -> str:
    claimed = client.post(
        "/v1/worker/claim", json={"worker_id": "w-evil", "device": "cpu"}, headers=bearer(keys.worker)
    )
    assert claimed.status_code == 200, claimed.text
    return str(claimed.json()["lease_token"])


def _put(client: TestClient, keys: Keys, job_id: str, token: str, data: bytes):
    headers = {**bearer(keys.worker), "Lease-Token": token, "Content-Type": "application/zip"}
    return client.put(f"/v1/worker/jobs/{job_id}/artifact", content=data, headers=headers)


@pytest.mark.parametrize("plant", ["kernel_line", "plan_field"])
def test_a_worker_uploading_a_bundle_with_planted_code_is_refused_and_the_job_fails(
    client: TestClient, keys: Keys, model: dict, tmp_path: Path, plant: str
) -> None:
    marker = tmp_path / "planted-ran"
    data = _planted_kernel(marker) if plant == "kernel_line" else _planted_plan_field()
    job = create_job(client, keys.user, model["id"])
    token = _claim(client, keys)
    response = _put(client, keys, job["id"], token, data)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    if plant == "kernel_line":
        assert "kernel k0's source is not what this opfuse generates from its spec" in detail
    else:
        assert "plan.json's kernel k0 says outputs other than its spec implies" in detail
    seen = client.get(f"/v1/jobs/{job['id']}", headers=bearer(keys.user)).json()
    assert seen["status"] == "failed"
    assert seen["error"].startswith("the worker's bundle was refused: ")
    assert client.get(f"/v1/jobs/{job['id']}/artifact", headers=bearer(keys.user)).status_code == 404
    completed = client.post(
        f"/v1/worker/jobs/{job['id']}/complete",
        json={"lease_token": token, "report": {"speedup": 99.0}},
        headers=bearer(keys.worker),
    )
    assert completed.status_code == 409, completed.text  # the lease ended with the job
    assert not marker.exists()


def test_the_same_worker_uploading_the_bundle_as_compiled_is_accepted(
    client: TestClient, keys: Keys, model: dict
) -> None:
    """The refusals above are the alteration's: the bundle opfuse made passes the same check."""
    job = create_job(client, keys.user, model["id"])
    token = _claim(client, keys)
    response = _put(client, keys, job["id"], token, real_bundle())
    assert response.status_code == 200, response.text


def test_a_bundle_altered_after_download_is_refused_by_load_without_running_the_line(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "planted-ran"
    path = tmp_path / "downloaded.opfuse.zip"
    path.write_bytes(_planted_kernel(marker))
    with pytest.raises(BundleError, match="kernel k0's source is not what this opfuse generates"):
        opfuse.load(path, device="cpu")
    assert not marker.exists()
    path.write_bytes(_planted_plan_field())
    with pytest.raises(BundleError, match="says outputs other than its spec implies"):
        opfuse.load(path, device="cpu")
    # The same bytes unaltered load and run: the check refuses the alteration, not the bundle.
    path.write_bytes(real_bundle())
    loaded = opfuse.load(path, device="cpu")
    assert loaded.plan.kernels


def test_a_module_planted_in_the_kernel_folder_is_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels are imported from files named by their source's digest: a file put there first
    (a guessable name) is replaced by the rendered source, and a folder others can write to is
    refused."""
    import hashlib
    import os
    import tempfile

    from opfuse.runtime import kernels

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", {})
    marker = tmp_path / "planted-ran"
    source = "VALUE = 41 + 1\n"
    folder = tmp_path / f"opfuse-kernels-{os.getuid()}"
    folder.mkdir(mode=0o700)
    digest = hashlib.sha256(source.encode()).hexdigest()[:32]
    (folder / f"k_{digest}.py").write_bytes(_planted_line(marker) + source.encode())
    module = kernels.load_kernel_module(source, interpret=True)
    assert module.VALUE == 42
    assert not marker.exists()
    folder.chmod(0o777)
    monkeypatch.setattr(kernels, "_loaded", {})
    with pytest.raises(RuntimeError, match="only it can write to"):
        kernels.load_kernel_module(source, interpret=True)
