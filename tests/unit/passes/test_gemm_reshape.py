"""`gemm_to_matmul` (opfuse/passes/gemm_reshape.py) on a tiny graph: a linear layer over [B, S, K]
written as Reshape -> Gemm -> Reshape."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.gemm_reshape import gemm_to_matmul
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def flattened_linear(alpha: float = 1.0) -> onnx.ModelProto:
    return tiny_model(
        [
            n("Reshape", ["x", "flat"], ["f"], name="flatten"),
            n("Gemm", ["f", "w", "b"], ["g"], name="fc", transB=1, alpha=alpha),
            n("Reshape", ["g", "back"], ["y"], name="unflatten"),
        ],
        {"x": [2, 3, 4]},
        {"y": [2, 3, 5]},
        {"w": weights(5, 4), "b": weights(5, seed=1), "flat": np.array([6, 4]), "back": np.array([2, 3, 5])},
    )


def test_the_reshapes_go_and_the_gemm_is_a_matmul_and_an_add() -> None:
    model = flattened_linear()
    graph = graph_of(model)
    log = run_pass(graph, gemm_to_matmul)
    assert ops(graph) == ["MatMul", "Add"] and log.fired == {names.GEMM_TO_MATMUL: 1}
    assert graph.nodes[0].inputs[0] == "x"
    assert_computes_as_onnxruntime(model, graph)


def test_a_scaled_gemm_is_left_alone() -> None:
    graph = graph_of(flattened_linear(alpha=0.5))
    log = run_pass(graph, gemm_to_matmul)
    assert ops(graph) == ["Reshape", "Gemm", "Reshape"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["flatten", "fc", "unflatten"], "Gemm with alpha or beta other than 1")
    ]
