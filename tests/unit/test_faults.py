"""No internal error reaches a user: a fault injected into one stage (codegen, kernel compile,
tuning, the first run) for one group leaves that group unfused, says why in fusion.not_fused, and
the compile still succeeds and verifies against onnxruntime; a planner fault leaves the model
unfused. Only the model's own faults (ModelError) fail a compile."""

from __future__ import annotations

import json
import types
from typing import Any

import numpy as np
import pytest

import opfuse
from opfuse.errors import ModelError
from opfuse.verify.reference import OnnxRuntimeReference
from tests.builders import TEST_DEVICE, softmax_then_gemm

ROW_NODES = ["Softmax#n0", "Mul#n1"]  # softmax_then_gemm's row group; its GEMM group is MatMul, Add, Relu
FAULT = "injected fault for this test"


def row_kernel_source() -> str:
    probe = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=0, verify=False)
    (source,) = [k.source for k in probe.plan.kernels.values() if k.kind == "rowwise"]
    return source


def assert_row_group_unfused(cm: Any, *words: str) -> None:
    """Verified, the GEMM group fused, the row group not, with the injected fault as its reason;
    and every output element matches onnxruntime on fresh random inputs."""
    report = cm.report
    assert report["verification"]["passed"] is True
    assert [g["kind"] for g in report["fusion"]["groups"]] == ["gemm"]
    assert [k.kind for k in cm.plan.kernels.values()] == ["gemm"]
    (entry,) = [nf for nf in report["fusion"]["not_fused"] if nf["nodes"] == ROW_NODES]
    assert entry["rule"] and FAULT in entry["reason"] and "unfused" in entry["reason"]
    for word in words:
        assert word in entry["reason"], entry["reason"]
    x = np.random.default_rng(9).standard_normal((8, 16)).astype(np.float32)
    ref = OnnxRuntimeReference(softmax_then_gemm()).run({"x": x})["y"]
    np.testing.assert_allclose(cm.run({"x": x})["y"], ref, rtol=1e-4, atol=1e-5)


def test_a_group_whose_codegen_raises_runs_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    from opfuse.codegen import registry  # every group is rendered through the template registry

    def generate_rowwise(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(FAULT)

    monkeypatch.setattr(registry, "generate_rowwise", generate_rowwise)
    cm = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=0)
    assert_row_group_unfused(cm, "codegen", "ValueError")


def test_a_group_whose_kernel_fails_to_compile_runs_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    from opfuse.runtime import executor

    bad, real = row_kernel_source(), executor.load_kernel_module

    def load_kernel_module(source: str, interpret: bool) -> Any:
        if source == bad:
            raise SyntaxError(FAULT)
        return real(source, interpret)

    monkeypatch.setattr(executor, "load_kernel_module", load_kernel_module)
    cm = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=0)
    assert_row_group_unfused(cm, "compiling its generated kernel", "SyntaxError")


def test_a_group_whose_kernel_raises_at_its_first_run_runs_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    from opfuse.runtime import executor

    bad, real = row_kernel_source(), executor.load_kernel_module
    launches: list[str] = []

    def load_kernel_module(source: str, interpret: bool) -> Any:
        module = real(source, interpret)
        if source != bad:
            return module
        faulty = types.ModuleType("faulty_kernel")
        faulty.__dict__.update(module.__dict__)

        def launch(*args: Any, **kwargs: Any) -> None:
            launches.append("row")
            raise RuntimeError(FAULT)

        faulty.launch = launch  # type: ignore[attr-defined]
        return faulty

    monkeypatch.setattr(executor, "load_kernel_module", load_kernel_module)
    cm = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=0)
    assert launches == ["row"]  # it ran once, failed, and never again
    assert_row_group_unfused(cm, "first run", "RuntimeError")


def test_a_group_whose_tuning_raises_runs_unfused(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from opfuse.tuning import candidates as tune

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OPFUSE_TUNE_INPROCESS", raising=False)
    real = tune.candidates

    def candidates(k: Any) -> list[dict[str, Any]]:
        if k.kind == "rowwise":
            raise KeyError(FAULT)
        return real(k)

    monkeypatch.setattr(tune, "candidates", candidates)
    cm = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=60)
    assert_row_group_unfused(cm, "tuning", "KeyError")
    (why,) = cm.report["tuning"]["unsafe"].values()
    assert why.startswith("tuning its kernel raised KeyError")
    cached = json.loads((tmp_path / "tuning.json").read_text())
    assert all("error" not in v for v in cached.values())  # the failure stays out of the cache


