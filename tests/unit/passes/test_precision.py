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
