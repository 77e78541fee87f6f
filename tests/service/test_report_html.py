"""GET /v1/jobs/{id}/report.html: the page rendered by the API from the stored report JSON, with the
kernel sources of the stored bundle shown as text, under a strict CSP; tenant-scoped like /report."""

from __future__ import annotations

import html
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from opfuse.views import CONTENT_SECURITY_POLICY
from opfuse.views.trace import AFTER_PID, BEFORE_PID

from .bundles import altered, real_bundle
from .conftest import Keys, bearer, create_job
from .test_worker import Worker

HOSTILE = "<script>alert(1)</script>"
WORKER_PAGE = "<html>a page a worker made: never served</html>"
KERNEL = f"# generated kernel k0\n# node {HOSTILE}\ndef launch(x):\n    return x\n"


def report() -> dict[str, Any]:
    return {
        "device": {"kind": "cpu-interpreter", "name": "cpu"},
        "precision": "fp32",
        "kernels": {"before": 3, "after": 1},
        "before": {"latency_ms": {"p50": 2.0, "p99": 2.5}, "peak_memory_bytes": 4096},
        "after": {"latency_ms": {"p50": 1.0, "p99": 1.2}, "peak_memory_bytes": 2048},
        "speedup": 2.0,
        "verification": {
            "passed": True,
            "reference": "onnxruntime-cpu",
            "outputs": {"y": {"max_abs_err": 1e-6, "rel_l2_err": 2e-7, "rtol": 1e-4, "atol": 1e-5}},
        },
        "fusion": {
            "groups": [
                {
                    "id": "p0",
                    "kind": "pointwise",
                    "rule": "pointwise_chain",
                    "nodes": ["add", HOSTILE, "relu"],
                    "kernel": "k0",
                    "time_ms_before": 0.3,
                    "time_ms_after": 0.1,
                }
            ],
            "not_fused": [],
        },
        "profile": {
            "ops": [
                {"node": "add", "op_type": "Add", "time_ms": 0.1, "bytes": 96, "flops": 8},
                {"node": HOSTILE, "op_type": "Mul", "time_ms": 0.1, "bytes": 96, "flops": 8},
                {"node": "relu", "op_type": "Relu", "time_ms": 0.1, "bytes": 64, "flops": 8},
            ]
        },
        "timings_s": {"load": 0.1, "fuse": 0.01},
    }


def bundle() -> bytes:
    """A bundle opfuse made (the API checks its kernels before storing it), with a page of the
    worker's own in place of report.html."""
    return altered(real_bundle(), lambda name, data: WORKER_PAGE.encode() if name == "report.html" else data)


def kernel_source() -> str:
    with zipfile.ZipFile(io.BytesIO(real_bundle())) as z:
        return z.read("kernels/k0.py").decode()


def finish(client: TestClient, keys: Keys, job_id: str, artifact: bytes) -> None:
    worker = Worker(client, keys.worker)
    claimed = worker.claim().json()
    assert claimed["job"]["id"] == job_id
    token = claimed["lease_token"]
    assert worker.artifact(job_id, token, artifact).status_code == 200
    assert worker.complete(job_id, token, report()).status_code == 200


def test_report_page_is_rendered_here_with_the_bundles_kernels(
    client: TestClient, keys: Keys, model: dict
) -> None:
    job = create_job(client, keys.user, model["id"])
    finish(client, keys, job["id"], bundle())
    response = client.get(f"/v1/jobs/{job['id']}/report.html", headers=bearer(keys.user))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert response.headers["x-content-type-options"] == "nosniff"
    page = response.text
    assert page.startswith("<!DOCTYPE html>") and f'content="{html.escape(CONTENT_SECURITY_POLICY)}"' in page
    assert WORKER_PAGE not in page  # rendered from the report JSON, never the bundle's HTML
    assert html.escape(kernel_source()) in page  # the stored bundle's kernel source, as text
    assert "<script>alert(1)" not in page and html.escape(HOSTILE) in page
    assert page.count("<script>") == 1
    assert '<svg id="time-chart"' in page and "2.00×" in page
    assert f"job {job['id']}" in page


