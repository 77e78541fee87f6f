"""`gemv_chain` (opfuse/fusion/rules/gemv_chain.py) on a tiny graph: squeeze-excitation's MLP,
two 1x1 convolutions of a 1x1 map."""

from __future__ import annotations

import numpy as np
from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights
from tests.unit.test_fusion import check_against_ort


def excitation(hidden: int) -> object:
    n = helper.make_node
    return tiny_model(
        [
            n("Conv", ["x", "w1", "b1"], ["h"], name="fc1"),
            n("Relu", ["h"], ["r"], name="relu"),
            n("Conv", ["r", "w2", "b2"], ["s"], name="fc2"),
            n("Sigmoid", ["s"], ["y"], name="gate"),
        ],
        {"x": [2, 16, 1, 1]},
        {"y": [2, 16, 1, 1]},
        {
            "w1": weights(hidden, 16, 1, 1),
            "b1": weights(hidden, seed=1),
            "w2": weights(16, hidden, 1, 1, seed=2),
            "b2": weights(16, seed=3),
        },
    )


def test_two_gemvs_back_to_back_are_one_chain() -> None:
    _, plan = planned(excitation(8))
    assert claimed(plan) == [("chain", names.GEMV_CHAIN, ["fc1", "relu", "fc2", "gate"])]
    assert plan.groups[0].match == 2  # the second GEMV stands third in the group's nodes
    _, off = planned(excitation(8), (names.GEMV_CHAIN,))
    assert [kind for kind, _, _ in claimed(off)] == ["conv", "conv"]


def test_a_hidden_vector_too_wide_for_registers_is_refused() -> None:
    _, plan = planned(excitation(300))
    assert refusals(plan, names.GEMV_CHAIN) == [
        (["fc1", "fc2"], "the hidden vector has 300 channels (over 256 held in registers)")
    ]
    assert claimed(plan) == [
        ("conv", names.CONV_EPILOGUE, ["fc1", "relu"]),
        ("conv", names.CONV_EPILOGUE, ["fc2", "gate"]),
    ]


def split_attention() -> object:
    """ResNeSt's attention: the second GEMV's output goes to a softmax over the radix (no
    epilogue: the conv alone), through the reshape that splits its channels."""
    n = helper.make_node
    return tiny_model(
        [
            n("Conv", ["x", "w1", "b1"], ["h"], name="fc1"),
            n("Relu", ["h"], ["r"], name="relu"),
            n("Conv", ["r", "w2", "b2"], ["s"], name="fc2"),
            n("Reshape", ["s", "radix"], ["sr"], name="split"),
            n("Softmax", ["sr"], ["y"], name="softmax", axis=1),
        ],
        {"x": [2, 16, 1, 1]},
        {"y": [2, 2, 16]},
        {
            "w1": weights(8, 16, 1, 1),
            "b1": weights(8, seed=1),
            "w2": weights(32, 8, 1, 1, seed=2),
            "b2": weights(32, seed=3),
            "radix": np.array([2, 2, 16], dtype=np.int64),
        },
    )


def test_a_second_gemv_alone_joins_the_chain() -> None:
    """fc2 has no epilogue (a conv alone, which its own template or the library's conv would
    run): it is the chain's second product all the same, one kernel for the two."""
    _, plan = planned(split_attention())
    chains = [g for g in claimed(plan) if g[0] == "chain"]
    assert chains == [("chain", names.GEMV_CHAIN, ["fc1", "relu", "fc2"])], claimed(plan)
    assert not [g for g in plan.lone if g.nodes[0].name == "fc2"]


def test_the_chain_with_a_second_gemv_alone_computes_the_model() -> None:
    cm = check_against_ort(split_attention(), {"x": [2, 16, 1, 1]})  # type: ignore[arg-type]
    assert [g["nodes"] for g in cm.report["fusion"]["groups"] if g["kind"] == "chain"] == [
        ["fc1", "relu", "fc2"]
    ]
    assert cm.report["kernels"]["after"] == 2  # the chain, the softmax
