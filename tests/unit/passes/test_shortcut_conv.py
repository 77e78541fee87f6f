"""`shortcut_conv` (opfuse/passes/shortcut_conv.py) on a tiny graph: relu(conv3(h) + shortcut(x)) on
the channels-last graph becomes one `opfuse.ConvNHWC` whose K loop reads h and x."""

from __future__ import annotations

import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.ir.ops import NHWC_CONV
from opfuse.passes.pipeline import PASSES
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node
LAYOUT, PASS = (next(p for p in PASSES if p.name == r) for r in (names.CHANNELS_LAST, names.SHORTCUT_CONV))


def block(shortcut_kernel: int) -> onnx.ModelProto:
    k = shortcut_kernel
    return tiny_model(
        [
            n("Relu", ["x"], ["h"], name="inner"),
            n("Conv", ["h", "w3", "b3"], ["m"], name="conv3", pads=[1, 1, 1, 1]),
            n("Conv", ["x", "ws", "bs"], ["s"], name="shortcut", pads=[k // 2] * 4),
            n("Add", ["m", "s"], ["a"], name="add"),
            n("Relu", ["a"], ["y"], name="out"),
        ],
        {"x": [1, 3, 5, 5]},
        {"y": [1, 4, 5, 5]},
        {
            "w3": weights(4, 3, 3, 3),
            "b3": weights(4, seed=1),
            "ws": weights(4, 3, k, k, seed=2),
            "bs": weights(4, seed=3),
        },
    )


def test_the_shortcut_is_summed_in_the_main_convolution() -> None:
    model = block(1)
    graph = graph_of(model)
    run_pass(graph, LAYOUT)
    log = run_pass(graph, PASS)
    # The inner Relu only convs read runs channels-last on x's Transpose, which the shortcut
    # reads too: one Transpose into the region.
    assert ops(graph) == ["Transpose", "Relu", NHWC_CONV, "Relu", "Transpose"]
    assert graph.nodes[2].attrs["shortcut_strides"] == [1, 1] and log.fired == {names.SHORTCUT_CONV: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_two_3x3_convolutions_are_not_a_shortcut() -> None:
    graph = graph_of(block(3))
    run_pass(graph, LAYOUT)
    log = run_pass(graph, PASS)
    assert ops(graph).count(NHWC_CONV) == 2 and log.fired == {}
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["conv3", "shortcut", "add"], "neither convolution is a 1x1 shortcut (1x1, no padding, dilation 1)")
    ]
