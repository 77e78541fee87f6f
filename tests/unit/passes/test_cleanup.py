"""`eliminate_noops` (opfuse/passes/cleanup.py) on a tiny graph: Identity and Dropout go away."""

from __future__ import annotations

from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.cleanup import eliminate_noops
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def test_identity_and_dropout_between_ops_are_removed() -> None:
    model = tiny_model(
        [
            n("Add", ["x", "b"], ["a"], name="add"),
            n("Identity", ["a"], ["i"], name="id"),
            n("Dropout", ["i"], ["d"], name="drop"),
            n("Relu", ["d"], ["y"], name="relu"),
        ],
        {"x": [2, 5]},
        {"y": [2, 5]},
        {"b": weights(5)},
    )
    graph = graph_of(model)
    log = run_pass(graph, eliminate_noops)
    assert ops(graph) == ["Add", "Relu"]
    assert log.fired == {names.ELIMINATE_NOOPS: 2}
    assert_computes_as_onnxruntime(model, graph)


def test_an_identity_from_input_to_output_is_kept() -> None:
    model = tiny_model([n("Identity", ["x"], ["y"], name="id")], {"x": [3]}, {"y": [3]})
    graph = graph_of(model)
    log = run_pass(graph, eliminate_noops)
    assert ops(graph) == ["Identity"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["id"], "its output is a graph output fed directly by a graph input or another output")
    ]
