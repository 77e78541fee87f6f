"""`fold_channel_shuffles` (opfuse/passes/channel_shuffle.py) on a tiny graph: ShuffleNet's
Reshape -> Transpose -> Reshape over the channels, absorbed by the 1x1 conv that reads it.

The pass records no reasons: a shuffle it cannot absorb stays a Gather, one it does not recognise
stays as written."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.channel_shuffle import fold_channel_shuffles
from opfuse.passes.rules import GraphRule
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node
PASS = GraphRule(names.FOLD_CHANNEL_SHUFFLE, lambda g, ctx: fold_channel_shuffles(g, ctx.log))


def shuffle(perm: list[int], then_conv: bool = True) -> onnx.ModelProto:
    nodes = [
        n("Relu", ["x"], ["r"], name="relu"),
        n("Reshape", ["r", "split"], ["g"], name="split"),
        n("Transpose", ["g"], ["t"], name="swap", perm=perm),
        n("Reshape", ["t", "merge"], ["s" if then_conv else "y"], name="merge"),
    ]
    if then_conv:
        nodes.append(n("Conv", ["s", "w", "b"], ["y"], name="conv"))
    return tiny_model(
        nodes,
        {"x": [1, 6, 2, 2]},
        {"y": [1, 5 if then_conv else 6, 2, 2]},
        {
            "split": np.array([1, 2, 3, 2, 2]),
            "merge": np.array([1, 6, 2, 2]),
            "w": weights(5, 6, 1, 1),
            "b": weights(5, seed=1),
        },
    )


def test_a_shuffle_read_by_a_conv_is_folded_into_its_weight() -> None:
    model = shuffle([0, 2, 1, 3, 4])
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert ops(graph) == ["Relu", "Conv"] and log.fired == {names.FOLD_CHANNEL_SHUFFLE: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_a_shuffle_nothing_absorbs_stays_one_gather() -> None:
    model = shuffle([0, 2, 1, 3, 4], then_conv=False)
    graph = graph_of(model)
    run_pass(graph, PASS)
    assert ops(graph) == ["Relu", "Gather"]
    assert_computes_as_onnxruntime(model, graph)


def test_a_transpose_that_is_not_a_shuffle_is_left_alone() -> None:
    graph = graph_of(shuffle([0, 1, 2, 4, 3]))
    log = run_pass(graph, PASS)
    assert ops(graph) == ["Relu", "Reshape", "Transpose", "Reshape", "Conv"] and log.fired == {}


def test_a_split_of_a_shuffle_is_one_gather_a_part_and_each_folds_into_its_conv() -> None:
    """ShuffleNet V2's chunk of the shuffled channels, as the dynamo exporter writes it (a Split,
    where TorchScript wrote Slices): each part gathers its window of the indices, and the 1x1
    conv reading it takes the gather into its weight."""
    nodes = [
        n("Relu", ["x"], ["r"], name="relu"),
        n("Reshape", ["r", "split"], ["g"], name="split"),
        n("Transpose", ["g"], ["t"], name="swap", perm=[0, 2, 1, 3, 4]),
        n("Reshape", ["t", "merge"], ["s"], name="merge"),
        n("Split", ["s", "sizes"], ["p0", "p1"], name="chunk", axis=1),
        n("Conv", ["p0", "w0"], ["y0"], name="conv0"),
        n("Conv", ["p1", "w1"], ["y1"], name="conv1"),
    ]
    model = tiny_model(
        nodes,
        {"x": [1, 6, 2, 2]},
        {"y0": [1, 4, 2, 2], "y1": [1, 5, 2, 2]},
        {
            "split": np.array([1, 2, 3, 2, 2]),
            "merge": np.array([1, 6, 2, 2]),
            "sizes": np.array([3, 3]),
            "w0": weights(4, 3, 1, 1),
            "w1": weights(5, 3, 1, 1, seed=1),
        },
    )
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert ops(graph) == ["Relu", "Conv", "Conv"] and log.fired == {names.FOLD_CHANNEL_SHUFFLE: 1}
    assert_computes_as_onnxruntime(model, graph)