def _library_form_cannot_be_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM group's library form (the library's GEMM, then a pointwise kernel for the
    epilogue) fails to generate from now on: its epilogue's pointwise kernel raises."""
    from opfuse.codegen import registry

    def generate_pointwise(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(FAULT)

    monkeypatch.setattr(registry, "generate_pointwise", generate_pointwise)


def assert_gemm_kept_its_template(cm: Any, cached: bool) -> None:
    """Verified, both groups fused (the GEMM as its template, not unsafe), the reason in
    `tuning.variants`, every output element onnxruntime's."""
    report = cm.report
    assert report["verification"]["passed"] is True
    assert sorted(g["kind"] for g in report["fusion"]["groups"]) == ["gemm", "rowwise"]
    assert sorted(k.kind for k in cm.plan.kernels.values()) == ["gemm", "rowwise"]
    assert all(FAULT not in nf["reason"] for nf in report["fusion"]["not_fused"])
    (gemm,) = [g["id"] for g in report["fusion"]["groups"] if g["kind"] == "gemm"]
    chosen = report["tuning"]["variants"][gemm]
    assert chosen["choice"] == "template" and FAULT in chosen["vendor_error"], chosen
    assert bool(chosen.get("cached")) is cached
    assert gemm not in report["tuning"]["unsafe"]
    x = np.random.default_rng(5).standard_normal((8, 16)).astype(np.float32)
    ref = OnnxRuntimeReference(softmax_then_gemm()).run({"x": x})["y"]
    np.testing.assert_allclose(cm.run({"x": x})["y"], ref, rtol=1e-4, atol=1e-5)


def test_a_group_whose_library_form_cannot_be_generated_keeps_its_template(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tuning times the GEMM group's template against its library form. Where that form cannot
    be generated the group stays fused as its template, the report says why, and nothing of the
    choice is cached."""
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OPFUSE_TUNE_INPROCESS", raising=False)
    _library_form_cannot_be_generated(monkeypatch)
    cm = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=60)
    assert_gemm_kept_its_template(cm, cached=False)
    cached = json.loads((tmp_path / "tuning.json").read_text())
    assert not [k for k in cached if k.startswith("variant")], cached


def test_a_cached_library_choice_whose_form_cannot_be_generated_runs_the_template(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A choice cached by an earlier compile (here: the GEMM group's library form) whose form this
    compile cannot generate: the group runs its template, the report says why."""
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OPFUSE_TUNE_INPROCESS", raising=False)
    opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=60)
    path = tmp_path / "tuning.json"
    cached = json.loads(path.read_text())
    (key,) = [k for k in cached if k.startswith("variant")]
    cached[key]["choice"] = "vendor"
    path.write_text(json.dumps(cached))
    _library_form_cannot_be_generated(monkeypatch)
    cm = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=60)
    assert_gemm_kept_its_template(cm, cached=True)


def test_a_planner_fault_leaves_the_model_unfused_and_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    from opfuse.pipeline import stages

    def plan_fusion(*args: Any, **kwargs: Any) -> Any:
        raise IndexError(FAULT)

    monkeypatch.setattr(stages, "plan_fusion", plan_fusion)
    cm = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True and cm.report["fusion"]["groups"] == []
    (entry,) = [nf for nf in cm.report["fusion"]["not_fused"] if nf["rule"] == "fusion_planner"]
    assert FAULT in entry["reason"] and "IndexError" in entry["reason"] and "bug in opfuse" in entry["reason"]


def test_a_model_error_still_fails_the_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    from opfuse.codegen import registry  # every group is rendered through the template registry

    def generate_rowwise(*args: Any, **kwargs: Any) -> Any:
        raise ModelError("the model's own fault: say what to change")

    monkeypatch.setattr(registry, "generate_rowwise", generate_rowwise)
    with pytest.raises(ModelError, match="the model's own fault"):
        opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=0)


def test_a_fusion_rule_that_raises_leaves_only_its_own_groups_unfused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One rule's bug costs that rule's groups, not the plan: the row rule raises on its first
    candidate, the GEMM's epilogue is still fused, the plan verifies, and not_fused names the
    rule, the candidate's nodes and the exception."""
    from opfuse.fusion.rules import row_reduction

    def claim(self: Any, c: Any) -> None:
        raise KeyError(FAULT)

    monkeypatch.setattr(row_reduction.RULE, "claim", claim)
    cm = opfuse.compile(softmax_then_gemm(), device=TEST_DEVICE, tune_budget_s=0)
    report = cm.report
    assert report["verification"]["passed"] is True
    kinds = [g["kind"] for g in report["fusion"]["groups"]]
    assert "gemm" in kinds and "rowwise" not in kinds, kinds
    (entry,) = [nf for nf in report["fusion"]["not_fused"] if FAULT in nf["reason"]]
    assert entry["rule"] == "row_reduction" and entry["nodes"], entry
    assert "KeyError" in entry["reason"] and "bug in opfuse" in entry["reason"]
    x = np.random.default_rng(11).standard_normal((8, 16)).astype(np.float32)
    ref = OnnxRuntimeReference(softmax_then_gemm()).run({"x": x})["y"]
    np.testing.assert_allclose(cm.run({"x": x})["y"], ref, rtol=1e-4, atol=1e-5)


def test_a_group_whose_codegen_raises_only_beside_another_is_named_so() -> None:
    """Each group builds alone; "b" and "c" together raise (they wait on each other). The group
    the bisection leaves out says it raised only beside other groups; one that raises alone
    keeps its own error."""
    from opfuse.pipeline.builder import faulty_groups

    def build(subset: list[str]) -> None:
        if "d" in subset:
            raise ValueError("no template for d")
        if "b" in subset and "c" in subset:
            raise RuntimeError("fusion produced a cyclic plan")

    found = faulty_groups(["a", "b", "c", "d"], build)
    assert found.pop("d") == "generating its kernel raised ValueError: no template for d", found
    assert list(found.values()) == ["generating its kernel raised (only beside other groups)"], found
    assert set(found) <= {"b", "c"}, found
