"""`concat_epilogue` (opfuse/fusion/rules/concat_epilogue.py) on a tiny graph: a conv's output
concatenated along channels with another tensor (ShuffleNet's block end)."""

from __future__ import annotations

from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights

n = helper.make_node


def conv_concat(constant: bool) -> object:
    inits = {"w0": weights(8, 4, 3, 3), "w": weights(8, 8, 3, 3, seed=1)}
    if constant:
        inits["k"] = weights(1, 8, 6, 6, seed=2)
    return tiny_model(
        [
            n("Conv", ["x", "w0"], ["a"], name="stem", pads=[1, 1, 1, 1]),
            n("Relu", ["a"], ["r"], name="relu"),
            n("Conv", ["r", "w"], ["c"], name="branch", pads=[1, 1, 1, 1]),
            n("Concat", ["k" if constant else "r", "c"], ["y"], name="cat", axis=1),
        ],
        {"x": [1, 4, 6, 6]},
        {"y": [1, 16, 6, 6]},
        inits,
    )


def test_the_conv_writes_the_concat_in_place() -> None:
    _, plan = planned(conv_concat(False))
    rule = f"{names.CONV_EPILOGUE}+{names.CONCAT_EPILOGUE}"
    assert ("conv", rule, ["branch", "cat"]) in claimed(plan)
    assert refusals(plan, names.CONCAT_EPILOGUE) == []


def test_a_constant_input_is_refused() -> None:
    _, plan = planned(conv_concat(True))
    assert refusals(plan, names.CONCAT_EPILOGUE) == [
        (["branch", "cat"], "a constant input: the library's Concat copies it")
    ]
    assert all(names.CONCAT_EPILOGUE not in rule for _, rule, _ in claimed(plan))
