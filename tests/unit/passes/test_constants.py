"""`fold_constant_nodes` and `drop_unused_constants` (opfuse/passes/constants.py) on a tiny graph.

Neither records a reason: a node with a run-time input is simply not folded."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, graph_from_onnx
from opfuse.passes.constants import drop_unused_constants, fold_constant_nodes
from opfuse.passes.rules import GraphRule
from tests.builders import assert_computes_as_onnxruntime, ops, run_pass, tiny_model, weights

n = helper.make_node


def shape_arithmetic() -> onnx.ModelProto:
    return tiny_model(
        [
            n("Shape", ["x"], ["s"], name="shape"),
            n("Mul", ["w", "two"], ["w2"], name="double"),
            n("Reshape", ["x", "s"], ["r"], name="reshape"),
            n("Add", ["r", "w2"], ["y"], name="add"),
        ],
        {"x": [2, 3]},
        {"y": [2, 3]},
        {"w": weights(2, 3), "two": np.array(2.0, np.float32), "unused": weights(4, seed=1)},
    )


def lowered(model: onnx.ModelProto) -> Graph:
    """The model in the IR as written: the frontend (graph_of) already folds compile-time values,
    so constant nodes reach this pass only from rewrites; lowering directly keeps them."""
    return graph_from_onnx(onnx.shape_inference.infer_shapes(model))


def test_nodes_of_constants_fold_and_the_rest_stay() -> None:
    model = shape_arithmetic()
    graph = lowered(model)
    assert fold_constant_nodes(graph) == 2
    assert ops(graph) == ["Reshape", "Add"]  # they read x: not folded
    np.testing.assert_array_equal(graph.constants["s"], [2, 3])
    np.testing.assert_allclose(graph.constants["w2"], graph.constants["w"] * 2)
    assert_computes_as_onnxruntime(model, graph)


def test_constants_no_node_reads_are_dropped() -> None:
    model = shape_arithmetic()
    graph = lowered(model)
    run_pass(graph, GraphRule(names.FOLD_CONSTANTS, lambda g, ctx: fold_constant_nodes(g)))
    assert "unused" in graph.constants and "w" in graph.constants
    run_pass(graph, GraphRule(names.DROP_UNUSED_CONSTANTS, lambda g, ctx: drop_unused_constants(g)))
    assert sorted(graph.constants) == ["s", "w2"]
    assert_computes_as_onnxruntime(model, graph)
