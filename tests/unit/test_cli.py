"""The `opfuse` CLI as a user types it (typer's CliRunner): shape specs, --json output, one-line
errors for bad flags and server answers, and local compile/run with the real library.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import client.cli as cli
import opfuse
from client.sdk import OpfuseClient
from client.shapes import ShapeSpecError, check_shapes_fit, parse_shape, parse_shapes

runner = CliRunner()


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No server discovery leaks in from the developer's shell or ./.opfuse."""
    for var in ("OPFUSE_API_URL", "OPFUSE_API_KEY", "OPFUSE_WORKER_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPFUSE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    yield


def invoke(*args: str) -> Any:
    return runner.invoke(cli.app, list(args))


def assert_one_line_error(result: Any, code: int, *fragments: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("opfuse: error: "), lines[0]
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# -- shape specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("x=1x3x224x224", ("x", [1, 3, 224, 224])),
        ("x=2,16", ("x", [2, 16])),
        ("input:0=4X8", ("input:0", [4, 8])),
        (" ids = 2 x 7 ", ("ids", [2, 7])),
        ("scale=", ("scale", [])),
    ],
)
def test_parse_shape_accepts(spec: str, expected: tuple[str, list[int]]) -> None:
    assert parse_shape(spec) == expected


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("x", "expected NAME=DIMxDIMx"),
        ("=1x2", "expected NAME=DIMxDIMx"),
        ("x=1xbatchx3", "'batch' is not a whole number"),
        ("x=1xx3", "an empty dimension"),
        ("x=0x3", "at least 1"),
        ("x=-1x3", "is not a whole number"),
    ],
)
def test_parse_shape_rejects_with_reason(spec: str, why: str) -> None:
    with pytest.raises(ShapeSpecError, match=why):
        parse_shape(spec)


def test_parse_shapes_rejects_duplicates() -> None:
    assert parse_shapes(["a=1", "b=2x2"]) == {"a": [1], "b": [2, 2]}
    with pytest.raises(ShapeSpecError, match="given twice"):
        parse_shapes(["a=1", "a=2"])


def test_shapes_are_checked_against_the_model_inputs() -> None:
    inputs = [{"name": "x", "dtype": "float32", "shape": ["batch", 32]}, {"name": "m", "shape": [4]}]
    check_shapes_fit({"x": [2, 32]}, inputs)
    with pytest.raises(ShapeSpecError, match="no input 'y'; its inputs are: x \\[batch, 32\\]"):
        check_shapes_fit({"x": [2, 32], "y": [1]}, inputs)
    with pytest.raises(ShapeSpecError, match="rank 2"):
        check_shapes_fit({"x": [2, 32, 1]}, inputs)
    with pytest.raises(ShapeSpecError, match="dimension 1 of input 'x' is fixed at 32"):
        check_shapes_fit({"x": [2, 16]}, inputs)
    with pytest.raises(ShapeSpecError, match="--shape x=1x32"):
        check_shapes_fit({}, inputs)


# -- usage errors: one line on stderr, no traceback, no server needed -----------------------------


def test_bad_shape_flag_is_a_usage_error(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not used")
    result = invoke("submit", str(model), "--shape", "x=2xfoo")
    assert_one_line_error(result, 2, "--shape 'x=2xfoo'", "'foo' is not a whole number", "x=1x3x224x224")


def test_missing_model_file() -> None:
    result = invoke("submit", "nope.onnx", "--shape", "x=2x32")
    assert_one_line_error(result, 2, "model file nope.onnx does not exist")


def test_unknown_flag_and_bad_choice_exit_2() -> None:
    assert invoke("jobs", "--frobnicate").exit_code == 2
    result = invoke("submit", "m.onnx", "--precision", "fp8")
    assert result.exit_code == 2
    assert "fp8" in result.output
    assert "Traceback" not in result.output


def test_no_server_found_says_what_to_do() -> None:
    result = invoke("status", "abc")
    assert_one_line_error(result, 2, "no server found", "opfuse serve", "--api and --key")


def test_key_missing_when_url_given() -> None:
    result = invoke("--api", "http://127.0.0.1:9", "models")
    assert_one_line_error(result, 2, "no API key", "--key", "OPFUSE_API_KEY")


def test_unreachable_server_is_one_line() -> None:
    result = invoke("jobs", "--api", "http://127.0.0.1:9", "--key", "k")
    assert_one_line_error(result, 1, "cannot reach the opfuse API at http://127.0.0.1:9")


def test_discovery_from_opfuse_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "server.json").write_text(json.dumps({"url": "http://0.0.0.0:9"}))
    (home / "api_key").write_text("opf_secret\n")
    seen: dict[str, Any] = {}

    def fake_client(opts: cli.Options) -> OpfuseClient:
        from client.config import discover

        conn = discover(opts.api, opts.key)
        seen.update(url=conn.api_url, key=conn.api_key)
        return OpfuseClient(
            conn.api_url, conn.api_key, transport=httpx.MockTransport(lambda r: httpx.Response(200, json=[]))
        )

    monkeypatch.setattr(cli, "_client", fake_client)
    assert invoke("models", "--json").exit_code == 0
    assert seen == {"url": "http://127.0.0.1:9", "key": "opf_secret"}
    monkeypatch.setenv("OPFUSE_API_URL", "http://env:1")
    assert invoke("models", "--json", "--key", "flag").exit_code == 0
    assert seen == {"url": "http://env:1", "key": "flag"}


