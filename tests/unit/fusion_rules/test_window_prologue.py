"""`depthwise_prologue` and `pool_prologue` (opfuse/fusion/rules/window_prologue.py) on tiny
graphs: a depthwise conv before a 1x1 conv, a max or average pool before a conv."""

from __future__ import annotations

import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights

n = helper.make_node


def separable(columns: int) -> object:
    return tiny_model(
        [
            n("Conv", ["x", "wd", "bd"], ["d"], name="dw", group=8, pads=[1, 1, 1, 1]),
            n("Relu", ["d"], ["r"], name="relu"),
            n("Conv", ["r", "wp"], ["y"], name="pw"),
        ],
        {"x": [1, 8, 6, 6]},
        {"y": [1, columns, 6, 6]},
        {"wd": weights(8, 1, 3, 3), "bd": weights(8, seed=1), "wp": weights(columns, 8, 1, 1, seed=2)},
    )


def pooled_conv(columns: int, pool: str = "MaxPool") -> object:
    return tiny_model(
        [
            n("Conv", ["x", "w0"], ["c"], name="stem", pads=[1, 1, 1, 1]),
            n(pool, ["c"], ["m"], name="pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            n("Conv", ["m", "w"], ["y"], name="conv"),
        ],
        {"x": [1, 4, 6, 6]},
        {"y": [1, columns, 6, 6]},
        {"w0": weights(8, 4, 3, 3, seed=1), "w": weights(columns, 8, 1, 1)},
    )


def test_the_depthwise_conv_is_computed_on_the_1x1_convs_tiles() -> None:
    _, plan = planned(separable(16))
    rule = f"{names.CONV_EPILOGUE}+{names.DEPTHWISE_PROLOGUE}"
    assert claimed(plan) == [("conv", rule, ["dw", "relu", "pw"])]
    assert [n.name for n in plan.groups[0].prologue] == ["dw", "relu"]


def test_a_1x1_conv_too_wide_for_the_depthwise_prologue_is_refused() -> None:
    _, plan = planned(separable(200))
    assert refusals(plan, names.DEPTHWISE_PROLOGUE) == [
        (
            ["dw", "pw"],
            "the 1x1 conv has 200 output channels (over 128): each of its column tiles would compute "
            "the depthwise conv again",
        )
    ]
    assert [rule for _, rule, _ in claimed(plan)] == [names.CONV_EPILOGUE, names.CONV_EPILOGUE]


@pytest.mark.parametrize("pool", ["MaxPool", "AveragePool"])
def test_the_pool_is_computed_on_the_convs_tiles(pool: str) -> None:
    _, plan = planned(pooled_conv(16, pool))
    assert claimed(plan) == [
        ("conv", f"{names.CONV_EPILOGUE}+{names.POOL_PROLOGUE}", ["pool", "conv"]),
        ("conv", names.CONV_EPILOGUE, ["stem"]),  # lone: nothing to fuse
    ]
    assert [g.nodes[0].name for g in plan.lone] == ["stem"]  # the conv that took the pool is a group


@pytest.mark.parametrize("pool", ["MaxPool", "AveragePool"])
def test_a_conv_too_wide_for_the_pool_prologue_is_refused(pool: str) -> None:
    _, plan = planned(pooled_conv(200, pool))
    assert [reason for _, reason in refusals(plan, names.POOL_PROLOGUE)] == [
        "the 1x1 conv has 200 output channels (over 128): each of its column tiles would compute the pool again"
    ]
    assert all(names.POOL_PROLOGUE not in rule for _, rule, _ in claimed(plan))


def test_a_wide_3x3_conv_is_refused_as_a_conv_not_a_1x1_one() -> None:
    """VGG's pools before its 3x3 convs of 256 and 512 channels: the reason names the conv as it is."""
    model = tiny_model(
        [
            n("Conv", ["x", "w0"], ["c"], name="stem", pads=[1, 1, 1, 1]),
            n("MaxPool", ["c"], ["m"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
            n("Conv", ["m", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
        ],
        {"x": [1, 4, 6, 6]},
        {"y": [1, 200, 3, 3]},
        {"w0": weights(8, 4, 3, 3, seed=1), "w": weights(200, 8, 3, 3)},
    )
    _, plan = planned(model, (names.POOL_TAIL,))  # with it, the stem's kernel pools its own tile
    assert [reason for _, reason in refusals(plan, names.POOL_PROLOGUE)] == [
        "the conv has 200 output channels (over 128): each of its column tiles would compute the pool again"
    ]
