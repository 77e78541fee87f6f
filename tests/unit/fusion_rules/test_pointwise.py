"""`pointwise` (opfuse/fusion/rules/pointwise.py) on tiny graphs: elementwise chains, and one that
broadcasts a small result into a larger shape."""

from __future__ import annotations

from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights

n = helper.make_node


def test_an_elementwise_chain_is_one_group() -> None:
    model = tiny_model(
        [
            n("Add", ["x", "b"], ["a"], name="add"),
            n("Tanh", ["a"], ["t"], name="tanh"),
            n("Mul", ["t", "x"], ["y"], name="mul"),
        ],
        {"x": [4, 8]},
        {"y": [4, 8]},
        {"b": weights(8)},
    )
    _, plan = planned(model)
    assert claimed(plan) == [("pointwise", names.POINTWISE, ["add", "tanh", "mul"])]
    assert plan.groups[0].inputs == ["x", "b"] and plan.groups[0].outputs == ["y"]


def test_a_producer_of_another_iteration_shape_is_refused() -> None:
    model = tiny_model(
        [
            n("Exp", ["s"], ["e"], name="exp"),
            n("Neg", ["e"], ["m"], name="neg"),
            n("Add", ["m", "x"], ["y"], name="add"),
            n("Relu", ["y"], ["z"], name="relu"),
        ],
        {"s": [4, 1], "x": [4, 8]},
        {"z": [4, 8]},
    )
    _, plan = planned(model)
    assert refusals(plan, names.POINTWISE) == [
        (["neg", "add"], "different iteration shapes (a broadcast result is larger than its input)")
    ]
    assert claimed(plan) == [
        ("pointwise", names.POINTWISE, ["exp", "neg"]),
        ("pointwise", names.POINTWISE, ["add", "relu"]),
    ]
