"""`pad_prologue` (opfuse/fusion/rules/pad_prologue.py) on a tiny graph: Pad, then a 3x3 conv."""

from __future__ import annotations

import numpy as np
from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model, weights


def padded_conv(pad: int) -> object:
    n = helper.make_node
    size = 6 + 2 * pad - 2
    return tiny_model(
        [
            n("Pad", ["x", "pads"], ["xp"], name="pad", mode="reflect"),
            n("Conv", ["xp", "w"], ["c"], name="conv"),
            n("Relu", ["c"], ["y"], name="relu"),
        ],
        {"x": [1, 4, 6, 6]},
        {"y": [1, 8, size, size]},
        {"w": weights(8, 4, 3, 3), "pads": np.array([0, 0, pad, pad, 0, 0, pad, pad])},
    )


def test_the_conv_reads_through_the_pad() -> None:
    _, plan = planned(padded_conv(1))
    # The Pad, and the region's Transpose to NHWC after it, are the conv's prologue.
    assert claimed(plan) == [
        ("conv", f"{names.CONV_EPILOGUE}+{names.PAD_PROLOGUE}", ["pad", "Transpose", "conv", "relu"])
    ]


def test_a_reflection_wider_than_the_image_is_refused() -> None:
    _, plan = planned(padded_conv(6))
    assert refusals(plan, names.PAD_PROLOGUE) == [(["pad", "conv"], "a reflection wider than the image")]
    # The Pad runs on its own; the conv reads its NCHW output in place (layout_prologue).
    assert claimed(plan) == [
        ("conv", f"{names.CONV_EPILOGUE}+{names.LAYOUT_PROLOGUE}", ["Transpose", "conv", "relu"])
    ]
