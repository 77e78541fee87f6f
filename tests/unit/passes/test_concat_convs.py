"""`merge_concat_convs` (opfuse/passes/concat_convs.py) on a tiny graph: SqueezeNet's fire module,
a 1x1 and a 3x3 conv of one input, each with a Relu, concatenated along channels."""

from __future__ import annotations

import numpy as np
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


def mixconv(second_group: int = 3) -> onnx.ModelProto:
    """MixNet's MixConv: the channels split in two, a depthwise 3x3 and a depthwise 5x5 conv
    (dilated, padded to keep the size), concatenated back."""
    return tiny_model(
        [
            n("Split", ["x", "sizes"], ["x0", "x1"], name="split", axis=1),
            n("Conv", ["x0", "w3", "b3"], ["c0"], name="dw3x3", group=2, pads=[2, 2, 2, 2], dilations=[2, 2]),
            n(
                "Conv",
                ["x1", "w5"],
                ["c1"],
                name="dw5x5",
                group=second_group,
                pads=[4, 4, 4, 4],
                dilations=[2, 2],
            ),
            n("Concat", ["c0", "c1"], ["y"], name="cat", axis=1),
        ],
        {"x": [2, 5, 7, 6]},
        {"y": [2, 5, 7, 6]},
        {
            "sizes": np.array([2, 3], dtype=np.int64),
            "w3": weights(2, 1, 3, 3),
            "b3": weights(2, seed=1),
            "w5": weights(3, 3 // second_group, 5, 5, seed=2),
        },
    )


def test_depthwise_convs_of_a_splits_parts_are_one_depthwise_conv() -> None:
    """Each channel's kernel in one 5x5 window (the 3x3 in its centre, on the dilation grid): the
    Split, the two convs and the Concat are one depthwise conv of the Split's input."""
    model = mixconv()
    graph = graph_of(model)
    log = run_pass(graph, merge_concat_convs)
    assert ops(graph) == ["Conv"] and log.fired == {names.MERGE_CONCAT_CONVS: 1}
    (conv,) = graph.nodes
    assert conv.inputs[0] == "x" and conv.attrs["group"] == 5 and conv.attrs["kernel_shape"] == [5, 5]
    assert conv.attrs["pads"] == [4, 4, 4, 4]
    assert_computes_as_onnxruntime(model, graph)


def test_a_dense_conv_of_a_splits_part_is_not_merged() -> None:
    graph = graph_of(mixconv(second_group=1))
    log = run_pass(graph, merge_concat_convs)
    assert ops(graph) == ["Split", "Conv", "Conv", "Concat"]
    assert [r.reason for r in log.not_fired] == [
        "a Split's part is read by a convolution that is not depthwise"
    ]
