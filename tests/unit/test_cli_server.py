"""The `opfuse` commands and the typed SDK against the real API over HTTP (uvicorn on a free port,
the service tests' fixtures), with jobs finished through the worker protocol by reports and
bundles a real local compile made: upload, submit --model-id, models show/delete, jobs --sort,
status and listings with model names, profile, compare; and bench/run on the bundle locally.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import client.cli as cli
import opfuse
from client.records import Job, Model, Report
from client.sdk import OpfuseClient
from tests.service.conftest import (  # noqa: F401  (fixtures)
    Keys,
    api_url,
    client,
    keys,
    settings,
    sqlite_database_url,
    sqlite_template,
)
from tests.unit.test_cli import _reference, small_mlp

runner = CliRunner()


@pytest.fixture
def database_url(sqlite_database_url: str) -> str:  # noqa: F811
    return sqlite_database_url  # the routes are the same on PostgreSQL (tests/service covers both)


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("OPFUSE_API_URL", "OPFUSE_API_KEY", "OPFUSE_WORKER_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPFUSE_HOME", str(tmp_path / "cli-home"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("COLUMNS", "220")  # a wide terminal: table rows stay one line each
    monkeypatch.chdir(tmp_path)
    yield


@dataclass(frozen=True)
class Compiled:
    model: Path
    bundle: Path
    report: dict[str, Any]


def _compile(folder: Path, hidden: int) -> Compiled:
    model = folder / f"mlp{hidden}.onnx"
    small_mlp(model, hidden)
    cm = opfuse.compile(str(model), input_shapes={"x": [2, hidden]}, device="cpu")
    cm.benchmark(iters=3, warmup=1, input_sets=1)
    bundle = folder / f"mlp{hidden}.opfuse.zip"
    cm.save(bundle)
    return Compiled(model, bundle, json.loads(json.dumps(cm.report, default=str)))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Compiled]:
    """Two real compiles (hidden 16 and 24): their reports differ in every measured number."""
    folder = tmp_path_factory.mktemp("compiled")
    return {hidden: _compile(folder, hidden) for hidden in (16, 24)}


def opfuse_cli(url: str, key: str, *args: str) -> Any:
    """`opfuse ARGS --api URL --key KEY`, as a user types it (the real discovery from flags)."""
    return runner.invoke(cli.app, ["--api", url, "--key", key, *args])


def ok(result: Any) -> Any:
    assert result.exit_code == 0, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    return result


def one_line_error(result: Any, code: int, *fragments: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("opfuse: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def finish(url: str, keys: Keys, job: Job, done: Compiled) -> None:  # noqa: F811
    """Play the worker: claim `job`, upload the real bundle, complete it with the real report."""
    with OpfuseClient(url, keys.worker) as worker:
        claim = worker.claim("test-worker", "cpu")
        assert claim is not None and claim["job"]["id"] == job.id
        worker.upload_artifact(str(job.id), claim["lease_token"], done.bundle)
        worker.complete(str(job.id), claim["lease_token"], done.report)


def finished_job(url: str, keys: Keys, done: Compiled) -> tuple[Model, Job]:  # noqa: F811
    with OpfuseClient(url, keys.user) as sdk:
        model = sdk.upload_model(done.model)
        job = sdk.create_job(str(model.id), input_shapes={"x": [2, model.inputs[0].shape[1]]})  # type: ignore[list-item]
    finish(url, keys, job, done)
    return model, job


# -- the SDK's typed records -------------------------------------------------------------------------


def test_sdk_returns_typed_records(api_url: str, keys: Keys, compiled: dict[int, Compiled]) -> None:  # noqa: F811
    done = compiled[16]
    with OpfuseClient(api_url, keys.user) as sdk:
        model = sdk.upload_model(done.model)  # the README's snippet: attributes, not dict keys
        assert isinstance(model, Model) and model.name == "mlp16.onnx" and len(str(model.id)) > 8
        assert [(i.name, i.dtype, i.shape, i.dynamic) for i in model.inputs] == [
            ("x", "float32", ("batch", 16), True)
        ]
        assert model.raw == model.to_dict() and model["id"] == model.id  # the JSON is still there
        job = sdk.create_job(str(model.id), input_shapes={"x": [2, 16]})
        assert (job.status, job.model_id, job.summary) == ("queued", model.id, None)
        finish(api_url, keys, job, done)
        job = sdk.wait_job(str(job.id), poll_s=0.1, timeout_s=30)
        report = sdk.get_report(str(job.id))
        html = sdk.get_report_html(str(job.id))
    assert isinstance(report, Report) and report.raw == done.report
    assert job.done and job.summary is not None
    assert job.summary.kernels_before == done.report["kernels"]["before"] == report.kernels_before
    assert report.after is not None and report.after.p50 == done.report["after"]["latency_ms"]["p50"]
    assert [op.node for op in report.ops] == [op["node"] for op in done.report["profile"]["ops"]]
    assert [g.id for g in report.groups] == [g["id"] for g in done.report["fusion"]["groups"]]
    assert report.verification.passed is True and report.on_interpreter
    assert html.lstrip().lower().startswith("<!doctype html")


# -- upload, submit --model-id, models ---------------------------------------------------------------


def test_upload_then_submit_by_model_id(api_url: str, keys: Keys, compiled: dict[int, Compiled]) -> None:  # noqa: F811
    model_path = compiled[16].model
    uploaded = json.loads(ok(opfuse_cli(api_url, keys.user, "upload", str(model_path), "--json")).stdout)
    text = ok(opfuse_cli(api_url, keys.user, "upload", str(model_path), "--name", "again")).stdout
    assert f"opfuse submit --model-id {uploaded['id']} --shape x=..." in text  # its dim is dynamic
    with OpfuseClient(api_url, keys.user) as sdk:
        assert sdk.list_jobs() == []  # upload alone starts nothing

    listing = ok(opfuse_cli(api_url, keys.user, "models")).stdout
    assert "x float32 [batch, 16]" in listing and "y float32 [batch, 16]" in listing

    one_line_error(opfuse_cli(api_url, keys.user, "submit", "--model-id", uploaded["id"]), 2, "--shape x=")
    result = opfuse_cli(api_url, keys.user, "submit", "--model-id", uploaded["id"], "-s", "x=2x16", "--json")
    submitted = json.loads(ok(result).stdout)
    assert submitted["model"]["id"] == uploaded["id"] and submitted["job"]["model_id"] == uploaded["id"]
    assert submitted["job"]["options"]["input_shapes"] == {"x": [2, 16]}

    one_line_error(
        opfuse_cli(api_url, keys.user, "submit", str(model_path), "--model-id", uploaded["id"]), 2, "not both"
    )
    one_line_error(opfuse_cli(api_url, keys.user, "submit"), 2, "either a model file or --model-id")
    one_line_error(
        opfuse_cli(api_url, keys.user, "submit", "--model-id", "nope", "-s", "x=2x16"), 1, "HTTP 404"
    )
    # Another tenant cannot submit this tenant's model.
    one_line_error(
        opfuse_cli(api_url, keys.other, "submit", "--model-id", uploaded["id"], "-s", "x=2x16"), 1, "HTTP 404"
    )

    shown = json.loads(ok(opfuse_cli(api_url, keys.user, "models", "show", uploaded["id"], "--json")).stdout)
    assert shown == uploaded


def test_models_delete(api_url: str, keys: Keys, compiled: dict[int, Compiled]) -> None:  # noqa: F811
    with OpfuseClient(api_url, keys.user) as sdk:
        busy = sdk.upload_model(compiled[16].model)
        idle = sdk.upload_model(compiled[24].model)
        sdk.create_job(str(busy.id), input_shapes={"x": [2, 16]})
    one_line_error(opfuse_cli(api_url, keys.user, "models", "delete", str(busy.id)), 1, "HTTP 409")
    one_line_error(opfuse_cli(api_url, keys.other, "models", "delete", str(idle.id)), 1, "HTTP 404")
    text = ok(opfuse_cli(api_url, keys.user, "models", "delete", str(idle.id))).stdout
    assert f"deleted model {idle.id}" in text
    listed = json.loads(ok(opfuse_cli(api_url, keys.user, "models", "--json")).stdout)
    assert [m["id"] for m in listed] == [busy.id]
    one_line_error(opfuse_cli(api_url, keys.user, "models", "delete", str(idle.id)), 1, "HTTP 404")


# -- listings, sort, profile, compare -----------------------------------------------------------------


def test_jobs_sorted_with_model_names(api_url: str, keys: Keys, compiled: dict[int, Compiled]) -> None:  # noqa: F811
    finished = [finished_job(api_url, keys, done) for done in compiled.values()]
    with OpfuseClient(api_url, keys.user) as sdk:
        queued = sdk.create_job(str(finished[0][0].id), input_shapes={"x": [4, 16]})
    speedups = {
        str(job.id): done.report["speedup"]
        for (_, job), done in zip(finished, compiled.values(), strict=True)
    }
    assert len(set(speedups.values())) == 2, speedups

    by_speedup = json.loads(ok(opfuse_cli(api_url, keys.user, "jobs", "--sort", "speedup", "--json")).stdout)
    expected = [*sorted(speedups, key=lambda j: -speedups[j]), queued.id]
    assert [j["id"] for j in by_speedup] == expected  # largest first, the unfinished one last
    rising = json.loads(
        ok(opfuse_cli(api_url, keys.user, "jobs", "--sort", "speedup", "--ascending", "--json")).stdout
    )
    assert [j["id"] for j in rising] == [*sorted(speedups, key=lambda j: speedups[j]), queued.id]
    one_line_error(opfuse_cli(api_url, keys.user, "jobs", "--ascending"), 2, "--sort")
    assert opfuse_cli(api_url, keys.user, "jobs", "--sort", "colour").exit_code == 2

    table = ok(opfuse_cli(api_url, keys.user, "jobs", "--sort", "speedup")).stdout
    rows = [line for line in table.splitlines() if any(j in line for j in expected)]
    assert len(rows) == 3
    for row, job_id in zip(rows, expected, strict=True):
        assert job_id in row
    assert "mlp16.onnx" in table and "mlp24.onnx" in table
    status = ok(opfuse_cli(api_url, keys.user, "status", str(finished[1][1].id))).stdout
    assert f"mlp24.onnx ({finished[1][0].id})" in status


def _table_rows(text: str, title: str) -> list[list[str]]:
    """The body rows of the rich table titled `title` in `text`, cells stripped."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(title))
    rows = []
    for line in lines[start + 4 :]:
        if not line.startswith("│"):
            break
        rows.append([cell.strip() for cell in line.strip("│").split("│")])
    return rows


