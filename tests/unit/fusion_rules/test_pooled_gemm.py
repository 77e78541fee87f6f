"""`pooled_gemm` (opfuse/fusion/rules/pooled_gemm.py) on a tiny graph: a classifier's head, the
global average pool, Flatten and the GEMM."""

from __future__ import annotations

from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights


def head(images: int) -> object:
    n = helper.make_node
    return tiny_model(
        [
            n("Relu", ["x"], ["r"], name="relu"),
            n("GlobalAveragePool", ["r"], ["p"], name="pool"),
            n("Flatten", ["p"], ["f"], name="flatten"),
            n("Gemm", ["f", "w", "b"], ["y"], name="fc"),
        ],
        {"x": [images, 16, 4, 4]},
        {"y": [images, 10]},
        {"w": weights(16, 10), "b": weights(10, seed=1)},
    )


def test_the_pool_is_computed_on_the_gemms_a_tiles() -> None:
    _, plan = planned(head(2))
    (group,) = [g for g in plan.groups if g.kind == "gemm"]
    assert names.POOLED_GEMM in group.rule.split("+")
    assert [n.name for n in group.prologue] == ["relu", "pool"]
    assert all(g.kind != "rowwise" for g in plan.groups)  # the row group is the GEMM's prologue


def test_more_images_than_the_gemv_rows_are_refused() -> None:
    _, plan = planned(head(8))
    assert refusals(plan, names.POOLED_GEMM) == [
        (["pool", "fc"], "8 images (over 4): each of the GEMM's column tiles would pool them all again")
    ]
    assert ("rowwise", names.ROW_REDUCTION, ["relu", "pool"]) in claimed(plan)
