"""The SDK (client.sdk) and server discovery (client.config) against a fake API (httpx.MockTransport):
error details, lease loss, streamed uploads, checked downloads, cursors, waiting.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from client.config import NO_SERVER, ConfigError, discover
from client.sdk import (
    ArtifactIntegrityError,
    LeaseLostError,
    OpfuseAPIError,
    OpfuseClient,
    OpfuseConnectionError,
    OpfuseTimeoutError,
)

Handler = Callable[[httpx.Request], httpx.Response]


def make_client(handler: Handler) -> OpfuseClient:
    return OpfuseClient("http://api.test/", "opf_key", transport=httpx.MockTransport(handler))


def test_errors_carry_the_servers_detail() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/jobs":
            return httpx.Response(
                422,
                json={"detail": [{"loc": ["body", "precision"], "msg": "Input should be 'fp32' or 'fp16'"}]},
            )
        return httpx.Response(404, json={"detail": "no job with id 'x'"})

    with make_client(handler) as client:
        with pytest.raises(OpfuseAPIError) as err:
            client.get_job("x")
        assert (err.value.status, err.value.detail) == (404, "no job with id 'x'")
        with pytest.raises(OpfuseAPIError, match="precision: Input should be 'fp32' or 'fp16'"):
            client.create_job("m", precision="fp8")


def test_409_is_lease_lost_only_on_worker_calls() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"detail": "lease lost"})

    with make_client(handler) as client:
        with pytest.raises(LeaseLostError):
            client.heartbeat("j", "tok", "fusing", 0.5)
        with pytest.raises(LeaseLostError):
            client.fail("j", "tok", "boom", retryable=True)
        with pytest.raises(OpfuseAPIError) as err:
            client.cancel_job("j")
        assert not isinstance(err.value, LeaseLostError)


def test_claim_204_is_none_and_requests_are_authenticated() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    with make_client(handler) as client:
        assert client.claim("w1", "cpu") is None
    assert seen[0].headers["authorization"] == "Bearer opf_key"
    assert json.loads(seen[0].content) == {"worker_id": "w1", "device": "cpu"}


def test_create_job_sends_only_what_was_set() -> None:
    bodies: list[dict[str, object]] = []
    headers: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        headers.append(request.headers)
        return httpx.Response(202, json={"id": "j1", "status": "queued"})

    with make_client(handler) as client:
        client.create_job("m1")
        client.create_job(
            "m1",
            {"x": [2, 3]},
            "fp16",
            ["layernorm"],
            rtol=1e-2,
            idempotency_key="k1",
            webhook_url="http://h/",
        )
    assert bodies[0] == {"model_id": "m1", "precision": "fp32"}
    assert bodies[1] == {
        "model_id": "m1",
        "precision": "fp16",
        "input_shapes": {"x": [2, 3]},
        "fusion": {"disable": ["layernorm"]},
        "verify": {"rtol": 1e-2},
        "webhook_url": "http://h/",
    }
    assert headers[1]["idempotency-key"] == "k1" and "idempotency-key" not in headers[0]


def test_upload_is_streamed_with_length(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"\x08\x07" * 100_000)
    got: dict[str, object] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        got.update(
            length=request.headers.get("content-length"),
            type=request.headers.get("content-type"),
            name=request.url.params.get("name"),
            body=request.read(),
        )
        return httpx.Response(201, json={"id": "m1"})

    with make_client(handler) as client:
        assert client.upload_model(model)["id"] == "m1"
        with pytest.raises(FileNotFoundError, match="no such model file"):
            client.upload_model(tmp_path / "missing.onnx")
    assert got["length"] == "200000" and got["type"] == "application/octet-stream"
    assert got["name"] == "m.onnx" and got["body"] == model.read_bytes()


def test_download_checks_the_etag(tmp_path: Path) -> None:
    payload = b"PK\x03\x04" + b"x" * 5000
    sha = hashlib.sha256(payload).hexdigest()
    etag = {"value": f'"{sha}"'}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=payload, headers={"ETag": etag["value"]})

    with make_client(handler) as client:
        # The ETag alone (the signature: tests/security/test_bundle_signatures.py).
        got = client.download_artifact("j1", tmp_path / "out" / "b.zip", verify_signature=False)
        assert got.sha256 == sha and got.size_bytes == len(payload)
        assert (tmp_path / "out" / "b.zip").read_bytes() == payload

        etag["value"] = '"' + "0" * 64 + '"'
        with pytest.raises(ArtifactIntegrityError, match="damaged"):
            client.download_artifact("j1", tmp_path / "bad.zip", verify_signature=False)
    assert not (tmp_path / "bad.zip").exists() and not (tmp_path / "bad.zip.part").exists()


def test_list_follows_cursors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        cursor = request.url.params.get("cursor")
        if cursor is None:
            return httpx.Response(200, json={"items": [{"id": "a"}], "next_cursor": "c1"})
        if cursor == "c1":
            return httpx.Response(200, json={"items": [{"id": "b"}], "next_cursor": "c2"})
        return httpx.Response(200, json={"items": [{"id": "c"}], "next_cursor": None})

    with make_client(handler) as client:
        assert [m["id"] for m in client.list_models()] == ["a", "b", "c"]


def test_wait_job_reports_updates_and_times_out() -> None:
    states = iter(["queued", "running", "running", "succeeded"])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": "j1", "status": next(states, "succeeded")})

    updates: list[str] = []
    with make_client(handler) as client:
        done = client.wait_job("j1", poll_s=0.01, on_update=lambda j: updates.append(str(j["status"])))
    assert done["status"] == "succeeded"
    assert updates == ["queued", "running", "running", "succeeded"]

    def never(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": "j1", "status": "running"})

    with make_client(never) as client, pytest.raises(OpfuseTimeoutError, match="opfuse status j1"):
        client.wait_job("j1", poll_s=0.01, timeout_s=0.05)


def test_unreachable_server_is_a_connection_error() -> None:
    with OpfuseClient("http://127.0.0.1:9", "k", timeout=2) as client:
        with pytest.raises(OpfuseConnectionError, match="cannot reach the opfuse API"):
            client.list_models()
        assert client.ready() is False


def test_discover_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OPFUSE_API_URL", "OPFUSE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPFUSE_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        discover()
    assert str(err.value) == NO_SERVER

    (tmp_path / "server.json").write_text(json.dumps({"url": "http://0.0.0.0:8123", "pid": 1}))
    (tmp_path / "api_key").write_text("opf_file\n")
    conn = discover()
    assert (conn.api_url, conn.api_key) == ("http://127.0.0.1:8123", "opf_file")

    monkeypatch.setenv("OPFUSE_API_URL", "http://env:1/")
    monkeypatch.setenv("OPFUSE_API_KEY", "opf_env")
    conn = discover()
    assert (conn.api_url, conn.api_key, conn.source) == ("http://env:1", "opf_env", "OPFUSE_API_URL")

    conn = discover("http://flag:2", "opf_flag")
    assert (conn.api_url, conn.api_key, conn.source) == ("http://flag:2", "opf_flag", "--api")

    (tmp_path / "server.json").write_text("{not json")
    monkeypatch.delenv("OPFUSE_API_URL")
    with pytest.raises(ConfigError, match=r"cannot read .*server\.json"):
        discover()


def test_records_are_typed_and_keep_the_json() -> None:
    raw = {
        "id": "j1",
        "model_id": "m1",
        "status": "succeeded",
        "progress": 1,
        "created_at": "2025-01-01T00:00:00Z",
        "summary": {"speedup": 1.5, "kernels_before": 9, "kernels_after": 3},
        "new_field": {"from": "a newer server"},
    }

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/jobs/j1/report":
            return httpx.Response(200, json={"after": {"latency_ms": {"p50": 2.0, "p99": 3.0}}})
        return httpx.Response(200, json=raw)

    with make_client(handler) as client:
        job = client.get_job("j1")
        report = client.get_report("j1")
    assert (job.id, job.model_id, job.status, job.progress, job.done) == ("j1", "m1", "succeeded", 1.0, True)
    assert job.created_at is not None and (job.created_at.year, job.created_at.utcoffset()) == (
        2025,
        timedelta(0),
    )
    assert job.summary is not None and (job.summary.speedup, job.summary.kernels_after) == (1.5, 3)
    assert job.error is None and job.summary.latency_ms_after is None  # not sent: None, not an error
    # The JSON as the server sent it, unknown fields too; a copy from to_dict, and dict-style reads.
    assert job.raw == raw and job == raw and dict(job) == raw
    copy = job.to_dict()
    copy["summary"]["speedup"] = 0.0
    assert job.raw["summary"]["speedup"] == 1.5
    assert job["status"] == "succeeded" and job.get("missing") is None and "new_field" in job
    assert report.after is not None and (report.after.p50, report.after.p99) == (2.0, 3.0)
    assert report.before is None and report.groups == () and report.verification.passed is None
    assert "speedup=1.5" in repr(job)
