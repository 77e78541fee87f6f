"""`concat_select`: a Concat computed by the pointwise kernel that reads it (each element loaded
from the input whose range along the axis holds it, the other inputs masked off), so the copy is
no launch of its own; a lone Concat of gathered or viewed inputs is one kernel for all of them."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from tests.unit.test_fusion import NHWC_ALWAYS, check_against_ort, make_model

RNG = np.random.default_rng(23)
# (axis, the inputs' shapes)
CONCATS = {
    "channels_2": (1, [[2, 3, 5, 6], [2, 5, 5, 6]]),
    "channels_3": (1, [[2, 3, 5, 6], [2, 1, 5, 6], [2, 4, 5, 6]]),
    "rows_2": (2, [[2, 3, 4, 6], [2, 3, 3, 6]]),
    "last_3": (-1, [[2, 3, 5, 2], [2, 3, 5, 7], [2, 3, 5, 1]]),
    "batch_2": (0, [[1, 3, 5, 6], [2, 3, 5, 6]]),
}


def launched_ops(cm) -> list[str]:  # type: ignore[no-untyped-def]
    return [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]


def concat_kernel(cm):  # type: ignore[no-untyped-def]
    (k,) = [k for k in cm.plan.kernels.values() if "# Concat" in k.source]
    return k


def concat_then_pointwise(axis: int, shapes: list[list[int]]):  # type: ignore[no-untyped-def]
    """Concat of the inputs -> Add a bias broadcast over the last axis -> Relu."""
    names = [f"x{i}" for i in range(len(shapes))]
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    nodes = [
        helper.make_node("Concat", names, ["c"], name="cat", axis=axis),
        helper.make_node("Add", ["c", "bias"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    inits = {"bias": RNG.standard_normal(out[-1:]) * 0.5}
    return make_model(nodes, dict(zip(names, shapes, strict=True)), {"y": out}, inits)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CONCATS))
def test_a_concat_and_the_pointwise_ops_after_it_are_one_kernel(case: str, precision: str) -> None:
    axis, shapes = CONCATS[case]
    model = concat_then_pointwise(axis, shapes)
    cm = check_against_ort(model, {f"x{i}": s for i, s in enumerate(shapes)}, precision)
    assert cm.report["kernels"] == {"before": 3, "after": 1}
    assert launched_ops(cm) == []
    (g,) = cm.report["fusion"]["groups"]
    assert g["rule"] == "pointwise+concat_select" and g["nodes"] == ["cat", "add", "relu"]
    source = concat_kernel(cm).source
    # One load per input, each masked to the lanes its range holds, and the selection.
    for k in range(len(shapes)):
        assert f"tl.load(in{k} + v0_q{k}, mask=v0_m{k}, other=0.0)" in source
    assert source.count("tl.where(v0_s < ") == len(shapes) - 1


def test_disabling_concat_select_leaves_the_copy() -> None:
    axis, shapes = CONCATS["channels_3"]
    model = concat_then_pointwise(axis, shapes)
    feeds = {f"x{i}": s for i, s in enumerate(shapes)}
    cm = check_against_ort(model, feeds, fusion_disable=("concat_select",))
    assert cm.report["kernels"] == {"before": 3, "after": 2}
    assert launched_ops(cm) == ["Concat"]
    (g,) = cm.report["fusion"]["groups"]
    assert g["rule"] == "pointwise" and g["nodes"] == ["add", "relu"]
    assert not [r for r in cm.report["fusion"]["not_fused"] if r["rule"] == "concat_select"]


def test_a_lone_concat_of_plain_tensors_stays_the_copy_and_says_why() -> None:
    nodes = [helper.make_node("Concat", ["a", "b"], ["y"], name="cat", axis=1)]
    model = make_model(nodes, {"a": [2, 3, 4, 5], "b": [2, 2, 4, 5]}, {"y": [2, 5, 4, 5]})
    cm = check_against_ort(model, {"a": [2, 3, 4, 5], "b": [2, 2, 4, 5]})
    assert launched_ops(cm) == ["Concat"]
    (nf,) = [r for r in cm.report["fusion"]["not_fused"] if r["rule"] == "concat_select"]
    assert nf["nodes"] == ["cat"] and "one launch either way" in nf["reason"]


def resize_concat(mode: str, then_relu: bool):  # type: ignore[no-untyped-def]
    """x [2, 3, 5, 6] -> Resize x2 (`mode`) -> Concat with s [2, 4, 10, 12] on channels
    (-> Relu)."""
    attrs = {"mode": mode}
    if mode == "linear":
        attrs["coordinate_transformation_mode"] = "half_pixel"
    nodes = [
        helper.make_node("Resize", ["x", "", "scales"], ["r"], name="up", **attrs),
        helper.make_node("Concat", ["s", "r"], ["c" if then_relu else "y"], name="cat", axis=1),
    ]
    if then_relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"], name="relu"))
    model = make_model(nodes, {"x": [2, 3, 5, 6], "s": [2, 4, 10, 12]}, {"y": [2, 7, 10, 12]})
    model.graph.initializer.append(
        numpy_helper.from_array(np.array([1, 1, 2, 2], dtype=np.float32), "scales")
    )
    return model


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("then_relu", [True, False], ids=["relu", "lone"])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_a_resized_input_is_gathered_by_the_concat_kernel(mode: str, then_relu: bool, precision: str) -> None:
    """The Resize before the Concat (as a segmentation decoder's skip connection has it) is
    computed by the Concat's loads: one launch for the Resize, the Concat (and the Relu)."""
    cm = check_against_ort(
        resize_concat(mode, then_relu), {"x": [2, 3, 5, 6], "s": [2, 4, 10, 12]}, precision
    )
    assert cm.report["kernels"] == {"before": 3 if then_relu else 2, "after": 1}
    assert launched_ops(cm) == []
    (g,) = cm.report["fusion"]["groups"]
    rule = "pointwise+concat_select+resize_gather" if then_relu else "concat_select+resize_gather"
    assert g["rule"] == rule and g["resize_gathered"] == ["up"]
    source = concat_kernel(cm).source
    assert "tl.load(in0 + v0_q0, mask=v0_m0, other=0.0)" in source
    taps = 4 if mode == "linear" else 1
    assert source.count("mask=v0_m1, other=0.0)") == taps  # the gather's taps, masked to r's range
    off = [r for r in cm.report["fusion"]["not_fused"] if r["rule"] in ("concat_select", "resize_gather")]
    assert off == []


def test_without_concat_select_the_resize_is_written_and_the_concat_copies() -> None:
    cm = check_against_ort(
        resize_concat("linear", False),
        {"x": [2, 3, 5, 6], "s": [2, 4, 10, 12]},
        fusion_disable=("concat_select",),
    )
    assert launched_ops(cm) == ["Concat"]  # the Resize: a gather kernel of its own (resize_gather)
    assert [g["rule"] for g in cm.report["fusion"]["groups"]] == ["resize_gather"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_channels_last_concat_of_conv_outputs(precision: str) -> None:
    """Two convs (channels-last) -> Concat on channels -> Sigmoid, the convs' own Concat epilogue
    off: the Concat joins the Sigmoid's kernel and selects along the NHWC channel axis (the last)."""
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x2", "w2"], ["b"], name="conv2"),
        helper.make_node("Concat", ["a", "b"], ["c"], name="cat", axis=1),
        helper.make_node("Sigmoid", ["c"], ["y"], name="sig"),
    ]
    inits = {"w1": RNG.standard_normal((4, 3, 3, 3)) * 0.3, "w2": RNG.standard_normal((5, 3, 1, 1)) * 0.3}
    shapes = {"x": [2, 3, 6, 7], "x2": [2, 3, 6, 7]}
    model = make_model(nodes, shapes, {"y": [2, 9, 6, 7]}, inits)
    cm = check_against_ort(model, shapes, precision, (*NHWC_ALWAYS, "concat_epilogue"))
    assert launched_ops(cm) == ["opfuse.ConvNHWC", "opfuse.ConvNHWC"]
    assert cm.report["kernels"] == {"before": 4, "after": 3}
    (g,) = cm.report["fusion"]["groups"]
    assert g["rule"] == "pointwise+concat_select" and g["nodes"] == ["cat", "sig"]
    source = concat_kernel(cm).source
    assert "axis 3 [0, 4)" in source and "axis 3 [4, 9)" in source
    assert "mask=v0_m0" in source and "mask=v0_m1" in source


def norm_of_concat(norm: str, axis: int, resized: bool):  # type: ignore[no-untyped-def]
    """a [2, 4, 6, 8] and b (or x [2, 4, 3, 4] resized x2, nearest) -> Concat -> GroupNorm (4 groups of
    the 8 channels, each group within one input) or InstanceNorm -> Relu."""
    b_shape = [2, 4, 6, 8] if axis == 1 else [2, 8, 6, 8]
    a_shape = [2, 4, 6, 8] if axis == 1 else [2, 8, 5, 8]
    out = [2, 8, 6, 8] if axis == 1 else [2, 8, 11, 8]
    nodes = []
    if resized:
        nodes.append(helper.make_node("Resize", ["x", "", "scales"], ["b"], name="up", mode="nearest"))
    nodes.append(helper.make_node("Concat", ["a", "b"], ["c"], name="cat", axis=axis))
    if norm == "group":
        nodes.append(
            helper.make_node("GroupNormalization", ["c", "s", "t"], ["n"], name="norm", num_groups=4)
        )
    else:
        nodes.append(helper.make_node("InstanceNormalization", ["c", "s", "t"], ["n"], name="norm"))
    nodes.append(helper.make_node("Relu", ["n"], ["y"], name="relu"))
    inits = {"s": 1 + RNG.standard_normal(8) * 0.2, "t": RNG.standard_normal(8) * 0.2}
    inputs = {"a": a_shape, **({"x": [2, 4, 3, 4]} if resized else {"b": b_shape})}
    model = make_model(nodes, inputs, {"y": out}, inits)
    if resized:
        model.graph.initializer.append(
            numpy_helper.from_array(np.array([1, 1, 2, 2], dtype=np.float32), "scales")
        )
    if norm == "group":  # opset 21: scale and bias per channel
        model.opset_import[0].version = 21
        model.ir_version = 10
    return model, inputs


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    ("norm", "axis", "resized"),
    [("group", 1, True), ("group", 1, False), ("instance", 1, True), ("instance", 2, False)],
)
def test_a_normalization_reads_its_rows_through_the_concat(
    norm: str, axis: int, resized: bool, precision: str
) -> None:
    """The row kernel loads each element of its rows from the Concat input that holds it (the
    Resize gathered there too): SegDecoder's skip Concat and GroupNorm are one launch. Along H an
    InstanceNorm row spans both inputs, each element selected on its own."""
    model, inputs = norm_of_concat(norm, axis, resized)
    cm = check_against_ort(model, inputs, precision)
    assert cm.report["kernels"] == {"before": 3 + resized, "after": 1}
    assert launched_ops(cm) == []
    (g,) = cm.report["fusion"]["groups"]
    rule = "row_reduction+concat_select" + ("+resize_gather" if resized else "")
    assert g["kind"] == "rowwise" and g["rule"] == rule and g["nodes"] == ["cat", "norm", "relu"]
    source = concat_kernel(cm).source
    assert "v0_s = (row * " in source and "mask=v0_m0, other=0.0)" in source
    assert source.count("mask=v0_m1, other=0.0)") == 1