def test_version_json() -> None:
    result = invoke("--json", "version")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"version": opfuse.__version__}


# -- against a fake API (httpx.MockTransport) ------------------------------------------------------


JOB = {
    "id": "j1",
    "model_id": "m1",
    "status": "succeeded",
    "stage": "packaging",
    "progress": 1.0,
    "attempts": 1,
    "error": None,
    "created_at": "2025-01-01T00:00:00Z",
    "summary": {"speedup": None, "kernels_before": 19, "kernels_after": 9},
}
REPORT = {
    "device": {"kind": "cpu-interpreter", "name": "x86_64"},
    "precision": "fp32",
    "kernels": {"before": 19, "after": 9},
    "verification": {
        "passed": True,
        "reference": "onnxruntime-cpu",
        "outputs": {"y": {"max_abs_err": 1e-7, "rel_l2_err": 1e-8, "rtol": 1e-4, "atol": 1e-5}},
        "rolled_back": [],
    },
    "fusion": {
        "groups": [
            {
                "id": "g0",
                "kind": "pointwise",
                "rule": "pointwise",
                "nodes": ["Add#1", "Erf#2"],
                "kernel": "k0",
            }
        ],
        "not_fused": [{"rule": "layernorm", "nodes": ["ReduceMean#3"], "reason": "axis is not the last one"}],
    },
}


