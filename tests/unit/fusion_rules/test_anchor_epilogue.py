"""`gemm_epilogue`, `conv_epilogue`, `pool_epilogue` (opfuse/fusion/rules/anchor_epilogue.py) on
tiny graphs: an anchor and the pointwise ops after it."""

from __future__ import annotations

from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights

n = helper.make_node


def test_a_gemm_takes_its_bias_and_activation() -> None:
    model = tiny_model(
        [
            n("MatMul", ["x", "w"], ["h"], name="mm"),
            n("Add", ["h", "b"], ["a"], name="bias"),
            n("Relu", ["a"], ["y"], name="relu"),
        ],
        {"x": [4, 8]},
        {"y": [4, 16]},
        {"w": weights(8, 16), "b": weights(16, seed=1)},
    )
    _, plan = planned(model)
    assert claimed(plan) == [("gemm", names.GEMM_EPILOGUE, ["mm", "bias", "relu"])]
    assert plan.groups[0].id == "m0" and plan.groups[0].variant == "template"
    # Turned off, the epilogue is a pointwise group of its own.
    _, off = planned(model, (names.GEMM_EPILOGUE,))
    assert claimed(off) == [("pointwise", names.POINTWISE, ["bias", "relu"])]


def test_a_gemm_by_a_vector_is_refused() -> None:
    model = tiny_model(
        [n("MatMul", ["x", "w"], ["h"], name="mm"), n("Relu", ["h"], ["y"], name="relu")],
        {"x": [2, 4, 8], "w": [8]},
        {"y": [2, 4]},
    )
    _, plan = planned(model)
    assert refusals(plan, names.GEMM_EPILOGUE) == [(["mm"], "an operand is a vector")]
    assert all(kind != "gemm" for kind, _, _ in claimed(plan))


def test_a_conv_and_a_pool_each_take_their_epilogue() -> None:
    model = tiny_model(
        [
            n("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            n("Relu", ["c"], ["r"], name="relu"),
            n("MaxPool", ["r"], ["m"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
            n("Sigmoid", ["m"], ["y"], name="gate"),
        ],
        {"x": [1, 4, 6, 6]},
        {"y": [1, 8, 3, 3]},
        {"w": weights(8, 4, 3, 3), "b": weights(8, seed=1)},
    )
    _, plan = planned(model, (names.POOL_TAIL,))
    # The conv reads the NCHW image in place through the region's Transpose (layout_prologue).
    assert claimed(plan) == [
        ("conv", f"{names.CONV_EPILOGUE}+{names.LAYOUT_PROLOGUE}", ["Transpose", "conv", "relu"]),
        ("pool", names.POOL_EPILOGUE, ["pool", "gate"]),
    ]
    assert [g.id for g in plan.groups] == ["c0", "p1"]  # one numbering across the anchor kinds
    # With pool_tail the 2x2 pool, whose windows tile the map, runs on the conv's output tile.
    _, plan = planned(model)
    rule = f"{names.CONV_EPILOGUE}+{names.LAYOUT_PROLOGUE}+{names.POOL_TAIL}"
    assert claimed(plan)[0] == ("conv", rule, ["Transpose", "conv", "relu", "pool"])
