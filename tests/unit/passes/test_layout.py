"""`to_channels_last` (opfuse/passes/layout.py) on a tiny graph: a conv region goes NHWC with
Transposes at its edges."""

from __future__ import annotations

import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.ir.ops import NHWC_CONV
from opfuse.passes.layout import FP32_DENSE_REASON
from opfuse.passes.pipeline import PASSES
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node
PASS = next(p for p in PASSES if p.name == names.CHANNELS_LAST)


def conv_relu_pool() -> onnx.ModelProto:
    return tiny_model(
        [
            n("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            n("Relu", ["c"], ["r"], name="relu"),
            n("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        ],
        {"x": [1, 3, 6, 6]},
        {"y": [1, 4, 3, 3]},
        {"w": weights(4, 3, 3, 3), "b": weights(4, seed=1)},
    )


def test_a_conv_region_runs_channels_last_between_two_transposes() -> None:
    model = conv_relu_pool()
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert ops(graph) == ["Transpose", NHWC_CONV, "Relu", "opfuse.MaxPoolNHWC", "Transpose"]
    assert log.fired == {names.CHANNELS_LAST: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_a_1d_convolution_runs_as_the_2d_one_over_an_image_row() -> None:
    """[N, C, L] convolved by [Cout, Cin, K] is the NHWC conv of [N, 1, L, C] by [Cout, 1, K, Cin]:
    strides, dilations and pads gain a unit first axis; the input's tokens are transposed and
    viewed as one row, the output viewed back and transposed at the region's edge."""
    model = tiny_model(
        [n("Conv", ["x", "w", "b"], ["y"], name="conv1d", strides=[2], dilations=[2], pads=[3, 1])],
        {"x": [2, 3, 11]},
        {"y": [2, 4, 6]},
        {"w": weights(4, 3, 3), "b": weights(4, seed=1)},
    )
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert ops(graph) == ["Transpose", "Reshape", NHWC_CONV, "Reshape", "Transpose"]
    conv = next(node for node in graph.nodes if node.op_type == NHWC_CONV)
    assert conv.attrs["strides"] == [1, 2] and conv.attrs["dilations"] == [1, 2]
    assert conv.attrs["pads"] == [0, 3, 0, 1] and conv.attrs["kernel_shape"] == [1, 3]
    assert graph.spec(conv.inputs[0]).shape == (2, 1, 11, 3) and graph.spec(conv.outputs[0]).shape == (
        2,
        1,
        6,
        4,
    )
    assert log.fired == {names.CHANNELS_LAST: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_tokens_into_and_out_of_a_1d_convolution_need_no_transpose() -> None:
    """Tokens [N, L, C] transposed into a 1-D conv, a per-channel scale and the residual on
    [N, C, L], transposed back to tokens (SqueezeBERT's block): the model's two transposes are
    views of the twins, and no Transpose is left."""
    model = tiny_model(
        [
            n("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
            n("Conv", ["xt", "w", "b"], ["c"], name="conv1d", group=2),
            n("Mul", ["c", "s"], ["cs"]),
            n("Add", ["cs", "xt"], ["r"]),
            n("Transpose", ["r"], ["y"], perm=[0, 2, 1]),
            n("Relu", ["y"], ["z"]),
        ],
        {"x": [2, 7, 4]},
        {"z": [2, 7, 4]},
        {"w": weights(4, 2, 1), "b": weights(4, seed=1), "s": weights(4, 1, seed=2)},
    )
    graph = graph_of(model)
    run_pass(graph, PASS)
    assert "Transpose" not in ops(graph) and NHWC_CONV in ops(graph), ops(graph)
    assert_computes_as_onnxruntime(model, graph)


def test_a_3d_convolution_stays_channels_first() -> None:
    model = tiny_model(
        [n("Conv", ["x", "w"], ["y"], name="conv3d")],
        {"x": [1, 3, 4, 4, 4]},
        {"y": [1, 2, 2, 2, 2]},
        {"w": weights(2, 3, 3, 3, 3)},
    )
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert ops(graph) == ["Conv"] and log.fired == {}
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["conv3d"], "a 3-D convolution: channels-last covers 1-D and 2-D")
    ]


def test_dense_convolutions_in_fp32_on_the_gpu_stay_nchw() -> None:
    graph = graph_of(conv_relu_pool())
    log = run_pass(graph, PASS, device="cuda")  # the decision only: nothing runs on the device
    assert ops(graph) == ["Conv", "Relu", "MaxPool"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [(["conv"], FP32_DENSE_REASON)]
    assert log.fired == {names.FP32_DENSE_NCHW: 1}


def test_a_norm_only_a_conv_reads_runs_channels_last_ahead_of_it() -> None:
    """A BatchNorm's scale and shift (a Mul and an Add by per-channel constants) on a value from
    outside the region (here the model's own transpose of the input, as MaxViT's window reverse
    before its MBConv's pre-norm), read only by the conv: the Transpose into NHWC moves above
    them, so their kernel writes the conv's NHWC input. The shortcut's Add after the conv reads
    the same untransposed value through the same twin."""
    c = 4
    model = tiny_model(
        [
            n("Transpose", ["x"], ["t"], name="window_reverse", perm=[0, 1, 3, 2]),
            n("Mul", ["t", "scale"], ["s"], name="bn_scale"),
            n("Add", ["s", "shift"], ["b"], name="bn_shift"),
            n("Conv", ["b", "w", "bias"], ["c"], name="conv"),
            n("Add", ["c", "t"], ["y"], name="shortcut"),
        ],
        {"x": [1, c, 5, 6]},
        {"y": [1, c, 6, 5]},
        {
            "scale": weights(c, 1, 1, seed=2) + 1.0,
            "shift": weights(c, 1, 1, seed=3),
            "w": weights(c, c, 1, 1),
            "bias": weights(c, seed=1),
        },
    )
    graph = graph_of(model)
    run_pass(graph, PASS)
    assert ops(graph) == ["Transpose", "Transpose", "Mul", "Add", NHWC_CONV, "Add", "Transpose"]
    to_nhwc = graph.nodes[1]
    assert to_nhwc.inputs == ["t"] and to_nhwc.attrs["perm"] == [0, 2, 3, 1]
    mul, add, conv, shortcut = graph.nodes[2:6]
    assert mul.inputs[0] == to_nhwc.outputs[0] and conv.inputs[0] == add.outputs[0]
    assert graph.spec(add.outputs[0]).shape == (1, 6, 5, c)  # NHWC: the conv's input as it reads it
    assert to_nhwc.outputs[0] in shortcut.inputs  # one twin of the transposed value for both readers
    assert_computes_as_onnxruntime(model, graph)


def test_a_norm_read_by_more_than_the_conv_stays_where_it_was() -> None:
    """The same norm, its output also a graph output: it stays NCHW, and the conv's input is the
    Transpose of its output, as before."""
    c = 4
    model = tiny_model(
        [
            n("Transpose", ["x"], ["t"], name="window_reverse", perm=[0, 1, 3, 2]),
            n("Mul", ["t", "scale"], ["s"], name="bn_scale"),
            n("Conv", ["s", "w"], ["y"], name="conv"),
        ],
        {"x": [1, c, 5, 6]},
        {"y": [1, c, 6, 5], "s": [1, c, 6, 5]},
        {"scale": weights(c, 1, 1, seed=2) + 1.0, "w": weights(c, c, 1, 1)},
    )
    graph = graph_of(model)
    run_pass(graph, PASS)
    assert ops(graph) == ["Transpose", "Mul", "Transpose", NHWC_CONV, "Transpose"]
    assert_computes_as_onnxruntime(model, graph)


def test_an_activation_after_a_computed_norm_stays_its_epilogue() -> None:
    """A Relu after a GroupNorm of two groups (which stays NCHW), read only by the conv: the chain
    starts from an op that computes, whose row kernel takes the Relu as its epilogue, so it stays
    NCHW and the Transpose into the region comes after it (moved, it would be a kernel of its own)."""
    c = 4
    model = tiny_model(
        [
            n("GroupNormalization", ["x", "gamma", "beta"], ["g"], name="norm", num_groups=2),
            n("Relu", ["g"], ["r"], name="relu"),
            n("Conv", ["r", "w"], ["y"], name="conv"),
        ],
        {"x": [1, c, 5, 6]},
        {"y": [1, c, 5, 6]},
        {"gamma": weights(c, seed=2) + 1.0, "beta": weights(c, seed=3), "w": weights(c, c, 1, 1)},
        opset=21,  # GroupNormalization's per-channel scale and bias
    )
    graph = graph_of(model)
    run_pass(graph, PASS)
    assert ops(graph) == ["GroupNormalization", "Relu", "Transpose", NHWC_CONV, "Transpose"]
    assert_computes_as_onnxruntime(model, graph)