@pytest.fixture
def fake_api(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        path, params = request.url.path, request.url.params
        if request.headers.get("authorization") != "Bearer k":
            return httpx.Response(
                401, json={"detail": "invalid or revoked API key; ask an admin for a new one"}
            )
        if path == "/v1/jobs" and request.method == "GET":
            if params.get("cursor") == "c2":
                return httpx.Response(200, json={"items": [{**JOB, "id": "j2"}], "next_cursor": None})
            return httpx.Response(200, json={"items": [JOB], "next_cursor": "c2"})
        if path == "/v1/jobs/j1":
            return httpx.Response(200, json=JOB)
        if path == "/v1/jobs/j1/report":
            return httpx.Response(200, json=REPORT)
        if path.startswith("/v1/jobs/"):
            return httpx.Response(404, json={"detail": f"job {path.split('/')[3]} not found"})
        return httpx.Response(404, json={"detail": "no such route"})

    def fake_client(opts: cli.Options) -> OpfuseClient:
        return OpfuseClient("http://fake", opts.key or "k", transport=httpx.MockTransport(handler))

    monkeypatch.setattr(cli, "_client", fake_client)
    return requests


def test_jobs_json_follows_cursors(fake_api: list[httpx.Request]) -> None:
    result = invoke("jobs", "--json", "--status", "succeeded")
    assert result.exit_code == 0, result.output
    assert [j["id"] for j in json.loads(result.stdout)] == ["j1", "j2"]
    assert fake_api[0].url.params["status"] == "succeeded"
    assert fake_api[1].url.params["cursor"] == "c2"


def test_status_table_and_json(fake_api: list[httpx.Request]) -> None:
    result = invoke("status", "j1")
    assert result.exit_code == 0
    assert "succeeded" in result.stdout and "19 → 9" in result.stdout
    assert json.loads(invoke("status", "j1", "--json").stdout)["id"] == "j1"


def test_report_tables_and_raw_json(fake_api: list[httpx.Request]) -> None:
    result = invoke("report", "j1")
    assert result.exit_code == 0, result.output
    for fragment in (
        "summary",
        "fusion groups",
        "not fused",
        "axis is not the last one",
        "verification",
        "passed",
    ):
        assert fragment in result.stdout
    assert json.loads(invoke("report", "j1", "--json").stdout) == REPORT


def test_server_detail_is_shown_on_4xx(fake_api: list[httpx.Request]) -> None:
    assert_one_line_error(invoke("status", "nope"), 1, "job nope not found (HTTP 404)")
    assert_one_line_error(
        invoke("status", "j1", "--key", "wrong"), 1, "invalid or revoked API key", "HTTP 401"
    )


# -- local compile and run with the real library ----------------------------------------------------


def small_mlp(path: Path, hidden: int = 16) -> onnx.ModelProto:
    """x[batch, h] → MatMul + Add → Relu → Mul(scale) + Add(shift), with a dynamic batch dim."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.3, "w"),
        numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b"),
        numpy_helper.from_array(np.array(0.5, dtype=np.float32), "s"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("Mul", ["r", "s"], ["q"]),
        helper.make_node("Add", ["q", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "small_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, path)
    return model


def _reference(model_path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def test_compile_then_run_locally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tmp_path / "mlp.onnx"
    small_mlp(model)
    bundle = tmp_path / "mlp.opfuse.zip"

    result = invoke(
        "compile", str(model), "-o", str(bundle), "--shape", "x=2x16", "--device", "cpu", "--json"
    )
    assert result.exit_code == 0, result.output
    compiled = json.loads(result.stdout)
    assert compiled["bundle"] == str(bundle) and bundle.is_file()
    assert compiled["report"]["verification"]["passed"] is True
    assert compiled["report"]["kernels"]["after"] < compiled["report"]["kernels"]["before"]

    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    out = tmp_path / "out.npz"
    result = invoke(
        "run", str(bundle), "--inputs", str(tmp_path / "in.npz"), "-o", str(out), "--json", "--device", "cpu"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outputs"] == {"y": {"dtype": "float32", "shape": [2, 16]}}
    y = np.load(out)["y"]
    ref = _reference(model, x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 1e-4

    # Human output: a summary and the outputs table.
    human = invoke("run", str(bundle), "--inputs", str(tmp_path / "in.npz"), "--device", "cpu")
    assert human.exit_code == 0 and "2x16" in human.stdout

    np.savez(tmp_path / "wrong.npz", x=np.zeros((3, 16), dtype=np.float32))
    wrong = invoke("run", str(bundle), "--inputs", str(tmp_path / "wrong.npz"), "--device", "cpu")
    assert_one_line_error(wrong, 1, "input 'x' has shape [3, 16]", "[2, 16]")


def test_compile_reports_model_errors_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tmp_path / "mlp.onnx"
    small_mlp(model)
    # No --shape: the dynamic batch dim cannot be specialized.
    result = invoke("compile", str(model), "-o", str(tmp_path / "b.zip"), "--device", "cpu", "--json")
    assert_one_line_error(result, 1, "batch")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01 definitely not protobuf")
    result = invoke("compile", str(garbage), "-o", str(tmp_path / "b.zip"), "--device", "cpu")
    assert_one_line_error(result, 1, "not an ONNX model")


def test_compile_reports_a_bug_in_opfuse_in_one_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception opfuse did not raise on purpose: no traceback, one line that says it is a bug
    in opfuse, with the exception's type and message."""
    from opfuse.pipeline import stages

    def optimize_onnx(model: Any) -> Any:
        raise ValueError("simulated internal fault\nsecond line of detail")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(stages, "optimize_onnx", optimize_onnx)
    model = tmp_path / "mlp.onnx"
    small_mlp(model)
    result = invoke(
        "compile", str(model), "-o", str(tmp_path / "b.zip"), "--shape", "x=2x16", "--device", "cpu"
    )
    assert_one_line_error(result, 1, "bug in opfuse", "ValueError: simulated internal fault", "report")
    assert "second line" not in result.stderr and not (tmp_path / "b.zip").exists()


def test_run_rejects_unreadable_inputs(tmp_path: Path) -> None:
    bundle = tmp_path / "b.zip"
    bundle.write_bytes(b"PK")
    (tmp_path / "in.npz").write_bytes(b"nonsense")
    result = invoke("run", str(bundle), "--inputs", str(tmp_path / "in.npz"))
    assert_one_line_error(result, 2, "cannot read", "in.npz")
    result = invoke("run", str(bundle), "--inputs", str(tmp_path / "missing.npz"))
    assert_one_line_error(result, 2, "inputs file", "does not exist")


def test_worker_command_says_what_is_missing(tmp_path: Path) -> None:
    assert_one_line_error(invoke("worker", "--once"), 2, "no server found")
    result = invoke("worker", "--api", "http://127.0.0.1:9", "--key-file", str(tmp_path / "nope"))
    assert_one_line_error(result, 2, "key file", "does not exist")
    result = invoke("worker", "--api", "http://127.0.0.1:9")
    assert_one_line_error(result, 2, "no worker key", "--key-file")
