"""The report and manifest of a small compile keep every key users and docs/bundle.md rely on.

The expected keys were read from the report of the compiler before its pipeline became stages;
any stage that moves must still fill them. Keys that only some compiles have (a speedup note
where the fused plan ran slower, a verification note) are allowed, never required.
"""

from __future__ import annotations

from typing import Any

import pytest

import opfuse
from tests.builders import TEST_DEVICE, residual_mlp

REPORT = {
    "device",
    "precision",
    "kernels",
    "compute_nodes",
    "speedup",
    "peers",
    "verification",
    "fusion",
    "profile",
    "tuning",
    "memory",
    "timings_s",
    "cuda_graph",
    "before",
    "after",
}
OPTIONAL = {"speedup_note", "after_stepwise"}
NESTED = {
    ("device",): {"kind", "name", "capability", "torch", "triton"},
    ("kernels",): {"before", "after"},
    ("verification",): {"passed", "reference", "outputs", "rolled_back", "trials"},
    ("fusion",): {"groups", "not_fused", "passes", "coverage"},
    ("fusion", "passes"): {"fired", "onnx_optimizer"},
    ("fusion", "coverage"): {"compute_nodes", "fused", "share"},
    ("profile",): {"roofline", "ops", "after", "timing"},
    ("profile", "roofline"): {
        "device",
        "source",
        "precision",
        "peak_tflops",
        "bandwidth_tb_per_s",
        "ridge_flop_per_byte",
    },
    ("memory",): {"arena_bytes", "unshared_bytes", "max_live_bytes", "buffers", "scratch_bytes"},
    ("cuda_graph",): {"capturable", "blockers", "blocker_count"},
    ("timings_s",): {"load", "fuse", "codegen", "profile", "tune", "verify", "benchmark"},
}
MEASURED = {
    "latency_ms",
    "throughput_per_s",
    "peak_memory_bytes",
    "kernel_launches_measured",
    "cuda_graph",
    "gpu_util_pct",
    "iterations",
}
GROUP = {"id", "kind", "rule", "nodes", "kernel", "bytes_saved_est", "time_ms_before", "time_ms_after"}
PROFILE_OP = {"node", "op_type", "time_ms", "bytes", "flops", "intensity", "bound"}
OUTPUT_CHECK = {"max_abs_err", "rel_l2_err", "rtol", "atol", "passed"}
MANIFEST = {
    "format",
    "version",
    "source",
    "target",
    "precision",
    "inputs",
    "outputs",
    "created_at",
}
TUNING = {"kernels", "variants", "warm", "lone_anchors", "unsafe_groups", "unsafe", "cache_hits", "summary"}
SUMMARY = {"budget_s", "kernels", "timed", "cached", "budget_spent", "candidates_left_out"}


def _at(report: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    d = report
    for key in path:
        d = d[key]
    return d


@pytest.fixture(scope="module")
def benchmarked() -> opfuse.CompiledModel:
    cm = opfuse.compile(residual_mlp(), {"x": [4, 32]}, device=TEST_DEVICE)
    cm.benchmark(iters=2, warmup=1, input_sets=1)
    return cm


def test_a_benchmarked_report_has_every_key(benchmarked: opfuse.CompiledModel) -> None:
    report = benchmarked.report
    assert REPORT <= set(report) <= REPORT | OPTIONAL
    for path, keys in NESTED.items():
        assert set(_at(report, path)) == keys, path
    for side in ("before", "after"):
        assert set(report[side]) >= MEASURED, side
        assert set(report[side]["latency_ms"]) == {"p50", "p90", "p99", "mean"}
    assert report["fusion"]["groups"] and all(set(g) >= GROUP for g in report["fusion"]["groups"])
    assert all({"rule", "nodes", "reason"} <= set(nf) for nf in report["fusion"]["not_fused"])
    assert report["profile"]["ops"] and all(set(op) == PROFILE_OP for op in report["profile"]["ops"])
    assert all(set(op) == PROFILE_OP for op in report["profile"]["after"])
    assert set(report["verification"]["outputs"]) == {"y"}
    assert set(report["verification"]["outputs"]["y"]) >= OUTPUT_CHECK
    assert report["verification"]["passed"] is True and report["tuning"] == {}
    manifest = benchmarked.manifest
    assert set(manifest) == MANIFEST
    assert set(manifest["source"]) == {"sha256", "name", "opset"}
    assert set(manifest["target"]) == {"device", "gpu_name", "capability", "torch", "triton", "cuda"}
    assert [set(s) for s in manifest["inputs"]] == [{"name", "dtype", "shape"}]


def test_a_tuned_report_has_every_tuning_key(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU tuning runs only with an explicit budget: it runs here, in its worker."""
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    cm = opfuse.compile(residual_mlp(), {"x": [4, 32]}, device=TEST_DEVICE, tune_budget_s=30)
    tuning = cm.report["tuning"]
    assert set(tuning) >= TUNING and set(tuning["summary"]) == SUMMARY
    assert set(tuning["lone_anchors"]) == {"template", "library"}
    assert set(tuning["kernels"]) == set(cm.plan.kernels)
    assert all("config" in k for k in tuning["kernels"].values())
    assert all({"choice", "template_ms", "vendor_ms"} <= set(v) for v in tuning["variants"].values())
    assert set(cm.report["timings_s"]) == NESTED[("timings_s",)] - {"benchmark"}
    assert cm.report["verification"]["passed"] is True
