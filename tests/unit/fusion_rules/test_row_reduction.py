"""`row_reduction` (opfuse/fusion/rules/row_reduction.py) on a tiny graph: bias, Softmax, scale."""

from __future__ import annotations

from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights


def softmax_row(length: int) -> object:
    n = helper.make_node
    return tiny_model(
        [
            n("Add", ["x", "b"], ["h"], name="bias"),
            n("Softmax", ["h"], ["p"], name="softmax", axis=-1),
            n("Mul", ["p", "c"], ["y"], name="scale"),
        ],
        {"x": [4, length]},
        {"y": [4, length]},
        {"b": weights(length), "c": weights(length, seed=1)},
    )


def test_the_reduction_takes_its_prologue_and_epilogue() -> None:
    _, plan = planned(softmax_row(16))
    assert claimed(plan) == [("rowwise", names.ROW_REDUCTION, ["bias", "softmax", "scale"])]
    assert plan.groups[0].full == (4, 16) and plan.groups[0].split == 1


def test_a_row_too_long_for_one_program_is_refused() -> None:
    _, plan = planned(softmax_row(20000))
    assert refusals(plan, names.ROW_REDUCTION) == [
        (["softmax"], "a row of 20000 elements does not fit one program (limit 16384)")
    ]
    assert all(kind != "rowwise" for kind, _, _ in claimed(plan))
