"""A table of hostile and broken inputs: each is refused with a 4xx and a reason, or its job fails
with a reason; afterwards the same server and worker still run a good job.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from client.sdk import Job, OpfuseClient

from .harness import (
    FIGURES,
    HIDDEN,
    ApiServer,
    WorkerPool,
    mlp_model,
    model_bytes,
    record_jobs,
    upload,
    wait_all,
)

pytestmark = pytest.mark.e2e

ONNX = "application/octet-stream"


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: Sequence[onnx.TensorProto] = (),
) -> bytes:
    graph = helper.make_graph(nodes, "bad", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model.SerializeToString()


def _vi(name: str, shape: list[Any]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def truncated_protobuf() -> bytes:
    weights = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    whole = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], [_vi("x", [2, 64])], [_vi("y", [2, 64])], [weights]
    )
    return whole[: len(whole) - 1000]  # cut inside the weights


def external_data_outside(location: str = "../../../../etc/passwd") -> onnx.ModelProto:
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "ext", [_vi("x", [4])], [_vi("y", [4])], [w]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def zip_with_traversal() -> bytes:
    """A zip upload whose model points its external data outside the archive, which also holds an
    entry named `../escape.bin`."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model.onnx", external_data_outside("../escape.bin").SerializeToString())
        archive.writestr("../escape.bin", b"\0" * 16)
    return buffer.getvalue()


def absurd_declared_shape() -> bytes:
    huge = [1_000_000, 1_000_000, 1_000_000]
    return _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", huge)], [_vi("y", huge)])


def cyclic_graph() -> bytes:
    return _model(
        [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])],
        [_vi("x", [4])],
        [_vi("a", [4])],
    )


def chain(length: int) -> bytes:
    """x → Relu → Relu → ... (`length` nodes): as many nodes, and as deep, as asked."""
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(length)]
    nodes[0].input[0] = "x"
    nodes[-1].output[0] = "y"
    return _model(nodes, [_vi("x", [4])], [_vi("y", [4])])


@dataclass
class Outcome:
    kind: str  # "refused (4xx)" or "failed job"
    status: int
    reason: str


class Probe:
    """Sends one bad input; an upload that gets through is run as a job to see it fail."""

    def __init__(self, server: ApiServer, user: OpfuseClient, user_key: str, other_key: str) -> None:
        self.server, self.user = server, user
        self.user_key, self.other_key = user_key, other_key
        self.jobs: list[Job] = []

    def request(self, method: str, path: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.user_key}", **kwargs.pop("headers", {})}
        return httpx.request(method, f"{self.server.url}{path}", headers=headers, timeout=120, **kwargs)

    def refused(self, response: httpx.Response) -> Outcome:
        assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
        detail = response.json().get("detail")
        assert isinstance(detail, str) and detail, response.text[:500]
        return Outcome("refused (4xx)", response.status_code, detail)

    def upload_then_run(self, data: bytes, content_type: str = ONNX, shapes: Any = None) -> Outcome:
        response = self.request("POST", "/v1/models", content=data, headers={"Content-Type": content_type})
        if response.status_code >= 400:
            return self.refused(response)
        assert response.status_code in (200, 201), response.text
        return self.run_job(str(response.json()["id"]), shapes or {})

    def run_job(self, model_id: str, shapes: dict[str, list[int]]) -> Outcome:
        response = self.request("POST", "/v1/jobs", json={"model_id": model_id, "input_shapes": shapes})
        if response.status_code >= 400:
            return self.refused(response)
        [job] = wait_all(self.user, [response.json()], timeout_s=180)
        self.jobs.append(job)
        assert job["status"] == "failed", f"a bad input's job {job['status']}"
        assert job["error"], "a failed job says why"
        return Outcome("failed job", 0, str(job["error"]))


