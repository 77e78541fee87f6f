"""`apply_precision` (opfuse/passes/precision.py) on a tiny graph: in fp16 the float32 weights and
values become float16, Resize's scales stay float32; fp32 changes nothing. It records no reasons."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from opfuse.passes.precision import apply_precision
from tests.builders import graph_of, run_graph, tiny_model, weights

n = helper.make_node


def scaled_resize() -> onnx.ModelProto:
    return tiny_model(
        [
            n("Mul", ["x", "w"], ["m"], name="scale"),
            n("Resize", ["m", "", "scales"], ["y"], name="up", mode="nearest"),
        ],
        {"x": [1, 2, 2, 2]},
        {"y": [1, 2, 4, 4]},
        {"w": 1.0 + weights(1, 2, 1, 1), "scales": np.array([1.0, 1.0, 2.0, 2.0], np.float32)},
    )


def test_fp16_casts_weights_and_values_but_not_resize_scales() -> None:
    model = scaled_resize()
    graph = graph_of(model)
    apply_precision(graph, "fp16")
    assert graph.constants["w"].dtype == np.float16 and graph.constants["scales"].dtype == np.float32
    assert graph.spec("m").dtype == "float16" and graph.spec("scales").dtype == "float32"
    x = np.random.default_rng(0).standard_normal((1, 2, 2, 2)).astype(np.float32)
    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    got = run_graph(graph, {"x": x.astype(np.float16)})["y"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3)


def test_fp32_leaves_the_graph_as_it_was() -> None:
    graph = graph_of(scaled_resize())
    before = {k: v.copy() for k, v in graph.constants.items()}
    specs = dict(graph.values)
    apply_precision(graph, "fp32")
    assert graph.values == specs and graph.constants.keys() == before.keys()
    assert all(
        graph.constants[k].dtype == v.dtype and np.array_equal(graph.constants[k], v)
        for k, v in before.items()
    )


def test_fp16_keeps_a_nonzero_scalar_nonzero_and_a_finite_constant_finite() -> None:
    from opfuse.passes.precision import FP16_MAX, FP16_TINY, to_float16

    a = np.array([1e-12, -3e-9, 0.0, 1.5, -2e5, 7e4, np.inf, -np.inf, 1e-6], np.float32)
    got = to_float16(a)  # a tensor: what underflows is zero, as .half() gives
    want = np.array([0.0, -0.0, 0.0, 1.5, -FP16_MAX, FP16_MAX, np.inf, -np.inf, 1e-6])
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want.astype(np.float16))
    for eps in (1e-12, -3e-9):  # a scalar (an epsilon): the nearest nonzero float16 of its sign
        for shape in ((), (1,), (1, 1)):
            one = to_float16(np.full(shape, eps, np.float32))
            assert one.shape == shape and one.item() == np.copysign(FP16_TINY, eps)
    w = weights(64, 64)  # ordinary weights: exactly numpy's float16
    np.testing.assert_array_equal(to_float16(w), w.astype(np.float16))


def test_an_epsilon_below_float16_keeps_a_zero_row_finite_in_fp16() -> None:
    """y = x / max(||x||, 1e-12) over rows, as F.normalize exports: a zero row of x is 0 in float32
    (onnxruntime) and stays 0 in fp16, not 0/0; the other rows match onnxruntime."""
    import opfuse
    from tests.builders import TEST_DEVICE

    model = tiny_model(
        [
            n("ReduceL2", ["x", "axes"], ["norm"], keepdims=1),
            n("Max", ["norm", "eps"], ["den"]),
            n("Div", ["x", "den"], ["y"]),
        ],
        {"x": [6, 32]},
        {"y": [6, 32]},
        {"axes": np.array([1], np.int64), "eps": np.array(1e-12, np.float32)},
    )
    x = np.random.default_rng(5).standard_normal((6, 32)).astype(np.float32)
    x[2] = 0.0
    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    cm = opfuse.compile(model, {"x": [6, 32]}, "fp16", device=TEST_DEVICE, tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True, cm.report["verification"]
    got = np.asarray(cm.run({"x": x.astype(np.float16)})["y"], dtype=np.float32)
    assert np.isfinite(got).all() and (got[2] == 0).all(), got[2]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
