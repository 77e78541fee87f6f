"""Output comparison: relative L2 within rtol, or every element within atol, said plainly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from opfuse.verify.compare import compare_outputs

RNG = np.random.default_rng(8)


def test_close_outputs_pass_and_far_ones_fail() -> None:
    ref = RNG.standard_normal((4, 64)).astype(np.float32)
    near = ref + 1e-3 * RNG.standard_normal(ref.shape).astype(np.float32)
    ok = compare_outputs(near, ref, rtol=2e-2, atol=1e-3)
    assert ok.passed and ok.reason == "" and 0 < ok.rel_l2_err < 2e-2
    far = compare_outputs(ref + 0.5, ref, rtol=2e-2, atol=1e-3)
    assert not far.passed and far.rel_l2_err > 0.3


def test_a_pass_on_atol_alone_says_so() -> None:
    ref = (1e-8 * RNG.standard_normal((2, 10))).astype(np.float32)  # a vanishing reference
    out = np.zeros_like(ref)  # relative error 1.0, absolute error tiny
    check = compare_outputs(out, ref, rtol=2e-2, atol=1e-3)
    assert check.passed and check.rel_l2_err == 1.0
    assert "atol alone" in check.reason and check.to_json()["reason"] == check.reason


def test_a_vanishing_reference_is_held_to_rtol_where_the_precision_has_the_range() -> None:
    """fp32, tf32 and bf16 represent 1e-8 as exactly (relatively) as 1: atol would pass anything."""
    ref = (1e-8 * RNG.standard_normal((2, 10))).astype(np.float32)
    wrong = (ref * 1.3).astype(np.float32)  # 30% off everywhere, every element within atol
    check = compare_outputs(wrong, ref, rtol=1e-4, atol=1e-5, scale_free=True)
    assert not check.passed and "held to rtol" in check.reason
    right = (ref * (1 + 1e-6)).astype(np.float32)
    assert compare_outputs(right, ref, rtol=1e-4, atol=1e-5, scale_free=True).passed
    assert compare_outputs(wrong, ref, rtol=1e-4, atol=1e-5).passed  # fp16's rule: atol, flagged


def test_fp32_compile_rolls_back_a_wrong_kernel_whose_reference_vanishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model whose outputs are ~1e-9 everywhere: a fused kernel 30% off must fail fp32
    verification and be rolled back, not pass on atol."""
    from onnx import helper

    import opfuse
    from opfuse.runtime import executor as ex
    from tests.builders import TEST_DEVICE
    from tests.unit.test_fusion import make_model

    nodes = [helper.make_node("Mul", ["x", "s"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    model = make_model(nodes, {"x": [4, 16]}, {"y": [4, 16]}, {"s": np.full(16, 1e-9)})
    run_step = ex.Executor._run_step

    def skewed(self: ex.Executor, i: int, step: Any, env: dict[str, Any], arena: bool = False) -> None:
        run_step(self, i, step, env, arena)
        if step.kind == "kernel":  # every generated kernel comes out 30% high
            for o in step.outputs:
                env[o].mul_(1.3)

    monkeypatch.setattr(ex.Executor, "_run_step", skewed)
    cm = opfuse.compile(model, {"x": [4, 16]}, device=TEST_DEVICE, tune_budget_s=0)
    v = cm.report["verification"]
    assert v["passed"] is True and v["rolled_back"], v
    assert cm.report["kernels"]["after"] == cm.report["kernels"]["before"]


def test_nan_where_the_reference_has_none_fails() -> None:
    ref = RNG.standard_normal(8).astype(np.float32)
    out = ref.copy()
    out[3] = np.nan
    check = compare_outputs(out, ref, rtol=1.0, atol=1.0)
    assert not check.passed and "NaN" in check.reason


def test_compile_runs_the_reference_once_per_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that onnxruntime can run the model is the first trial: two trials, two runs."""
    import opfuse
    from opfuse.compiler import VERIFY_TRIALS
    from opfuse.verify.reference import OnnxRuntimeReference
    from tests.builders import TEST_DEVICE, residual_mlp

    calls = []
    original = OnnxRuntimeReference.run

    def counted(self: OnnxRuntimeReference, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(1)
        return original(self, feeds)

    monkeypatch.setattr(OnnxRuntimeReference, "run", counted)
    cm = opfuse.compile(residual_mlp(), {"x": [4, 32]}, device=TEST_DEVICE)
    assert (
        cm.report["verification"]["passed"] is True and cm.report["verification"]["trials"] == VERIFY_TRIALS
    )
    assert len(calls) == VERIFY_TRIALS


def test_reference_outputs_are_computed_beside_the_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime's runs for the first trials happen in a background thread while the plan is
    profiled and tuned; the check waits for them."""
    import threading

    import opfuse
    from opfuse.verify.reference import OnnxRuntimeReference
    from tests.builders import TEST_DEVICE, residual_mlp

    threads: list[str] = []
    original = OnnxRuntimeReference.run

    def traced(self: OnnxRuntimeReference, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        threads.append(threading.current_thread().name)
        return original(self, feeds)

    monkeypatch.setattr(OnnxRuntimeReference, "run", traced)
    cm = opfuse.compile(residual_mlp(), {"x": [4, 32]}, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    assert threads and threading.main_thread().name not in threads


def test_a_failure_while_preparing_the_reference_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    import opfuse
    from opfuse import compiler
    from opfuse.verify.reference import OnnxRuntimeReference
    from tests.builders import TEST_DEVICE, residual_mlp

    def no_ort(self: OnnxRuntimeReference, model: Any) -> None:
        raise ValueError("onnxruntime cannot load this")

    def no_fallback(self: Any, plan: Any, why: str) -> None:
        raise RuntimeError("the fallback reference failed too")

    monkeypatch.setattr(OnnxRuntimeReference, "__init__", no_ort)
    monkeypatch.setattr(compiler._UnfusedReference, "__init__", no_fallback)
    with pytest.raises(RuntimeError, match="fallback reference failed too"):
        opfuse.compile(residual_mlp(), {"x": [4, 32]}, device=TEST_DEVICE)