def test_profile_lists_steps_largest_first(api_url: str, keys: Keys, compiled: dict[int, Compiled]) -> None:  # noqa: F811
    done = compiled[24]
    _, job = finished_job(api_url, keys, done)
    profile = done.report["profile"]
    got = json.loads(ok(opfuse_cli(api_url, keys.user, "profile", str(job.id), "--json")).stdout)
    assert got == {"before": profile["ops"], "after": profile["after"]}

    text = ok(
        runner.invoke(cli.app, ["--api", api_url, "--key", keys.user, "profile", str(job.id), "--top", "0"])
    )
    text = text.stdout
    for title, steps in (("before: per op", profile["ops"]), ("after: per kernel", profile["after"])):
        rows = _table_rows(text, title)
        ranked = sorted(steps, key=lambda s: -s["time_ms"])
        assert [r[1] for r in rows] == [s["node"] for s in ranked]
        assert [float(r[3]) for r in rows] == pytest.approx([s["time_ms"] for s in ranked], rel=1e-3)
        total = sum(s["time_ms"] for s in steps)
        shares = [float(r[4].rstrip("%")) for r in rows]
        assert shares == pytest.approx([100 * s["time_ms"] / total for s in ranked], abs=0.051)
        assert [r[7] for r in rows] == [s.get("bound") or "-" for s in ranked]
    assert "interpreter" in text

    top = ok(opfuse_cli(api_url, keys.user, "profile", str(job.id), "-n", "1")).stdout
    assert len(_table_rows(top, "before: per op")) == 1
    assert f"{len(profile['ops']) - 1} smaller not shown" in top


