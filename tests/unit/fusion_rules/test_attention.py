"""`attention` (opfuse/fusion/rules/attention.py) on a tiny graph: Q·Kᵀ, a scale, Softmax, ·V."""

from __future__ import annotations

import numpy as np
from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model


def attention(axis: int) -> object:
    n = helper.make_node
    return tiny_model(
        [
            n("MatMul", ["q", "kt"], ["s"], name="qk"),
            n("Mul", ["s", "scale"], ["ss"], name="scale"),
            n("Softmax", ["ss"], ["p"], name="softmax", axis=axis),
            n("MatMul", ["p", "v"], ["y"], name="pv"),
        ],
        {"q": [1, 2, 4, 8], "kt": [1, 2, 8, 4], "v": [1, 2, 4, 8]},
        {"y": [1, 2, 4, 8]},
        {"scale": np.array(0.35)},
    )


def test_attention_claims_the_four_nodes_in_one_group() -> None:
    _, plan = planned(attention(-1))
    assert claimed(plan) == [("attention", names.ATTENTION, ["qk", "scale", "softmax", "pv"])]
    assert refusals(plan, names.ATTENTION) == []
    assert abs(plan.groups[0].match.scale - 0.35) < 1e-6


def test_a_softmax_over_another_axis_is_refused_with_its_reason() -> None:
    _, plan = planned(attention(2))
    assert refusals(plan, names.ATTENTION) == [(["qk"], "softmax is not over the last axis")]
    assert all(kind != "attention" for kind, _, _ in claimed(plan))