def test_without_concat_select_the_normalization_reads_the_copy() -> None:
    model, inputs = norm_of_concat("group", 1, True)
    cm = check_against_ort(model, inputs, fusion_disable=("concat_select",))
    assert launched_ops(cm) == ["Concat"]
    rules = {g["rule"]: g["nodes"] for g in cm.report["fusion"]["groups"]}
    assert rules["row_reduction"] == ["norm", "relu"] and len(rules) == 2  # the Resize's own kernel


def layer_norm_of_concat(case: str):  # type: ignore[no-untyped-def]
    """`tokens`: ViT's class token: Concat(cls [2, 1, 8], patches [2, 6, 8]) along the tokens, plus
    a position table, then LayerNorm over the 8 channels. `channels`: Swin's patch merging, the
    four 2x2-strided Slices of x [2, 4, 4, 8] concatenated along the channels, then LayerNorm over
    the 32."""
    if case == "tokens":
        nodes = [
            helper.make_node("Concat", ["cls", "p"], ["c"], name="cat", axis=1),
            helper.make_node("Add", ["c", "pos"], ["a"], name="pos_add"),
            helper.make_node("LayerNormalization", ["a", "s", "t"], ["y"], name="norm", axis=-1),
        ]
        inputs, width, out = {"cls": [2, 1, 8], "p": [2, 6, 8]}, 8, [2, 7, 8]
        inits = {"pos": RNG.standard_normal((1, 7, 8))}
    else:
        nodes, parts = [], []
        for k in range(4):
            names_ = [f"st{k}", f"en{k}", "ax", "two"]
            nodes.append(helper.make_node("Slice", ["x", *names_], [f"x{k}"], name=f"slice{k}"))
            parts.append(f"x{k}")
        nodes += [
            helper.make_node("Concat", parts, ["c"], name="cat", axis=-1),
            helper.make_node("LayerNormalization", ["c", "s", "t"], ["y"], name="norm", axis=-1),
        ]
        inputs, width, out = {"x": [2, 4, 4, 8]}, 32, [2, 2, 2, 32]
        inits = {"ax": np.array([1, 2]), "two": np.array([2, 2])}
        for k, (h0, w0) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
            inits[f"st{k}"], inits[f"en{k}"] = np.array([h0, w0]), np.array([4, 4])
    inits.update(s=1 + RNG.standard_normal(width) * 0.2, t=RNG.standard_normal(width) * 0.2)
    ints = {k: v for k, v in inits.items() if v.dtype.kind == "i"}
    model = make_model(nodes, inputs, {"y": out}, {k: v for k, v in inits.items() if k not in ints})
    model.graph.initializer.extend(numpy_helper.from_array(v.astype(np.int64), k) for k, v in ints.items())
    return model, inputs


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", ["tokens", "channels"])
def test_a_layer_norm_reads_its_rows_through_the_concat(case: str, precision: str) -> None:
    """A LayerNorm's rows lie whole in the Concat's output: the row kernel selects each element from
    the input that holds it (through the Slices as strided views), so the Concat is not copied."""
    model, inputs = layer_norm_of_concat(case)
    cm = check_against_ort(model, inputs, precision)
    assert cm.report["kernels"]["after"] == 1 and launched_ops(cm) == []
    (g,) = cm.report["fusion"]["groups"]
    assert g["kind"] == "rowwise" and "concat_select" in g["rule"] and "cat" in g["nodes"], g
