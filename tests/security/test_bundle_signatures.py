"""Bundles are signed by the API (issue 20, Medium 3): a download carries Opfuse-Signature, and
the SDK and `opfuse download` refuse a bundle whose signature is not the API's for the caller's
tenant (altered on its way, or unsigned), saving nothing. Over real HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from client.sdk import ArtifactSignatureError, OpfuseClient
from service.settings import Settings
from service.signing import KEY_FILE
from tests.service.bundles import altered, real_bundle
from tests.service.conftest import Keys, bearer, create_job

Tamper = Callable[[httpx.Response], httpx.Response]


def _succeeded_job(client: TestClient, keys: Keys, model: dict) -> str:
    job = create_job(client, keys.user, model["id"])
    claimed = client.post(
        "/v1/worker/claim", json={"worker_id": "w1", "device": "cpu"}, headers=bearer(keys.worker)
    ).json()
    token = claimed["lease_token"]
    headers = {**bearer(keys.worker), "Lease-Token": token, "Content-Type": "application/zip"}
    put = client.put(f"/v1/worker/jobs/{job['id']}/artifact", content=real_bundle(), headers=headers)
    assert put.status_code == 200, put.text
    done = client.post(
        f"/v1/worker/jobs/{job['id']}/complete",
        json={"lease_token": token, "report": {"speedup": 1.0}},
        headers=bearer(keys.worker),
    )
    assert done.status_code == 200, done.text
    return str(job["id"])


class _Tampering(httpx.BaseTransport):
    """Real HTTP to the API, with the artifact's response changed on its way (a proxy, a cache)."""

    def __init__(self, tamper: Tamper) -> None:
        self.inner, self.tamper = httpx.HTTPTransport(), tamper

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if not request.url.path.endswith("/artifact"):
            return response
        response.read()
        return self.tamper(response)

    def close(self) -> None:
        self.inner.close()


def _planted(response: httpx.Response) -> httpx.Response:
    """The bundle with a line added to a kernel, its ETag made to match; the signature kept."""
    body = altered(response.content, lambda n, d: d + b"\nimport os\n" if n == "kernels/k0.py" else d)
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "etag")}
    headers["ETag"] = f'"{hashlib.sha256(body).hexdigest()}"'
    return httpx.Response(response.status_code, headers=headers, content=body)


def _unsigned(response: httpx.Response) -> httpx.Response:
    headers = {
        k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "opfuse-signature")
    }
    return httpx.Response(response.status_code, headers=headers, content=response.content)


def test_a_download_is_signed_and_the_sdk_accepts_the_apis_signature(
    client: TestClient, keys: Keys, model: dict, api_url: str, settings: Settings, tmp_path: Path
) -> None:
    job_id = _succeeded_job(client, keys, model)
    with OpfuseClient(api_url, keys.user) as user:
        got = user.download_artifact(job_id, tmp_path / "b.zip")
    assert got.signature is not None and got.signature.startswith("hmac-sha256=")
    assert (tmp_path / "b.zip").read_bytes() == real_bundle()
    key_file = settings.home / KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("tamper", [_planted, _unsigned], ids=["altered", "unsigned"])
def test_the_sdk_refuses_a_bundle_whose_signature_does_not_match(
    client: TestClient, keys: Keys, model: dict, api_url: str, tmp_path: Path, tamper: Tamper
) -> None:
    job_id = _succeeded_job(client, keys, model)
    with OpfuseClient(api_url, keys.user, transport=_Tampering(tamper)) as user:
        message = (
            "does not carry this API's signature" if tamper is _planted else "without the API's signature"
        )
        with pytest.raises(ArtifactSignatureError, match=message):
            user.download_artifact(job_id, tmp_path / "out" / "b.zip")
    assert list((tmp_path / "out").iterdir()) == []  # nothing saved, no .part left


def test_another_tenants_key_does_not_verify_this_tenants_bundle(
    client: TestClient, keys: Keys, model: dict, api_url: str, tmp_path: Path
) -> None:
    """Keys are per tenant: what one tenant could sign, another tenant's client refuses."""
    job_id = _succeeded_job(client, keys, model)
    with OpfuseClient(api_url, keys.other) as other:
        other_key = other.signing_key().hex()
    with OpfuseClient(api_url, keys.user) as user:
        assert user.signing_key().hex() != other_key
    refused = pytest.raises(ArtifactSignatureError, match="does not carry this API's signature")
    with OpfuseClient(api_url, keys.user, signing_key=other_key) as user, refused:
        user.download_artifact(job_id, tmp_path / "b.zip")
    assert client.get("/v1/signing-key").status_code == 401


def test_opfuse_download_refuses_a_bundle_altered_on_its_way(
    client: TestClient,
    keys: Keys,
    model: dict,
    api_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import client.cli as cli

    job_id = _succeeded_job(client, keys, model)
    monkeypatch.setattr(
        cli, "_client", lambda opts: OpfuseClient(api_url, opts.key or "", transport=_Tampering(_planted))
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.app, ["download", job_id, "--key", keys.user, "-o", "b.zip"])
    assert result.exit_code != 0
    assert "does not carry this API's signature" in result.output
    assert not (tmp_path / "b.zip").exists()
    monkeypatch.setattr(cli, "_client", lambda opts: OpfuseClient(api_url, opts.key or ""))
    result = CliRunner().invoke(cli.app, ["download", job_id, "--key", keys.user, "-o", "b.zip"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "b.zip").read_bytes() == real_bundle()