def test_report_page_without_a_readable_bundle_still_renders(
    client: TestClient, keys: Keys, model: dict
) -> None:
    """An empty zip (no kernels in it) no longer gets stored: the API refuses a bundle it cannot
    check, so a job's page always has the kernels of a bundle opfuse made."""
    job = create_job(client, keys.user, model["id"])
    worker = Worker(client, keys.worker)
    token = worker.claim().json()["lease_token"]
    refused = worker.artifact(job["id"], token, b"PK\x05\x06" + b"\0" * 18)
    assert refused.status_code == 422 and "the bundle has no manifest.json" in refused.json()["detail"]
    response = client.get(f"/v1/jobs/{job['id']}/report.html", headers=bearer(keys.user))
    assert response.status_code == 404 and "failed" in response.json()["detail"]


def test_report_page_is_tenant_scoped_and_404_until_success(
    client: TestClient, keys: Keys, model: dict
) -> None:
    job = create_job(client, keys.user, model["id"])
    queued = client.get(f"/v1/jobs/{job['id']}/report.html", headers=bearer(keys.user))
    assert queued.status_code == 404 and "queued" in queued.json()["detail"]
    finish(client, keys, job["id"], bundle())
    other = client.get(f"/v1/jobs/{job['id']}/report.html", headers=bearer(keys.other))
    assert other.status_code == 404
    assert job["id"] in other.json()["detail"] and "alert" not in other.text
    assert client.get(f"/v1/jobs/{job['id']}/report.html").status_code == 401
    assert client.get(f"/v1/jobs/{job['id']}/report.html", headers=bearer(keys.user)).status_code == 200


# -- the CLI against this API ------------------------------------------------------------------------


class _AppTransport(httpx.BaseTransport):
    """The SDK's requests handed to the app through the TestClient (its own httpx build)."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.client.request(
            request.method,
            request.url.raw_path.decode(),
            headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
            content=request.read(),
        )
        skip = {"content-encoding", "content-length", "transfer-encoding"}
        headers = [(k, v) for k, v in answer.headers.items() if k.lower() not in skip]
        return httpx.Response(answer.status_code, headers=headers, content=answer.content)


def _cli_against(client: TestClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CliRunner:
    """`opfuse` as a user types it, its SDK talking to this app (in process, the real routes)."""
    import client.cli as cli
    from client.sdk import OpfuseClient

    def real_client(opts: cli.Options) -> OpfuseClient:
        return OpfuseClient("http://testserver", opts.key or "", transport=_AppTransport(client))

    monkeypatch.setattr(cli, "_client", real_client)
    monkeypatch.chdir(tmp_path)
    return CliRunner()


def test_cli_report_html_and_trace(
    client: TestClient, keys: Keys, model: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import client.cli as cli

    runner = _cli_against(client, monkeypatch, tmp_path)
    job = create_job(client, keys.user, model["id"])
    finish(client, keys, job["id"], bundle())
    served = client.get(f"/v1/jobs/{job['id']}/report.html", headers=bearer(keys.user)).text

    result = runner.invoke(cli.app, ["report", job["id"], "--key", keys.user, "--html", "-o", "r.html"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.html").read_text(encoding="utf-8") == served
    assert "saved r.html" in result.stdout

    result = runner.invoke(cli.app, ["report", job["id"], "--key", keys.user, "--html"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / f"{job['id']}.report.html").read_text(encoding="utf-8") == served

    result = runner.invoke(cli.app, ["report", job["id"], "--key", keys.user, "--trace", "t.json", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"trace": "t.json"}
    trace = json.loads((tmp_path / "t.json").read_text())
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ops = report()["profile"]["ops"]
    assert [(e["pid"], e["args"]["nodes"], e["dur"]) for e in steps] == [
        (BEFORE_PID, [op["node"]], pytest.approx(op["time_ms"] * 1000)) for op in ops
    ] + [(AFTER_PID, ["add", HOSTILE, "relu"], pytest.approx(100.0))]

    other = runner.invoke(cli.app, ["report", job["id"], "--key", keys.other, "--html", "-o", "x.html"])
    assert other.exit_code == 1 and "HTTP 404" in other.stderr and not (tmp_path / "x.html").exists()
    usage = runner.invoke(cli.app, ["report", job["id"], "--key", keys.user, "-o", "x.html"])
    assert usage.exit_code == 2 and "add --html" in usage.stderr