def test_compare_side_by_side(api_url: str, keys: Keys, compiled: dict[int, Compiled]) -> None:  # noqa: F811
    jobs = [finished_job(api_url, keys, done)[1] for done in compiled.values()]
    ids = [str(j.id) for j in jobs]
    got = json.loads(ok(opfuse_cli(api_url, keys.user, "compare", *ids, "--json")).stdout)
    assert [g["report"] for g in got] == [done.report for done in compiled.values()]
    assert [g["model_name"] for g in got] == ["mlp16.onnx", "mlp24.onnx"]

    text = ok(opfuse_cli(api_url, keys.user, "compare", *ids)).stdout
    assert all(i in text for i in ids)

    def row(name: str) -> list[str]:
        line = next(line for line in text.splitlines() if line.strip("│ ").startswith(name))
        return [cell.strip() for cell in line.strip("│").split("│")][1:]

    reports = [done.report for done in compiled.values()]
    assert row("speedup") == [f"{r['speedup']:.2f}x" for r in reports]
    assert row("launches") == [f"{r['kernels']['before']} → {r['kernels']['after']}" for r in reports]
    assert row("fused groups") == [str(len(r["fusion"]["groups"])) for r in reports]
    p50 = [float(c) for c in row("p50 after ms")]
    assert p50 == pytest.approx([r["after"]["latency_ms"]["p50"] for r in reports], rel=1e-3)
    assert all(c.startswith("passed") for c in row("verification"))
    with OpfuseClient(api_url, keys.user) as sdk:
        queued = sdk.create_job(str(jobs[0].model_id), input_shapes={"x": [3, 16]})
    text = ok(opfuse_cli(api_url, keys.user, "compare", ids[0], str(queued.id))).stdout
    assert row("status") == ["succeeded", "queued"] and row("speedup")[1] == "-"
    assert row("model") == ["mlp16.onnx", "mlp16.onnx"]
    one_line_error(opfuse_cli(api_url, keys.user, "compare", ids[0]), 2, "two or more")
    one_line_error(opfuse_cli(api_url, keys.other, "compare", *ids), 1, "HTTP 404")


