"""`merge_projections` (opfuse/passes/projections.py) on a tiny graph: Q, K and V of one input."""

from __future__ import annotations

import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.projections import merge_projections
from opfuse.passes.rules import GraphRule
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node
PASS = GraphRule(names.MERGE_PROJECTIONS, lambda g, ctx: merge_projections(g, ctx.log))


def qkv(bias_on_v: bool = True) -> onnx.ModelProto:
    nodes = []
    for p in "qkv":
        if p == "v" and not bias_on_v:
            nodes.append(n("MatMul", ["x", f"w{p}"], [p], name=f"{p}_proj"))
            continue
        nodes += [
            n("MatMul", ["x", f"w{p}"], [f"{p}0"], name=f"{p}_proj"),
            n("Add", [f"{p}0", f"b{p}"], [p], name=f"{p}_bias"),
        ]
    inits = {f"w{p}": weights(6, 4 + i, seed=i) for i, p in enumerate("qkv")}
    inits |= {f"b{p}": weights(4 + i, seed=10 + i) for i, p in enumerate("qkv")}
    return tiny_model(nodes, {"x": [2, 3, 6]}, {"q": [2, 3, 4], "k": [2, 3, 5], "v": [2, 3, 6]}, inits)


def test_three_projections_of_one_input_are_one_matmul_add_and_split() -> None:
    model = qkv()
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert ops(graph) == ["MatMul", "Add", "Split"] and log.fired == {names.MERGE_PROJECTIONS: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_projections_with_and_without_a_bias_stay_apart() -> None:
    graph = graph_of(qkv(bias_on_v=False))
    log = run_pass(graph, PASS)
    assert ops(graph) == ["MatMul", "Add", "MatMul", "Add", "MatMul"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["q_proj", "k_proj", "v_proj"], "some projections have a bias and some do not")
    ]
