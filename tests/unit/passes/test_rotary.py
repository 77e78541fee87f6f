"""`rotate_half` (opfuse/passes/rotary.py) on a tiny graph: Concat(-x[..., h:], x[..., :h])."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.rotary import rotate_half
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def rotary(high: tuple[int, int], low: tuple[int, int]) -> onnx.ModelProto:
    return tiny_model(
        [
            n("Slice", ["x", "h0", "h1", "ax"], ["hi"], name="high"),
            n("Neg", ["hi"], ["neg"], name="neg"),
            n("Slice", ["x", "l0", "l1", "ax"], ["lo"], name="low"),
            n("Concat", ["neg", "lo"], ["rot"], name="cat", axis=-1),
            n("Mul", ["rot", "sin"], ["a"], name="by_sin"),
            n("Mul", ["x", "cos"], ["b"], name="by_cos"),
            n("Add", ["a", "b"], ["y"], name="sum"),
        ],
        {"x": [2, 3, 8]},
        {"y": [2, 3, 8]},
        {
            "h0": np.array([high[0]]),
            "h1": np.array([high[1]]),
            "l0": np.array([low[0]]),
            "l1": np.array([low[1]]),
            "ax": np.array([-1]),
            "sin": weights(3, 8),
            "cos": weights(3, 8, seed=1),
        },
    )


def test_rotate_half_is_a_matmul_by_a_signed_permutation() -> None:
    model = rotary((4, 8), (0, 4))
    graph = graph_of(model)
    log = run_pass(graph, rotate_half)
    assert ops(graph) == ["MatMul", "Mul", "Mul", "Add"] and log.fired == {names.ROTATE_HALF: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_slices_that_are_not_the_two_halves_are_left_alone() -> None:
    graph = graph_of(rotary((0, 4), (4, 8)))  # x[..., :h] negated: not rotate_half
    log = run_pass(graph, rotate_half)
    assert ops(graph) == ["Slice", "Neg", "Slice", "Concat", "Mul", "Mul", "Add"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["cat"], "the slices are not the two halves of the last axis")
    ]