def _cases(probe: Probe, good_model_id: str, good_job_id: str) -> dict[str, Callable[[], Outcome]]:
    other = probe.other_key
    return {
        "garbage bytes": lambda: probe.upload_then_run(b"this is not a protobuf \x00\xff" * 64),
        "empty body": lambda: probe.upload_then_run(b""),
        "truncated protobuf": lambda: probe.upload_then_run(truncated_protobuf()),
        "external data outside the file (../../etc/passwd)": lambda: probe.upload_then_run(
            external_data_outside().SerializeToString()
        ),
        "zip with a path-traversing entry and external data": lambda: probe.upload_then_run(
            zip_with_traversal(), content_type="application/zip"
        ),
        "absurd declared shape (1e18 elements)": lambda: probe.upload_then_run(absurd_declared_shape()),
        "absurd input_shapes for a dynamic dim": lambda: probe.run_job(good_model_id, {"x": [2**40, HIDDEN]}),
        "input_shapes past the worker's memory (refused before compiling)": lambda: probe.run_job(
            good_model_id, {"x": [2**28, HIDDEN]}
        ),
        "job needing more memory than the worker's limit": lambda: probe.run_job(
            good_model_id, {"x": [2**27, HIDDEN]}
        ),
        "cyclic graph": lambda: probe.upload_then_run(cyclic_graph()),
        "100k-node graph": lambda: probe.upload_then_run(chain(100_000)),
        "20k-deep graph": lambda: probe.upload_then_run(chain(20_000)),
        "wrong content type (JSON as a model)": lambda: probe.refused(
            probe.request("POST", "/v1/models", json={"model": "mlp.onnx"})
        ),
        "wrong content type (text/plain job)": lambda: probe.refused(
            probe.request("POST", "/v1/jobs", content=b"model_id=1", headers={"Content-Type": "text/plain"})
        ),
        "oversized JSON (24 MB)": lambda: probe.refused(
            probe.request(
                "POST",
                "/v1/jobs",
                content=json.dumps({"model_id": good_model_id, "pad": "x" * (24 * 1024**2)}).encode(),
                headers={"Content-Type": "application/json"},
            )
        ),
        "malformed JSON": lambda: probe.refused(
            probe.request(
                "POST", "/v1/jobs", content=b'{"model_id": ', headers={"Content-Type": "application/json"}
            )
        ),
        "unknown target": lambda: probe.refused(
            probe.request("POST", "/v1/jobs", json={"model_id": good_model_id, "target": "quantum"})
        ),
        "another tenant's model": lambda: probe.refused(
            probe.request("GET", f"/v1/models/{good_model_id}", other)
        ),
        "another tenant's model bytes": lambda: probe.refused(
            probe.request("GET", f"/v1/models/{good_model_id}/content", other)
        ),
        "another tenant's model, deleted": lambda: probe.refused(
            probe.request("DELETE", f"/v1/models/{good_model_id}", other)
        ),
        "a job for another tenant's model": lambda: probe.refused(
            probe.request("POST", "/v1/jobs", other, json={"model_id": good_model_id})
        ),
        "another tenant's job": lambda: probe.refused(probe.request("GET", f"/v1/jobs/{good_job_id}", other)),
        "another tenant's report": lambda: probe.refused(
            probe.request("GET", f"/v1/jobs/{good_job_id}/report", other)
        ),
        "another tenant's artifact": lambda: probe.refused(
            probe.request("GET", f"/v1/jobs/{good_job_id}/artifact", other)
        ),
        "another tenant's job, canceled": lambda: probe.refused(
            probe.request("POST", f"/v1/jobs/{good_job_id}/cancel", other)
        ),
        "a user key on the worker protocol": lambda: probe.refused(
            probe.request("POST", "/v1/worker/claim", json={"worker_id": "x", "device": "cpu"})
        ),
    }


def test_bad_inputs_are_refused_or_fail_with_a_reason(
    server: ApiServer, user: OpfuseClient, user_key: str, workers: WorkerPool, tmp_path: Path
) -> None:
    worker = workers.start()
    good_model_id = upload(user, model_bytes(mlp_model(seed=41)), tmp_path / "mlp.onnx")
    [good] = wait_all(user, [user.create_job(good_model_id, input_shapes={"x": [2, HIDDEN]})], timeout_s=120)
    assert good["status"] == "succeeded", good.get("error")
    probe = Probe(server, user, user_key, server.make_key("other-tenant"))

    outcomes: dict[str, Outcome] = {}
    for name, send in _cases(probe, good_model_id, str(good["id"])).items():
        outcomes[name] = send()
        FIGURES.bad_inputs[outcomes[name].kind] += 1
    record_jobs([good, *probe.jobs])
    report = "\n".join(f"{n}: {o.kind} {o.status or ''} {o.reason[:140]!r}" for n, o in outcomes.items())
    print(report)

    assert outcomes["wrong content type (JSON as a model)"].status == 415
    assert outcomes["oversized JSON (24 MB)"].status == 413
    assert all(
        o.status == 404 for n, o in outcomes.items() if n.startswith(("another tenant", "a job for another"))
    ), report
    assert "memory" in outcomes["job needing more memory than the worker's limit"].reason, report
    assert (
        "for one tensor"
        in outcomes["input_shapes past the worker's memory (refused before compiling)"].reason
    )
    assert "cycle" in outcomes["cyclic graph"].reason, report

    # The same server and worker still serve a good job.
    [after] = wait_all(user, [user.create_job(good_model_id, input_shapes={"x": [4, HIDDEN]})], timeout_s=120)
    record_jobs([after])
    assert after["status"] == "succeeded", f"{after.get('error')}\n{workers.diagnostics()}"
    assert worker.alive()
    assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_slow_client_sending_an_oversized_body_reads_the_413(
    server: ApiServer, user_key: str, declared: bool
) -> None:
    """The server refuses a JSON body over its limit with 413, and reads (and drops) the rest of it
    first: closing on a client still sending resets the connection, and the client never sees the
    refusal. A real socket, a body sent in pieces with pauses, as a slow uplink sends it."""
    import socket
    import time

    size, piece = 20 * 1024**2, 256 * 1024
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {user_key}\r\n"
        "Content-Type: application/json\r\n"
        + (f"Content-Length: {size}\r\n" if declared else "Transfer-Encoding: chunked\r\n")
        + "\r\n"
    )
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode())
        body = b'{"pad": "' + b"x" * (piece - 9)
        for _ in range(size // piece):
            sock.sendall(body if declared else f"{len(body):x}\r\n".encode() + body + b"\r\n")
            body = b"x" * piece
            time.sleep(0.002)
        if not declared:
            sock.sendall(b"0\r\n\r\n")
        response = b""
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    status = response.split(b"\r\n", 1)[0]
    assert b" 413 " in status, response[:300]
    assert b"OPFUSE_MAX_JSON_BYTES" in response
