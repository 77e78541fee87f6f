"""The pipeline's stages: the order the code runs them in, STAGES, the progress a compile reports
and docs/design.md's table agree; a stage out of that order is an error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import opfuse
from opfuse.pipeline.context import STAGES, CompileContext
from tests.builders import TEST_DEVICE, residual_mlp

DOCS = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_a_compile_reports_its_stages_in_the_order_of_stages() -> None:
    seen: list[tuple[str, float]] = []
    cm = opfuse.compile(
        residual_mlp(), {"x": [4, 32]}, device=TEST_DEVICE, progress=lambda s, f: seen.append((s, f))
    )
    names = [s for s, _ in seen]
    # opfuse.compile runs all but benchmarking and packaging (CompiledModel.benchmark, .save).
    assert names == list(STAGES[:6])
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[-1] < 0.96  # the worker's benchmarking: 0.96
    assert set(cm.report["timings_s"]) == {"load", "fuse", "codegen", "profile", "tune", "verify"}
    assert all(t >= 0 for t in cm.report["timings_s"].values())


def test_the_service_the_worker_and_the_docs_know_the_same_stages() -> None:
    pytest.importorskip("sqlalchemy", reason="the service's extras are not installed (a GPU image)")
    from service.models import Stage
    from workers.child import STAGES as WORKER_STAGES

    assert {s.value for s in Stage} == set(STAGES) == WORKER_STAGES
    rows = re.findall(r"^\| (\w+) \| `", DOCS.read_text(), re.MULTILINE)
    table = [r for r in rows if r in STAGES]
    assert table == list(STAGES), "docs/design.md §10's table lists the stages in another order"


def test_a_stage_out_of_order_or_unknown_is_an_error() -> None:
    calls: list[str] = []
    ctx = CompileContext(lambda stage, fraction: calls.append(stage))
    with ctx.stage("loading", 0.0, "load"):
        pass
    with ctx.stage("fusing", 0.3, "fuse"):
        pass
    with pytest.raises(RuntimeError, match="'loading' entered after 'fusing'"), ctx.stage("loading", 0.4):
        pass
    with pytest.raises(ValueError, match="unknown compile stage 'linking'"), ctx.stage("linking", 0.5):
        pass
    assert calls == ["loading", "fusing"] and set(ctx.timings) == {"load", "fuse"}


def test_stages_sharing_a_timing_key_add_up() -> None:
    import time

    ctx = CompileContext()
    with ctx.stage("codegen", 0.4, "build"):
        time.sleep(0.01)
    with ctx.stage("profiling", 0.5, "build"):
        time.sleep(0.01)
    with ctx.stage("tuning", 0.55):  # no key: timed nowhere
        pass
    assert list(ctx.timings) == ["build"] and ctx.timings["build"] >= 0.02
