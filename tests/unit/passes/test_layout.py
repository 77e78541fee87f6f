"""`to_channels_last` (opfuse/passes/layout.py) on a tiny graph: a conv region goes NHWC with
Transposes at its edges."""

from __future__ import annotations

import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.ir.ops import NHWC_CONV
from opfuse.passes.layout import FP32_DENSE_REASON
from opfuse.passes.pipeline import PASSES
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node
PASS = next(p for p in PASSES if p.name == names.CHANNELS_LAST)


def conv_relu_pool() -> onnx.ModelProto:
    return tiny_model(
        [
            n("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            n("Relu", ["c"], ["r"], name="relu"),
            n("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        ],
        {"x": [1, 3, 6, 6]},
        {"y": [1, 4, 3, 3]},
        {"w": weights(4, 3, 3, 3), "b": weights(4, seed=1)},
    )


def test_a_conv_region_runs_channels_last_between_two_transposes() -> None:
    model = conv_relu_pool()
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert ops(graph) == ["Transpose", NHWC_CONV, "Relu", "opfuse.MaxPoolNHWC", "Transpose"]
    assert log.fired == {names.CHANNELS_LAST: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_a_1d_convolution_stays_nchw() -> None:
    model = tiny_model(
        [n("Conv", ["x", "w"], ["y"], name="conv1d")],
        {"x": [1, 3, 8]},
        {"y": [1, 2, 6]},
        {"w": weights(2, 3, 3)},
    )
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert ops(graph) == ["Conv"] and log.fired == {}
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["conv1d"], "a 1-D convolution: channels-last covers 2-D")
    ]


def test_dense_convolutions_in_fp32_on_the_gpu_stay_nchw() -> None:
    graph = graph_of(conv_relu_pool())
    log = run_pass(graph, PASS, device="cuda")  # the decision only: nothing runs on the device
    assert ops(graph) == ["Conv", "Relu", "MaxPool"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [(["conv"], FP32_DENSE_REASON)]
    assert log.fired == {names.FP32_DENSE_NCHW: 1}