# -- bench and run on the bundle, locally --------------------------------------------------------------


def test_bench_random_and_given_inputs(compiled: dict[int, Compiled], tmp_path: Path) -> None:
    bundle = compiled[16].bundle
    args = ["bench", str(bundle), "--device", "cpu", "--warmup", "1", "-n", "3", "--json"]
    random = json.loads(ok(runner.invoke(cli.app, args)).stdout)
    assert random["inputs"] == "random" and (random["warmup"], random["iterations"]) == (1, 3)
    latency = random["latency_ms"]
    assert 0 < latency["p50"] <= latency["p99"] and "interpreter" in random["note"]

    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    given = json.loads(ok(runner.invoke(cli.app, [*args, "--inputs", str(tmp_path / "x.npy")])).stdout)
    assert given["inputs"] == str(tmp_path / "x.npy") and given["method"] == "wall time per run"
    assert 0 < given["latency_ms"]["p50"] <= given["latency_ms"]["p99"]

    text = ok(runner.invoke(cli.app, args[:-1])).stdout
    assert "latency p50" in text and "say nothing about GPU speed" in text
    np.savez(tmp_path / "wrong.npz", z=x)
    result = runner.invoke(cli.app, [*args, "--inputs", str(tmp_path / "wrong.npz")])
    one_line_error(result, 2, "no array for x", "no input named z", "x [2, 16]")


def test_run_takes_an_npy_for_a_one_input_model(compiled: dict[int, Compiled], tmp_path: Path) -> None:
    done = compiled[16]
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "y.npz"
    args = ["run", str(done.bundle), "--inputs", str(tmp_path / "x.npy"), "-o", str(out), "--device", "cpu"]
    described = json.loads(ok(runner.invoke(cli.app, [*args, "--json"])).stdout)
    assert described["outputs"] == {"y": {"dtype": "float32", "shape": [2, 16]}}
    with np.load(out) as saved:
        np.testing.assert_allclose(saved["y"], _reference(done.model, x), rtol=1e-4, atol=1e-5)

    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    result = runner.invoke(cli.app, ["run", str(done.bundle), "--inputs", str(tmp_path / "bad.npy")])
    one_line_error(result, 2, "cannot read", "np.save(path, array)")


def test_an_npy_for_a_model_of_several_inputs_says_how() -> None:
    from client.commands.common import CLIError
    from client.inputs import bind_inputs

    specs = [{"name": "ids", "shape": [1, 7]}, {"name": "mask", "shape": [1, 7]}]
    with pytest.raises(
        CLIError, match=re.escape("has 2 inputs (ids [1, 7], mask [1, 7]); save them by name")
    ):
        bind_inputs(np.ones((1, 7)), specs, Path("x.npy"))
