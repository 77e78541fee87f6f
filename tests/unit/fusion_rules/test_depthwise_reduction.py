"""`depthwise_reduction` (opfuse/fusion/rules/depthwise_reduction.py) on a tiny graph: a depthwise
conv, its activation, and the mean over its pixels (squeeze-excitation's squeeze)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights

n = helper.make_node


def squeeze(read_outside: bool) -> object:
    nodes = [
        n("Conv", ["x", "wd", "bd"], ["d"], name="dw", group=8, pads=[1, 1, 1, 1]),
        n("Relu", ["d"], ["r"], name="relu"),
        n("ReduceMean", ["r", "axes"], ["y"], name="mean", keepdims=1),
    ]
    outputs = {"y": [1, 8, 1, 1]}
    if read_outside:
        nodes.append(n("Conv", ["d", "w"], ["z"], name="other"))
        outputs["z"] = [1, 4, 6, 6]
    return tiny_model(
        nodes,
        {"x": [1, 8, 6, 6]},
        outputs,
        {
            "wd": weights(8, 1, 3, 3),
            "bd": weights(8, seed=1),
            "w": weights(4, 8, 1, 1, seed=2),
            "axes": np.array([2, 3]),
        },
    )


def test_the_depthwise_conv_is_computed_on_the_row_kernels_tiles() -> None:
    _, plan = planned(squeeze(False))
    rule = f"{names.ROW_REDUCTION}+{names.DEPTHWISE_REDUCTION}"
    assert [(kind, r, nodes) for kind, r, nodes in claimed(plan) if kind == "rowwise"] == [
        ("rowwise", rule, ["dw", "relu", "mean"])
    ]
    assert plan.lone == []  # the lone depthwise conv is the row group's prologue now


def test_a_depthwise_output_read_outside_the_row_kernel_is_refused() -> None:
    _, plan = planned(squeeze(True))
    assert refusals(plan, names.DEPTHWISE_REDUCTION) == [
        (["dw", "mean"], "the depthwise conv's output is read outside the row kernel too")
    ]
    assert all(names.DEPTHWISE_REDUCTION not in rule for _, rule, _ in claimed(plan))
