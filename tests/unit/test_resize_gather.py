"""`resize_gather`: a Resize read only by one pointwise kernel is computed by that kernel's loads
(gathers at the source coordinates), and the resized tensor is never written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.unit.test_fusion import NHWC_ALWAYS, check_against_ort, make_model, ort_run

RNG = np.random.default_rng(21)
COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
# (how the output size is given, the values, the resized H and W of a 9x11 input)
RESIZES = {
    "up_2.5": ("scales", [1.0, 1.0, 2.5, 2.5], (22, 27)),
    "sizes_20x24": ("sizes", [2, 3, 20, 24], (20, 24)),
    "down_0.6": ("scales", [1.0, 1.0, 0.6, 0.6], (5, 6)),
    "sizes_1x4": ("sizes", [2, 3, 1, 4], (1, 4)),
}


def resize_model(
    how: str,
    values: list[float],
    out_hw: tuple[int, int],
    window: tuple[int, int, int, int] | None = None,
    **attrs: object,
) -> tuple[onnx.ModelProto, tuple[int, int]]:
    """x [2, 3, 9, 11] -> Resize -> (Slice to `window` = (h0, h1, w0, w1)) -> Add b -> Relu."""
    if how == "scales":
        resize = helper.make_node("Resize", ["x", "", "scales"], ["r"], **attrs)
        const = numpy_helper.from_array(np.array(values, dtype=np.float32), "scales")
    else:
        resize = helper.make_node("Resize", ["x", "", "", "sizes"], ["r"], **attrs)
        const = numpy_helper.from_array(np.array(values, dtype=np.int64), "sizes")
    nodes = [resize]
    hw = out_hw
    inits = []
    read = "r"
    if window is not None:
        h0, h1, w0, w1 = window
        nodes.append(helper.make_node("Slice", ["r", "starts", "ends", "axes"], ["s"]))
        inits = [
            numpy_helper.from_array(np.array([h0, w0], dtype=np.int64), "starts"),
            numpy_helper.from_array(np.array([h1, w1], dtype=np.int64), "ends"),
            numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "axes"),
        ]
        hw, read = (h1 - h0, w1 - w0), "s"
    nodes += [helper.make_node("Add", [read, "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    model = make_model(nodes, {"x": [2, 3, 9, 11], "b": [2, 3, *hw]}, {"y": [2, 3, *hw]})
    model.graph.initializer.extend([const, *inits])
    return model, hw


def gather_kernel(cm):  # type: ignore[no-untyped-def]
    (k,) = [k for k in cm.plan.kernels.values() if "resized" in k.source]
    return k


def check_resize(model: onnx.ModelProto, hw: tuple[int, int], precision: str = "fp32", loads: int = 2):  # type: ignore[no-untyped-def]
    cm = check_against_ort(model, {"x": [2, 3, 9, 11], "b": [2, 3, *hw]}, precision)
    # Resize, Add and Relu (and a Slice, a view): one kernel, loading the resized input at computed
    # coordinates.
    assert cm.report["kernels"] == {"before": 3, "after": 1}  # a Slice launches nothing
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.launches]
    (g,) = cm.report["fusion"]["groups"]
    assert g["rule"] == "pointwise+resize_gather" and g["resize_gathered"] == ["Resize#n0"]
    k = gather_kernel(cm)
    assert k.inputs == ["x", "b"]
    assert k.source.count("tl.load(") == loads + 1  # the gather's taps, and b
    return cm


@pytest.mark.parametrize("size", list(RESIZES))
@pytest.mark.parametrize("coordinate_mode", COORDINATE_MODES)
@pytest.mark.parametrize("nearest_mode", NEAREST_MODES)
def test_nearest_resize_is_one_gather_load(size: str, coordinate_mode: str, nearest_mode: str) -> None:
    how, values, out_hw = RESIZES[size]
    model, hw = resize_model(
        how,
        values,
        out_hw,
        mode="nearest",
        coordinate_transformation_mode=coordinate_mode,
        nearest_mode=nearest_mode,
    )
    check_resize(model, hw, loads=1)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("size", list(RESIZES))
@pytest.mark.parametrize("coordinate_mode", COORDINATE_MODES)
def test_bilinear_resize_is_four_gather_loads_and_a_blend(
    size: str, coordinate_mode: str, precision: str
) -> None:
    how, values, out_hw = RESIZES[size]
    model, hw = resize_model(
        how, values, out_hw, mode="linear", coordinate_transformation_mode=coordinate_mode
    )
    cm = check_resize(model, hw, precision, loads=4)
    assert "tl.div_rn(" in gather_kernel(cm).source or coordinate_mode != "asymmetric"


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_a_slice_of_the_resized_value_offsets_the_coordinates(mode: str, precision: str) -> None:
    """SegDecoder's `interpolate(y, scale_factor=2.5, align_corners=True)[..., :20, :24]`, with
    windows that start inside the resized value."""
    model, hw = resize_model(
        "scales",
        [1.0, 1.0, 2.5, 2.5],
        (22, 27),
        (1, 21, 2, 26),
        mode=mode,
        coordinate_transformation_mode="align_corners",
    )
    cm = check_resize(model, hw, precision, loads=4 if mode == "linear" else 1)
    (g,) = cm.report["fusion"]["groups"]
    assert g["layout_folded"] == ["Slice#n1"]
    source = gather_kernel(cm).source
    assert "(((offs // 24) % 20) + 1)" in source and "((offs % 24) + 2)" in source


@pytest.mark.parametrize("size", list(RESIZES))
@pytest.mark.parametrize("coordinate_mode", COORDINATE_MODES)
def test_bicubic_resize_is_sixteen_gather_loads_and_a_blend(size: str, coordinate_mode: str) -> None:
    """Keys' cubic filter over 4x4 taps (edge pixels repeated), as torch's bicubic interpolation
    exports it (cubic_coeff_a -0.75), upscaling and downscaling, against onnxruntime."""
    how, values, out_hw = RESIZES[size]
    model, hw = resize_model(
        how, values, out_hw, mode="cubic", coordinate_transformation_mode=coordinate_mode
    )
    check_resize(model, hw, loads=16)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_bicubic_resize_takes_the_models_cubic_coefficient(precision: str) -> None:
    model, hw = resize_model("scales", [1.0, 1.0, 2.5, 2.5], (22, 27), mode="cubic", cubic_coeff_a=-0.5)
    cm = check_resize(model, hw, precision, loads=16)
    assert "-0.5" in gather_kernel(cm).source and "-0.75" not in gather_kernel(cm).source


def test_unsupported_resizes_stay_ops_and_say_why() -> None:
    model, hw = resize_model("scales", [1.0, 1.0, 2.5, 2.5], (22, 27), mode="cubic", exclude_outside=1)
    cm = check_against_ort(model, {"x": [2, 3, 9, 11], "b": [2, 3, *hw]})
    assert cm.report["kernels"] == {"before": 3, "after": 2}  # the Resize, then Add and Relu
    reasons = [r for r in cm.report["fusion"]["not_fused"] if r["rule"] == "resize_gather"]
    assert reasons == [
        {
            "rule": "resize_gather",
            "nodes": ["Resize#n0"],
            "reason": "exclude_outside: taps past the edges renormalize the weights",
        }
    ]
    model, hw = resize_model("scales", [1.0, 1.0, 0.6, 0.6], (5, 6), mode="linear", antialias=1)
    cm = check_against_ort(model, {"x": [2, 3, 9, 11], "b": [2, 3, *hw]})
    assert cm.report["kernels"]["after"] == 2
    assert any(r["reason"].startswith("antialias") for r in cm.report["fusion"]["not_fused"])


def test_a_resize_of_the_channels_is_not_gathered() -> None:
    model, _ = resize_model("sizes", [2, 6, 9, 11], (9, 11), mode="nearest")
    model.graph.input[1].CopyFrom(helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 6, 9, 11]))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 9, 11]))
    cm = check_against_ort(model, {"x": [2, 3, 9, 11], "b": [2, 6, 9, 11]})
    assert cm.report["kernels"]["after"] == 2
    reasons = [r["reason"] for r in cm.report["fusion"]["not_fused"] if r["rule"] == "resize_gather"]
    assert reasons == ["resizes N or C: the gather resizes H and W"]


def test_disabling_the_rule_gives_the_plan_without_it() -> None:
    model, hw = resize_model("scales", [1.0, 1.0, 2.5, 2.5], (22, 27), mode="linear")
    cm = check_against_ort(model, {"x": [2, 3, 9, 11], "b": [2, 3, *hw]}, fusion_disable=("resize_gather",))
    assert cm.report["kernels"] == {"before": 3, "after": 2}
    assert [s.op_type for s in cm.plan.steps if s.kind == "op"] == ["Resize"]
    assert not any("div_rn" in k.source for k in cm.plan.kernels.values())
    assert not [r for r in cm.report["fusion"]["not_fused"] if r["rule"] == "resize_gather"]


def lone_resize_group(cm):  # type: ignore[no-untyped-def]
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["rule"] == "resize_gather"]
    return g


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_a_resize_read_by_two_kernels_is_a_gather_kernel_of_its_own(mode: str) -> None:
    """Read by a pointwise op and a pool, the resized value is written once, by a generated kernel
    that gathers it (no library resize: a gather, weighing and sum per axis), and both read it."""
    nodes = [
        helper.make_node("Resize", ["x", "", "scales"], ["r"], mode=mode),
        helper.make_node("Relu", ["r"], ["y"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2]),
    ]
    model = make_model(nodes, {"x": [1, 2, 4, 5]}, {"y": [1, 2, 8, 10], "p": [1, 2, 7, 9]})
    model.graph.initializer.append(
        numpy_helper.from_array(np.array([1, 1, 2, 2], dtype=np.float32), "scales")
    )
    cm = check_against_ort(model, {"x": [1, 2, 4, 5]})
    assert "Resize" not in [s.op_type for s in cm.plan.steps if s.kind == "op"]
    assert lone_resize_group(cm)["nodes"] == ["Resize#n0"]
    assert not [r for r in cm.report["fusion"]["not_fused"] if r["rule"] == "resize_gather"]
    k = gather_kernel(cm)
    assert k.inputs == ["x"] and k.outputs == ["r"]
    assert k.source.count("tl.load(") == {"nearest": 1, "linear": 4, "cubic": 16}[mode]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_an_upsampled_graph_output_is_gathered_from_the_channels_last_conv(precision: str) -> None:
    """A segmentation head: the classifier conv runs channels-last, and the model's output is its
    bilinear upsampling to the image (NCHW). The Resize's kernel reads the conv's NHWC buffer
    through the Transpose back, folded into the gather's strides: no copy, no library resize."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node(
            "Resize",
            ["c", "", "", "sizes"],
            ["y"],
            mode="linear",
            coordinate_transformation_mode="half_pixel",
        ),
    ]
    model = make_model(
        nodes, {"x": [1, 3, 8, 6]}, {"y": [1, 5, 32, 24]}, {"w": RNG.standard_normal((5, 3, 3, 3)) * 0.3}
    )
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 5, 32, 24], dtype=np.int64), "sizes"))
    cm = check_against_ort(model, {"x": [1, 3, 8, 6]}, precision, NHWC_ALWAYS)
    launched = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert "Resize" not in launched and "Transpose" not in launched
    g = lone_resize_group(cm)
    assert g["nodes"] == ["Resize#n1"] and g["layout_folded"] == ["Transpose#ncl2"]
    assert "__nhwc" in gather_kernel(cm).inputs[0]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_resize_of_a_channels_last_conv_reads_the_nhwc_buffer(precision: str) -> None:
    """The conv runs channels-last; the Resize (NCHW) reads the conv's NHWC output through the
    Transpose back, folded into the gather's strides: no copy and no Resize launch."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node(
            "Resize", ["c", "", "scales"], ["r"], mode="linear", coordinate_transformation_mode="half_pixel"
        ),
        helper.make_node("Add", ["r", "b"], ["y"]),
    ]
    inits = {"w": RNG.standard_normal((4, 3, 3, 3)) * 0.3, "scales": np.array([1, 1, 2.5, 2.5])}
    model = make_model(nodes, {"x": [1, 3, 8, 6], "b": [1, 4, 20, 15]}, {"y": [1, 4, 20, 15]}, inits)
    cm = check_against_ort(model, {"x": [1, 3, 8, 6], "b": [1, 4, 20, 15]}, precision, NHWC_ALWAYS)
    launched = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert "Resize" not in launched and "Transpose" not in launched
    k = gather_kernel(cm)
    assert "__nhwc" in k.inputs[0]
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["rule"] == "pointwise+resize_gather"]
    assert g["resize_gathered"] == ["Resize#n1"] and g["layout_folded"] == ["Transpose#ncl2"]


def test_a_resize_an_lrn_reads_at_neighbouring_channels_is_written_not_gathered() -> None:
    """Clip -> nearest 2x upsampling -> LRN (a small CNN of the opset tests): the LRN loads its
    input at neighbouring channel offsets from memory, which a gather does not give, so the Resize
    is a gather kernel of its own that writes its output, and the LRN's kernel reads it."""
    nodes = [
        helper.make_node("Clip", ["x", "lo", "hi"], ["c"], name="clip"),
        helper.make_node("Resize", ["c", "", "scales"], ["r"], name="up", mode="nearest"),
        helper.make_node("LRN", ["r"], ["n"], name="lrn", size=3),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    inits = {"lo": np.array(-0.4), "hi": np.array(1.5), "scales": np.array([1.0, 1.0, 2.0, 2.0])}
    model = make_model(nodes, {"x": [2, 4, 5, 6]}, {"y": [2, 4, 10, 12]}, inits)
    cm = check_against_ort(model, {"x": [2, 4, 5, 6]}, fusion_disable=NHWC_ALWAYS)
    assert [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches] == ["Clip"]
    assert lone_resize_group(cm)["nodes"] == ["up"]  # its own kernel writes it
    (lrn,) = [g for g in cm.report["fusion"]["groups"] if "lrn" in g["nodes"]]
    assert "up" not in lrn.get("resize_gathered", [])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_a_transposed_and_sliced_resize_is_gathered_in_the_readers_axis_order(
    mode: str, precision: str
) -> None:
    """Resize (NCHW) -> Slice of H and W -> Transpose to NHWC -> Add -> Relu: the kernel iterates
    over NHWC and maps each of its axes back to the resized one that Transpose put there (C is
    its last axis), the Slice's starts on H and W added: one kernel, the resized value unwritten."""
    nodes = [
        helper.make_node("Resize", ["x", "", "scales"], ["r"], mode=mode),
        helper.make_node("Slice", ["r", "starts", "ends", "axes"], ["s"]),
        helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("Add", ["t", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    model = make_model(nodes, {"x": [2, 3, 9, 11], "b": [2, 16, 18, 3]}, {"y": [2, 16, 18, 3]})
    model.graph.initializer.extend(
        numpy_helper.from_array(np.array(v, dtype=dtype), name)
        for name, v, dtype in [
            ("scales", [1, 1, 2, 2], np.float32),
            ("starts", [1, 2], np.int64),
            ("ends", [17, 20], np.int64),
            ("axes", [2, 3], np.int64),
        ]
    )
    cm = check_against_ort(model, {"x": [2, 3, 9, 11], "b": [2, 16, 18, 3]}, precision)
    assert cm.report["kernels"]["after"] == 1
    (g,) = cm.report["fusion"]["groups"]
    assert g["rule"] == "pointwise+resize_gather" and g["resize_gathered"] == ["Resize#n0"]
    source = gather_kernel(cm).source
    # C from the kernel's last axis, H (its axis 1) and W (axis 2) with the Slice's starts.
    assert "(offs % 3) * 99" in source and "(((offs // 54) % 16) + 1)" in source
    assert "(((offs // 3) % 18) + 2)" in source


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_an_fpn_top_down_step_gathers_the_upsampled_map_in_the_adds_kernel(precision: str) -> None:
    """An FPN's top-down step, lateral(c4) + upsample(coarse), all convs channels-last: the Resize
    runs in NCHW between Transposes, and the Add's kernel gathers it from the coarse conv's NHWC
    buffer through both. As in torchvision's detection backbones (three such Resizes each), the
    lateral conv is merged with a sibling 1x1 conv that reads the same input (the next stage's
    first conv; its Split keeps the Add out of the conv's epilogue), so the Add is a pointwise
    kernel of its own."""
    nodes = [
        helper.make_node("Conv", ["x", "wc"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Resize", ["c", "", "scales"], ["r"], mode="nearest"),
        helper.make_node("Conv", ["x", "wl"], ["l"]),
        helper.make_node("Conv", ["x", "wn"], ["n"]),
        helper.make_node("Relu", ["n"], ["z"]),
        helper.make_node("Add", ["l", "r"], ["s"]),
        helper.make_node("Conv", ["s", "wo"], ["y"], pads=[1, 1, 1, 1]),
    ]
    inits = {
        "wc": RNG.standard_normal((8, 4, 3, 3)) * 0.3,
        "wl": RNG.standard_normal((8, 4, 1, 1)) * 0.5,
        "wn": RNG.standard_normal((6, 4, 1, 1)) * 0.5,
        "wo": RNG.standard_normal((8, 8, 3, 3)) * 0.2,
        "scales": np.array([1, 1, 2, 2]),
    }
    model = make_model(nodes, {"x": [2, 4, 10, 12]}, {"y": [2, 8, 10, 12], "z": [2, 6, 10, 12]}, inits)
    cm = check_against_ort(model, {"x": [2, 4, 10, 12]}, precision, NHWC_ALWAYS)
    assert cm.report["fusion"]["passes"]["fired"]["merge_sibling_convs"] == 1
    launched = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert "Resize" not in launched
    (g,) = [g for g in cm.report["fusion"]["groups"] if g.get("resize_gathered")]
    assert g["nodes"] == ["Add#n5"] and g["resize_gathered"] == ["Resize#n1"]
    assert len(g["layout_folded"]) == 2  # the Transposes on either side of the Resize
    k = gather_kernel(cm)
    assert all("__nhwc" in x for x in k.inputs)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_the_lateral_convs_epilogue_gathers_the_upsampled_map(mode: str, precision: str) -> None:
    """The FPN top-down step where the lateral conv has no sibling to merge with (a ResNet-18's
    next stage reads its input at stride 2): the Add joins the lateral conv's epilogue, and the
    conv kernel gathers the upsampled map from the coarse conv's NHWC buffer through the
    Transposes around the Resize, at each element of its output tile."""
    nodes = [
        helper.make_node("Conv", ["x", "wc"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Resize", ["c", "", "scales"], ["r"], mode=mode),
        helper.make_node("Conv", ["x", "wl", "bl"], ["l"]),
        helper.make_node("Add", ["l", "r"], ["s"]),
        helper.make_node("Conv", ["s", "wo"], ["y"], pads=[1, 1, 1, 1]),
    ]
    inits = {
        "wc": RNG.standard_normal((8, 4, 3, 3)) * 0.3,
        "wl": RNG.standard_normal((8, 4, 1, 1)) * 0.5,
        "bl": RNG.standard_normal(8) * 0.1,
        "wo": RNG.standard_normal((8, 8, 3, 3)) * 0.2,
        "scales": np.array([1, 1, 2, 2]),
    }
    model = make_model(nodes, {"x": [2, 4, 10, 12]}, {"y": [2, 8, 10, 12]}, inits)
    cm = check_against_ort(model, {"x": [2, 4, 10, 12]}, precision, NHWC_ALWAYS, tune_budget_s=0)
    launched = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert "Resize" not in launched
    (g,) = [g for g in cm.report["fusion"]["groups"] if g.get("resize_gathered")]
    assert g["rule"] == "conv_epilogue+resize_gather" and g["nodes"] == ["opfuse.ConvNHWC#n2", "Add#n3"]
    assert g["resize_gathered"] == ["Resize#n1"] and len(g["layout_folded"]) == 2
    (k,) = [k for k in cm.plan.kernels.values() if k.group == g["id"]]
    assert (
        k.kind == "conv"
        and "in1: resized [2, 8, 10, 12] by gather loads from its input [2, 8, 5, 6]" in k.source
    )
    assert k.inputs[3] == "c__nhwc3"  # the coarse conv's NHWC output, behind both Transposes
    # Tuning's alternative: the Transposes and the Resize as library ops before the library's
    # conv, its Add a pointwise kernel after it; the same result.
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor
    from tests.builders import TEST_DEVICE

    p = plan_model(model, {"x": [2, 4, 10, 12]}, precision, NHWC_ALWAYS)
    (pg,) = [x for x in p.fusion.groups if x.id == g["id"]]
    vendor = build_plan(
        p.graph, p.fusion, precision, p.plan.inputs, p.plan.outputs, variants={pg.id: "vendor"}
    )
    mine = [s.op_type for s in vendor.steps if s.group == pg.id and s.launches]
    assert "Resize" in mine and mine[-2:] == ["opfuse.ConvNHWC", ""]
    x = RNG.standard_normal((2, 4, 10, 12)).astype(np.float32)
    want = ort_run(model, {"x": x})[0]
    got = np.asarray(Executor(vendor, TEST_DEVICE).run({"x": x})["y"], dtype=np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (1e-4 if precision == "fp32" else 2e-2)


def attention_pool(layout: str, mode: str) -> onnx.ModelProto:
    """GhostNetV2's attention before squeeze-excitation: m = f * Resize(Sigmoid(s)) (2x up), and
    the mean of m over the pixels. `layout` "nchw": m and its mean in [N, C, H, W] (whole rows of
    the row kernel); "nhwc": f in [N, H, W, C], the resized map transposed to it, the mean over
    strided columns."""
    nodes = [
        helper.make_node("Sigmoid", ["s"], ["g"]),
        helper.make_node("Resize", ["g", "", "scales"], ["up"], mode=mode),
    ]
    if layout == "nhwc":
        nodes.append(helper.make_node("Transpose", ["up"], ["upt"], perm=[0, 2, 3, 1]))
        f_shape, axes = [2, 10, 12, 6], [1, 2]
    else:
        f_shape, axes = [2, 6, 10, 12], [2, 3]
    nodes += [
        helper.make_node("Mul", ["f", "upt" if layout == "nhwc" else "up"], ["m"]),
        helper.make_node("ReduceMean", ["m", "axes"], ["p"], keepdims=1),
        helper.make_node("Mul", ["m", "p"], ["y"]),
    ]
    model = make_model(nodes, {"f": f_shape, "s": [2, 6, 5, 6]}, {"y": f_shape})
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([1.0, 1.0, 2.0, 2.0], dtype=np.float32), "scales"),
            numpy_helper.from_array(np.array(axes, dtype=np.int64), "axes"),
        ]
    )
    return model


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_row_kernel_that_pools_the_scaled_map_gathers_the_resize(
    layout: str, mode: str, precision: str
) -> None:
    m = attention_pool(layout, mode)
    f_shape = [2, 10, 12, 6] if layout == "nhwc" else [2, 6, 10, 12]
    cm = check_against_ort(m, {"f": f_shape, "s": [2, 6, 5, 6]}, precision)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert "resize_gather" in g["rule"].split("+")
    assert not [s for s in cm.plan.steps if s.op_type in ("Resize", "Transpose")]
    assert cm.report["kernels"]["after"] == 2  # the sigmoid's kernel, the row kernel
