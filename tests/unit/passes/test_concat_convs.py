"""`merge_concat_convs` (opfuse/passes/concat_convs.py) on a tiny graph: SqueezeNet's fire module,
a 1x1 and a 3x3 conv of one input, each with a Relu, concatenated along channels."""

from __future__ import annotations

import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.concat_convs import merge_concat_convs
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def fire(second_activation: str = "Relu") -> onnx.ModelProto:
    return tiny_model(
        [
            n("Conv", ["x", "w1", "b1"], ["c1"], name="expand1x1"),
            n("Relu", ["c1"], ["r1"], name="relu1"),
            n("Conv", ["x", "w3", "b3"], ["c3"], name="expand3x3", pads=[1, 1, 1, 1]),
            n(second_activation, ["c3"], ["r3"], name="act3"),
            n("Concat", ["r1", "r3"], ["y"], name="cat", axis=1),
        ],
        {"x": [1, 3, 5, 5]},
        {"y": [1, 7, 5, 5]},
        {
            "w1": weights(3, 3, 1, 1),
            "b1": weights(3, seed=1),
            "w3": weights(4, 3, 3, 3, seed=2),
            "b3": weights(4, seed=3),
        },
    )


def test_the_branches_are_one_convolution_and_one_relu() -> None:
    model = fire()
    graph = graph_of(model)
    log = run_pass(graph, merge_concat_convs)
    assert ops(graph) == ["Conv", "Relu"] and log.fired == {names.MERGE_CONCAT_CONVS: 1}
    assert graph.nodes[0].attrs["kernel_shape"] == [3, 3]
    assert_computes_as_onnxruntime(model, graph)


def test_branches_ending_in_different_activations_stay_apart() -> None:
    graph = graph_of(fire("Sigmoid"))
    log = run_pass(graph, merge_concat_convs)
    assert ops(graph) == ["Conv", "Relu", "Conv", "Sigmoid", "Concat"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["expand1x1", "relu1", "expand3x3", "act3", "cat"], "the branches end in different activations")
    ]
