"""`layout_prologue` (opfuse/fusion/rules/pad_prologue.py `input_transpose`): a channels-last
conv reads its NCHW input in place, where the region's Transpose to NHWC has no other reader."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import opfuse
from opfuse.frontend import rule_registry as names
from tests.builders import TEST_DEVICE, assert_every_config, claimed, planned, tiny_model, weights

FP32_NHWC = (names.FP32_DENSE_NCHW,)  # on the GPU, fp32 dense convs would otherwise stay NCHW


def _stem(
    channels: int, kernel: int, stride: int, pad: int, group: int, size: int = 10
) -> tuple[object, dict]:
    """Conv (the image's first reader), then a Relu and a 1x1 conv: a network's stem."""
    n = helper.make_node
    out = (size + 2 * pad - kernel) // stride + 1
    nodes = [
        n("Conv", ["x", "w", "b"], ["c"], name="stem", strides=[stride] * 2, pads=[pad] * 4, group=group),
        n("Relu", ["c"], ["r"], name="relu"),
        n("Conv", ["r", "w2"], ["y"], name="proj"),
    ]
    inits = {
        "w": weights(16, channels // group, kernel, kernel),
        "b": weights(16, seed=1),
        "w2": weights(8, 16, 1, 1),
    }
    shapes = {"x": [2, channels, size, size]}
    return tiny_model(nodes, shapes, {"y": [2, 8, out, out]}, inits), shapes


def test_the_stem_conv_reads_the_image_in_place() -> None:
    model, _ = _stem(3, 3, 2, 1, 1)
    _, plan = planned(model)
    rule = f"{names.CONV_EPILOGUE}+{names.LAYOUT_PROLOGUE}"
    assert claimed(plan)[0] == ("conv", rule, ["Transpose", "stem", "relu"])
    _, off = planned(model, (names.LAYOUT_PROLOGUE,))
    assert claimed(off)[0] == ("conv", names.CONV_EPILOGUE, ["stem", "relu"])


def test_a_wide_input_keeps_its_copy() -> None:
    """16 channels and more are read a channel block at a time, contiguous in NHWC only."""
    model, _ = _stem(16, 3, 1, 1, 1)
    _, plan = planned(model)
    assert claimed(plan)[0] == ("conv", names.CONV_EPILOGUE, ["stem", "relu"])


def test_a_transpose_two_convs_read_stays_a_copy() -> None:
    n = helper.make_node
    model = tiny_model(
        [
            n("Conv", ["x", "w"], ["a"], name="left", pads=[1] * 4),
            n("Conv", ["x", "w"], ["b"], name="right"),
            n("Relu", ["a"], ["y"], name="ra"),
            n("Relu", ["b"], ["z"], name="rb"),
        ],
        {"x": [1, 4, 6, 6]},
        {"y": [1, 8, 6, 6], "z": [1, 8, 4, 4]},
        {"w": weights(8, 4, 3, 3)},
    )
    _, plan = planned(model)
    rules = [rule for _, rule, _ in claimed(plan)]
    assert rules and all(names.LAYOUT_PROLOGUE not in rule for rule in rules)


@pytest.mark.parametrize(
    "channels, kernel, stride, pad, group",
    [
        (3, 3, 2, 1, 1),  # few channels: the flat K loop
        (3, 7, 2, 3, 1),
        (8, 3, 1, 1, 1),
        (12, 1, 1, 0, 1),
        (8, 3, 2, 1, 2),  # grouped: the block-diagonal loop
    ],
)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_an_nchw_read_computes_what_onnxruntime_does(
    channels: int, kernel: int, stride: int, pad: int, group: int, precision: str
) -> None:
    """Every element against onnxruntime, at the kernel's config and at every tuning candidate's
    (split-K's among them where the conv takes it)."""
    model, shapes = _stem(channels, kernel, stride, pad, group)
    cm = opfuse.compile(
        model,
        input_shapes=shapes,
        precision=precision,
        device=TEST_DEVICE,
        tune_budget_s=0,
        fusion_disable=FP32_NHWC,
    )
    assert cm.report["verification"]["passed"] is True
    (k,) = [k for k in cm.plan.kernels.values() if "# x [2, 10, 10" in k.source and "Transpose" in k.source]
    assert k.inputs[0] == "x"  # the model's NCHW input itself: no copy before the kernel
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type == "Transpose" and "x" in s.inputs]
    assert_every_config(cm, model, k, shapes, precision, seed=channels + kernel)


def test_the_library_form_transposes_then_runs_the_library_conv() -> None:
    """What tuning measures the template against: the Transpose and the library's conv as ops,
    then the epilogue's kernel; both forms compute what onnxruntime does."""
    import onnxruntime as ort

    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor

    model, shapes = _stem(3, 3, 2, 1, 1)
    p = plan_model(model, shapes, "fp32")
    (g,) = [g for g in p.fusion.groups if g.prologue]
    vendor = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    steps = [s.op_type or vendor.kernels[s.kernel].kind for s in vendor.steps if s.group == g.id]
    assert steps == ["Transpose", "opfuse.ConvNHWC", "pointwise"]
    x = np.random.default_rng(3).standard_normal(shapes["x"]).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, {"x": x})[0]
    for plan in (p.plan, vendor):
        got = np.asarray(Executor(plan, TEST_DEVICE).run({"x": x})["y"])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
