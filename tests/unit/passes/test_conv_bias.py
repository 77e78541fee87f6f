"""`forward_conv_bias` (opfuse/passes/conv_bias.py) on tiny graphs, against onnxruntime, and on a
separable conv compiled end to end."""

from __future__ import annotations

from typing import Any

import onnx
import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.conv_bias import forward_conv_bias
from tests.builders import assert_computes_as_onnxruntime, graph_of, run_pass, tiny_model, weights

n = helper.make_node


def separable(
    reader: dict[str, Any] | None = None, reader_bias: bool = True, second_reader: bool = False, size: int = 7
) -> onnx.ModelProto:
    """A depthwise 3x3 conv of 8 channels (a bias far from zero) and the conv that reads it
    (`reader`: its attributes and weight shape; a 1x1 conv of 12 channels unless said)."""
    spec = {"w": [12, 8, 1, 1], "attrs": {}, "out": [1, 12, size, size], **(reader or {})}
    nodes = [
        n("Conv", ["x", "wd", "bd"], ["d"], name="dw", group=8, pads=[1, 1, 1, 1]),
        n("Conv", ["d", "wp", "bp"] if reader_bias else ["d", "wp"], ["y"], name="pw", **spec["attrs"]),
    ]
    outputs = {"y": spec["out"]}
    inits = {"wd": weights(8, 1, 3, 3), "bd": 3.0 + weights(8, seed=1), "wp": weights(*spec["w"], seed=2)}
    if reader_bias:
        inits["bp"] = weights(spec["w"][0], seed=3)
    if second_reader:
        nodes.append(n("Conv", ["d", "wq", "bq"], ["z"], name="pw2"))
        outputs["z"] = [1, 4, size, size]
        inits.update(wq=weights(4, 8, 1, 1, seed=4), bq=weights(4, seed=5))
    return tiny_model(nodes, {"x": [1, 8, size, size]}, outputs, inits)


@pytest.mark.parametrize(
    "reader",
    [
        None,  # a 1x1 conv
        {"w": [12, 8, 3, 3], "attrs": {"strides": [2, 2], "dilations": [2, 2]}, "out": [1, 12, 2, 2]},
        {"w": [12, 2, 2, 2], "attrs": {"group": 4}, "out": [1, 12, 6, 6]},  # grouped, 2x2 taps
        {"w": [12, 8, 3, 3], "attrs": {"auto_pad": "VALID"}, "out": [1, 12, 5, 5]},
        {"w": [12, 8, 1, 1], "attrs": {"auto_pad": "SAME_UPPER"}, "out": [1, 12, 7, 7]},  # pads 0
    ],
    ids=["1x1", "strided_dilated", "grouped", "valid", "same_1x1"],
)
def test_the_bias_moves_into_an_unpadded_reader_and_every_element_stays(
    reader: dict[str, Any] | None,
) -> None:
    model = separable(reader)
    graph = graph_of(model)
    log = run_pass(graph, forward_conv_bias)
    dw, pw = graph.nodes
    assert log.fired == {names.FORWARD_CONV_BIAS: 1} and dw.inputs == ["x", "wd"] and pw.inputs[2] != "bp"
    assert_computes_as_onnxruntime(model, graph)


def test_two_readers_each_take_their_share() -> None:
    model = separable(second_reader=True)
    graph = graph_of(model)
    run_pass(graph, forward_conv_bias)
    assert [len(x.inputs) for x in graph.nodes] == [2, 3, 3]
    assert_computes_as_onnxruntime(model, graph)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (
            separable({"w": [12, 8, 3, 3], "attrs": {"pads": [1, 1, 1, 1]}}),
            "pw pads its input: the bias would reach its zero border",
        ),
        (
            separable({"w": [12, 8, 3, 3], "attrs": {"auto_pad": "SAME_UPPER"}}),
            "pw pads its input: the bias would reach its zero border",
        ),
        (separable(reader_bias=False), "pw has no constant bias to take it (the add would only move)"),
    ],
    ids=["padded", "same_3x3", "no_bias"],
)
def test_a_reader_that_pads_or_has_no_bias_keeps_it_where_it_is(model: onnx.ModelProto, reason: str) -> None:
    graph = graph_of(model)
    log = run_pass(graph, forward_conv_bias)
    assert not log.fired and [(r.nodes, r.reason) for r in log.not_fired] == [(["dw", "pw"], reason)]
    assert graph.nodes[0].inputs == ["x", "wd", "bd"]


def test_a_conv_read_by_anything_else_is_not_a_candidate() -> None:
    model = tiny_model(
        [
            n("Conv", ["x", "w", "b"], ["c"], name="conv"),
            n("Relu", ["c"], ["r"]),
            n("Conv", ["c", "v", "u"], ["y"]),
        ],
        {"x": [1, 4, 5, 5]},
        {"y": [1, 4, 5, 5], "r": [1, 4, 5, 5]},
        {
            "w": weights(4, 4, 1, 1),
            "b": weights(4, seed=1),
            "v": weights(4, 4, 1, 1, seed=2),
            "u": weights(4, seed=3),
        },
    )
    graph = graph_of(model)
    log = run_pass(graph, forward_conv_bias)
    assert not log.fired and not log.not_fired


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("channels", [24, 200], ids=["prologue", "alone"])
def test_a_separable_conv_compiles_without_the_depthwise_bias(precision: str, channels: int) -> None:
    """End to end: the pass fires and the compiled plan matches onnxruntime on fresh random input,
    every element: with the depthwise conv computed on the 1x1 conv's tiles (24 channels:
    depthwise_prologue), and run alone by the library, without a bias (200: every column tile would
    compute it again)."""
    from tests.unit.test_fusion import check_against_ort

    model = separable({"w": [channels, 8, 1, 1], "out": [1, channels, 7, 7]})
    cm = check_against_ort(model, {"x": [1, 8, 7, 7]}, precision)
    assert cm.report["fusion"]["passes"]["fired"].get(names.FORWARD_CONV_BIAS) == 1
    alone = [s.inputs for s in cm.plan.steps if s.kind == "op" and "Conv" in s.op_type]
    assert [len(inputs) for inputs in alone] == (
        [] if channels == 24 else [2, 3]
    )  # no bias, then its reader's
