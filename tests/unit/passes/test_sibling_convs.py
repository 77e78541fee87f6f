"""`sum_sibling_convs` and `merge_sibling_convs` (opfuse/passes/sibling_convs.py) on tiny graphs:
two convolutions of one input."""

from __future__ import annotations

import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.ir.ops import NHWC_CONV
from opfuse.passes.pipeline import PASSES
from opfuse.passes.sibling_convs import sum_sibling_convs
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node
LAYOUT, MERGE = (
    next(p for p in PASSES if p.name == r) for r in (names.CHANNELS_LAST, names.MERGE_SIBLING_CONVS)
)


def siblings(second_stride: int = 1, add: bool = True) -> onnx.ModelProto:
    nodes = [
        n("Conv", ["x", "w1", "b1"], ["c1"], name="conv3x3", pads=[1, 1, 1, 1]),
        n("Conv", ["x", "w2", "b2"], ["c2"], name="conv1x1", strides=[second_stride] * 2),
    ]
    size = (6 - 1) // second_stride + 1
    if add:
        nodes.append(n("Add", ["c1", "c2"], ["y"], name="add"))
        outputs = {"y": [1, 4, 6, 6]}
    else:
        nodes += [n("Relu", ["c1"], ["y1"], name="r1"), n("Sigmoid", ["c2"], ["y2"], name="r2")]
        outputs = {"y1": [1, 4, 6, 6], "y2": [1, 5, size, size]}
    out2 = 4 if add else 5
    return tiny_model(
        nodes,
        {"x": [1, 3, 6, 6]},
        outputs,
        {
            "w1": weights(4, 3, 3, 3),
            "b1": weights(4, seed=1),
            "w2": weights(out2, 3, 1, 1, seed=2),
            "b2": weights(out2, seed=3),
        },
    )


def test_two_convolutions_of_one_input_summed_are_one_convolution() -> None:
    model = siblings()
    graph = graph_of(model)
    log = run_pass(graph, sum_sibling_convs)
    assert ops(graph) == ["Conv"] and log.fired == {names.SUM_SIBLING_CONVS: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_convolutions_read_by_more_than_the_add_are_not_summed() -> None:
    graph = graph_of(siblings(add=False))
    log = run_pass(graph, sum_sibling_convs)
    assert ops(graph) == ["Conv", "Conv", "Relu", "Sigmoid"] and log.fired == {} and log.not_fired == []


def test_sibling_convolutions_channels_last_are_one_convolution_and_a_split() -> None:
    model = siblings(add=False)
    graph = graph_of(model)
    run_pass(graph, LAYOUT)
    log = run_pass(graph, MERGE)
    assert ops(graph) == ["Transpose", NHWC_CONV, "Split", "Relu", "Sigmoid", "Transpose", "Transpose"]
    assert log.fired == {names.MERGE_SIBLING_CONVS: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_sibling_convolutions_of_different_strides_stay_apart() -> None:
    graph = graph_of(siblings(second_stride=2, add=False))
    run_pass(graph, LAYOUT)
    log = run_pass(graph, MERGE)
    assert ops(graph).count(NHWC_CONV) == 2 and log.fired == {}
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["conv3x3", "conv1x1"], "the convolutions differ in strides, dilations or output size")
    ]
