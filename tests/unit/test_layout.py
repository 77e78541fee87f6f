"""Channels-last: the conv region of a graph runs in NHWC and computes the same function."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import onnx
import pytest
from onnx import helper

import opfuse
from opfuse.runtime.ops import SUPPORTED_OPS
from tests.builders import TEST_DEVICE
from tests.unit.test_fusion import NHWC_ALWAYS, make_model, ort_run

RNG = np.random.default_rng(11)


def conv_net() -> onnx.ModelProto:
    """Conv+Relu -> MaxPool -> Conv with a per-channel scale [C,1,1] -> Concat on channels with the
    pooled tensor -> GlobalAveragePool -> Flatten: every kind of node the pass rewrites, and both
    edges of the region (the NCHW input, the 2-D output)."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c2", "scale"], ["s2"]),
        helper.make_node("Sigmoid", ["s2"], ["g2"]),
        helper.make_node("Concat", ["g2", "p1"], ["cat"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["y"]),
    ]
    inits = {
        "w1": RNG.standard_normal((16, 3, 3, 3)) * 0.3,
        "b1": RNG.standard_normal(16) * 0.1,
        "w2": RNG.standard_normal((24, 16, 3, 3)) * 0.1,
        "scale": RNG.uniform(0.5, 1.5, (24, 1, 1)),
    }
    return make_model(nodes, {"x": [2, 3, 8, 8]}, {"y": [2, 40]}, inits)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_conv_region_runs_channels_last_and_matches_onnxruntime(precision: str) -> None:
    model = conv_net()
    cm = opfuse.compile(
        model, {"x": [2, 3, 8, 8]}, precision=precision, device=TEST_DEVICE, fusion_disable=NHWC_ALWAYS
    )
    assert cm.report["verification"]["passed"] is True
    assert cm.report["fusion"]["passes"]["fired"]["channels_last"] == 2
    ops = [s.op_type for s in cm.plan.steps if s.kind == "op"]
    assert "Conv" not in ops and "MaxPool" not in ops and "GlobalAveragePool" not in ops
    # The NHWC pool (2x2 at stride 2) runs on the first conv's output tile (pool_tail), which
    # stores it for the second conv and the Concat.
    assert any(
        "MaxPoolNHWC" in k.source and "(on the output tile" in k.source for k in cm.plan.kernels.values()
    )
    kinds = {k.kind for k in cm.plan.kernels.values()}
    assert "conv" in kinds
    conv_src = next(k.source for k in cm.plan.kernels.values() if k.kind == "conv")
    assert "(NHWC)" in conv_src and "tl.dot(" in conv_src
    feeds = {"x": RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)}
    (ref,) = ort_run(model, feeds)
    out = cm.run(feeds)["y"]
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


def test_channels_last_can_be_switched_off() -> None:
    model = conv_net()
    cm = opfuse.compile(model, {"x": [2, 3, 8, 8]}, device=TEST_DEVICE, fusion_disable=["channels_last"])
    assert cm.report["verification"]["passed"] is True
    assert "channels_last" not in cm.report["fusion"]["passes"]["fired"]
    assert not any(s.op_type.startswith("opfuse.") for s in cm.plan.steps)
    conv_src = next(k.source for k in cm.plan.kernels.values() if k.kind == "conv")
    assert "(NHWC)" not in conv_src


def test_internal_ops_are_not_model_ops_and_export_in_opfuse_domain(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert not any(op.startswith("opfuse.") for op in SUPPORTED_OPS)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], group=4, pads=[1, 1, 1, 1]),  # depthwise: vendor conv
        helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    ]
    model = make_model(
        nodes, {"x": [1, 4, 6, 6]}, {"y": [1, 4, 6, 6]}, {"w": RNG.standard_normal((4, 1, 3, 3))}
    )
    cm = opfuse.compile(model, {"x": [1, 4, 6, 6]}, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    path = tmp_path / "b.zip"
    cm.save(path)
    with zipfile.ZipFile(path) as z:
        fused = onnx.load_model(io.BytesIO(z.read("model.onnx")))
    internal = [(n.domain, n.op_type) for n in fused.graph.node if n.domain == "ai.opfuse"]
    assert ("ai.opfuse", "ConvNHWC") in internal and ("ai.opfuse", "MaxPoolNHWC") in internal
    loaded = opfuse.load(path, device=TEST_DEVICE)
    feeds = {"x": RNG.standard_normal((1, 4, 6, 6)).astype(np.float32)}
    (ref,) = ort_run(model, feeds)
    np.testing.assert_allclose(loaded.run(feeds)["y"], ref, rtol=1e-4, atol=1e-5)


def test_the_models_own_permutes_are_absorbed() -> None:
    """A ConvNeXt block permutes to NHWC for its LayerNorm and MLP and back for the layer scale and
    the residual add: in the channels-last region both permutes vanish, and the layer scale and
    the residual join the second GEMM's epilogue."""
    c = 8
    nodes = [
        helper.make_node("Conv", ["x", "dw", "dwb"], ["d"], group=c, pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["d"], ["dt"], perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["dt", "g", "b"], ["ln"], axis=-1),
        helper.make_node("MatMul", ["ln", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("MatMul", ["hr", "w2"], ["o"]),
        helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 3, 1, 2]),
        helper.make_node("Mul", ["ot", "gamma"], ["s"]),
        helper.make_node("Add", ["s", "x"], ["y"]),
    ]
    inits = {
        "dw": RNG.standard_normal((c, 1, 3, 3)) * 0.3,
        "dwb": RNG.standard_normal(c) * 0.1,
        "g": RNG.uniform(0.5, 1.5, c),
        "b": RNG.standard_normal(c) * 0.1,
        "w1": RNG.standard_normal((c, 4 * c)) * 0.3,
        "w2": RNG.standard_normal((4 * c, c)) * 0.3,
        "gamma": RNG.uniform(0.5, 1.5, (c, 1, 1)),
    }
    shape = [2, c, 5, 5]
    model = make_model(nodes, {"x": shape}, {"y": shape}, inits)
    for precision, tol in (("fp32", 1e-4), ("fp16", 2e-2)):
        cm = opfuse.compile(
            model, {"x": shape}, precision=precision, device=TEST_DEVICE, fusion_disable=NHWC_ALWAYS
        )
        assert cm.report["verification"]["passed"] is True
        # Only the region's two edges remain as Transposes: into NHWC for the input, back for y.
        transposes = [s for s in cm.plan.steps if s.op_type == "Transpose"]
        assert len(transposes) == 2
        gemm = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "gemm"]
        assert any(len(g["nodes"]) == 3 for g in gemm)  # MatMul + Mul + Add
        feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
        (ref,) = ort_run(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_squeeze_excitation_scale_runs_inside_the_next_conv(precision: str) -> None:
    """x * sigmoid(fc(mean(x))) feeding a 1x1 conv: the per-(image, channel) scale is applied to
    the conv's input tiles as they load, so the Mul is no kernel of its own."""
    c, o = 16, 12
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a0"], ["a"]),
        helper.make_node("GlobalAveragePool", ["a"], ["m"]),
        helper.make_node("Conv", ["m", "w1", "b1"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["s"]),
        helper.make_node("Mul", ["a", "s"], ["se"], name="se_scale"),
        helper.make_node("Conv", ["se", "w2", "b2"], ["y"]),
    ]
    inits = {
        "w0": RNG.standard_normal((c, 8, 3, 3)) * 0.2,
        "w1": RNG.standard_normal((c, c, 1, 1)) * 0.3,
        "b1": RNG.standard_normal(c) * 0.1,
        "w2": RNG.standard_normal((o, c, 1, 1)) * 0.3,
        "b2": RNG.standard_normal(o) * 0.1,
    }
    shape = [2, 8, 6, 6]
    model = make_model(nodes, {"x": shape}, {"y": [2, o, 6, 6]}, inits)
    cm = opfuse.compile(
        model, {"x": shape}, precision=precision, device=TEST_DEVICE, fusion_disable=NHWC_ALWAYS
    )
    assert cm.report["verification"]["passed"] is True
    assert not any(s.op_type == "Mul" for s in cm.plan.steps)
    (g,) = [g for g in cm.report["fusion"]["groups"] if "se_scale" in g["nodes"]]
    assert g["kind"] == "conv" and g["nodes"][0] == "se_scale"
    src = cm.plan.kernels[g["kernel"]].source
    assert "(prologue: input scale)" in src and "sc_tile" in src
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    (ref,) = ort_run(model, feeds)
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


def test_input_scale_that_varies_over_the_image_is_not_folded() -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"]),
        helper.make_node("MaxPool", ["c0"], ["a"], kernel_shape=[1, 1]),  # the Mul is no epilogue
        helper.make_node("Mul", ["a", "t"], ["p"], name="pixel_scale"),
        helper.make_node("Conv", ["p", "w"], ["y"], name="conv"),
    ]
    shape = [1, 8, 5, 5]
    model = make_model(
        nodes,
        {"x": shape, "t": [1, 1, 5, 5]},
        {"y": [1, 4, 5, 5]},
        {"w": RNG.standard_normal((4, 8, 1, 1)), "w0": RNG.standard_normal((8, 8, 1, 1))},
    )
    # The pool stays the library's, or its kernel would take the Mul as its epilogue.
    off = (*NHWC_ALWAYS, "pool_epilogue")
    cm = opfuse.compile(
        model, {"x": shape, "t": [1, 1, 5, 5]}, device=TEST_DEVICE, fusion_disable=(*off, "operand_prologue")
    )
    assert cm.report["verification"]["passed"] is True
    reasons = [n["reason"] for n in cm.report["fusion"]["not_fused"] if "pixel_scale" in n["nodes"]]
    assert any("varies over the image" in r for r in reasons)
    # operand_prologue computes the product on the conv's input tiles instead (no refusal left).
    cm = opfuse.compile(model, {"x": shape, "t": [1, 1, 5, 5]}, device=TEST_DEVICE, fusion_disable=off)
    assert cm.report["verification"]["passed"] is True
    groups = [g for g in cm.report["fusion"]["groups"] if "pixel_scale" in g["nodes"]]
    assert [g["rule"] for g in groups] == ["conv_epilogue+operand_prologue"]
    assert not [n for n in cm.report["fusion"]["not_fused"] if "pixel_scale" in n["nodes"]]


@pytest.mark.parametrize(
    "op, axes, keepdims, converted",
    [
        ("ReduceMean", [2, 3], 0, True),  # timm's x.mean((2, 3)): [N, C] either way
        ("ReduceMax", [-1, -2], 1, True),
        ("ReduceSum", [2], 0, False),  # would leave [N, W, C] in NHWC order: stays NCHW
    ],
)
def test_written_out_reductions_run_on_the_nhwc_tensor(
    op: str, axes: list[int], keepdims: int, converted: bool
) -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node(op, ["r", "axes"], ["y"], keepdims=keepdims),
    ]
    shape = [2, 4, 6, 5]
    out = {
        (0, True): [2, 8],
        (1, True): [2, 8, 1, 1],
        (0, False): [2, 8, 5],
    }[(keepdims, converted)]
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, out)],
        initializer=[
            onnx.numpy_helper.from_array((RNG.standard_normal((8, 4, 3, 3)) * 0.3).astype(np.float32), "w"),
            onnx.numpy_helper.from_array(np.array(axes, dtype=np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    cm = opfuse.compile(model, {"x": shape}, device=TEST_DEVICE, fusion_disable=NHWC_ALWAYS)
    assert cm.report["verification"]["passed"] is True
    # Converted: the reduction reads the conv's NHWC output directly, no Transpose back before it.
    back = [s for s in cm.plan.steps if s.op_type == "Transpose" and s.attrs.get("perm") == [0, 3, 1, 2]]
    assert (len(back) == (1 if keepdims else 0)) if converted else len(back) == 1
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    (ref,) = ort_run(model, feeds)
    np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_split_halves_are_read_in_place_by_the_elementwise_kernel(precision: str) -> None:
    """A merged gate/up projection: MatMul -> Split -> SiLU(gate) * up. The kernel reads both
    halves from the MatMul's output at their offsets (a Split output handed to a kernel as a view
    would be copied first); the Split launches nothing."""
    from tests.unit.test_fusion import check_against_ort

    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="gate_up"),
        helper.make_node("Split", ["h", "sizes"], ["gate", "up"], name="split", axis=-1),
        helper.make_node("Sigmoid", ["gate"], ["s"], name="sig"),
        helper.make_node("Mul", ["gate", "s"], ["silu"], name="silu"),
        helper.make_node("Mul", ["silu", "up"], ["y"], name="gated"),
    ]
    inits = {"w": rng.standard_normal((16, 48))}
    sizes = onnx.numpy_helper.from_array(np.array([24, 24], np.int64), "sizes")
    model = make_model(nodes, {"x": [6, 16]}, {"y": [6, 24]}, inits)
    model.graph.initializer.append(sizes)
    model.graph.node[1].output[:] = ["up", "gate"]  # up is the first half: gate starts at column 24
    cm = check_against_ort(model, {"x": [6, 16]}, precision)
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "pointwise"]
    assert set(k.inputs) == {"h"}  # both halves come from the MatMul's output
    assert "+ 24" in k.source  # gate's offset into it
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "pointwise"]
    assert g["nodes"] == ["sig", "silu", "gated"]
    assert cm.report["kernels"]["after"] == 2  # the MatMul (or its template) and the gated SiLU


def test_split_outputs_read_by_different_kinds_of_kernel_are_each_read_in_place() -> None:
    """One half of a Split feeds an elementwise kernel, the other a row reduction: both read the
    Split's input at their offsets, and the Split, read by nobody any more, leaves the plan."""
    from tests.unit.test_fusion import check_against_ort

    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Split", ["h", "sizes"], ["a", "b"], name="split", axis=1),
        helper.make_node("Sigmoid", ["a"], ["s"], name="sig"),
        helper.make_node("Mul", ["s", "a"], ["y"], name="mul"),
        helper.make_node("Relu", ["b"], ["z"], name="relu"),
        helper.make_node("ReduceMax", ["z", "axes"], ["m"], name="max", keepdims=1),
    ]
    inits = {"w": rng.standard_normal((8, 20))}
    model = make_model(nodes, {"x": [5, 8]}, {"y": [5, 12], "m": [5, 1]}, inits)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([12, 8], np.int64), "sizes"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "axes"))
    cm = check_against_ort(model, {"x": [5, 8]})
    kinds = {k.kind: k.inputs for k in cm.plan.kernels.values()}
    assert kinds["pointwise"] == ["h"] and kinds["rowwise"] == ["h"]
    assert not any(s.op_type == "Split" for s in cm.plan.steps)


def test_a_slice_of_a_kernel_output_is_read_in_place() -> None:
    """ViT's packed projection: q, k and v are windows (Slice, or Gather of one index) of one
    buffer. An elementwise kernel reads its window at the window's offset instead of a copy."""
    from tests.unit.test_fusion import check_against_ort

    rng = np.random.default_rng(6)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="packed"),
        helper.make_node("Slice", ["h", "starts", "ends", "axes"], ["win"], name="window"),
        helper.make_node("Sigmoid", ["win"], ["s"], name="sig"),
        helper.make_node("Mul", ["s", "win"], ["y"], name="mul"),
        helper.make_node("Relu", ["h"], ["z"], name="relu"),  # h has another reader
    ]
    model = make_model(
        nodes, {"x": [3, 5, 8]}, {"y": [3, 5, 6], "z": [3, 5, 20]}, {"w": rng.standard_normal((8, 20))}
    )
    for name, v in (("starts", [9]), ("ends", [15]), ("axes", [-1])):
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(v, np.int64), name))
    cm = check_against_ort(model, {"x": [3, 5, 8]})
    (k,) = [k for k in cm.plan.kernels.values() if "tl.sigmoid" in k.source or "sigmoid" in k.source.lower()]
    assert k.inputs == ["h"] and "+ 9" in k.source  # the window starts 9 columns into each row
    assert not any(s.op_type == "Slice" for s in cm.plan.steps)  # nothing else read the window


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_row_kernel_reads_its_rows_through_a_transpose(precision: str) -> None:
    """A seq-first attention output [S, B, E] transposed back to [B, S, E] before the residual add
    and LayerNorm: each row (E) is contiguous in both layouts, so the row kernel reads the rows at
    their strides in the seq-first buffer instead of a transposed copy."""
    from tests.unit.test_fusion import check_against_ort

    rng = np.random.default_rng(7)
    s, b, e = 5, 3, 16
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["proj"], name="out_proj"),  # [S, B, E]
        helper.make_node("Transpose", ["proj"], ["t"], name="to_batch_first", perm=[1, 0, 2]),
        helper.make_node("Add", ["x", "t"], ["res"], name="residual"),
        helper.make_node("LayerNormalization", ["res", "g", "beta"], ["y"], name="ln", axis=-1),
    ]
    inits = {
        "w": rng.standard_normal((e, e)),
        "g": 1 + 0.1 * rng.standard_normal(e),
        "beta": rng.standard_normal(e),
    }
    model = make_model(nodes, {"a": [s, b, e], "x": [b, s, e]}, {"y": [b, s, e]}, inits)
    cm = check_against_ort(model, {"a": [s, b, e], "x": [b, s, e]}, precision)
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "rowwise"]
    assert "proj" in k.inputs and "t" not in k.inputs  # the MatMul's output, not a transposed copy
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert "to_batch_first" in g["layout_folded"]
    assert not any(st.op_type == "Transpose" for st in cm.plan.steps)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_row_kernel_reads_rows_at_a_step_of_two(precision: str) -> None:
    """FNet's real part of its Fourier transform: [..., 2] pairs, the real values sliced out and
    reshaped before the residual add and LayerNorm. Each row lies at a step of 2 in the pairs'
    buffer: the row kernel reads it there (`cols * 2`), where the runtime copied the view."""
    from tests.unit.test_fusion import check_against_ort

    rng = np.random.default_rng(11)
    b, s, e = 2, 6, 16
    nodes = [
        helper.make_node("Slice", ["pairs", "st", "en", "ax"], ["re"], name="real_part"),
        helper.make_node("Reshape", ["re", "shape"], ["select"], name="select"),
        helper.make_node("Add", ["x", "select"], ["res"], name="residual"),
        helper.make_node("LayerNormalization", ["res", "g", "beta"], ["y"], name="ln", axis=-1),
    ]
    inits = {"g": 1 + 0.1 * rng.standard_normal(e), "beta": rng.standard_normal(e)}
    model = make_model(nodes, {"pairs": [b, s, e, 2], "x": [b, s, e]}, {"y": [b, s, e]}, inits)
    for name, v in (("st", [0]), ("en", [1]), ("ax", [-1]), ("shape", [b, s, e])):
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(v, np.int64), name))
    cm = check_against_ort(model, {"pairs": [b, s, e, 2], "x": [b, s, e]}, precision)
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "rowwise"]
    assert "pairs" in k.inputs and "select" not in k.inputs and "cols * 2" in k.source
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert "real_part" in g["layout_folded"]
    assert not any(st.op_type in ("Slice", "Reshape") for st in cm.plan.steps)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_heads_merged_into_the_batch_and_split_out_again_are_read_in_place(precision: str) -> None:
    """Seq-first multi-head attention's head split, from a window of a packed projection (ViT's
    q): [S, B, 3E] -> [S, B, E] -> [S, B*H, D] -> [B*H, S, D] -> [B, H, S, D]. The middle shape is
    no strided view of the buffer (torch copies that reshape: B's stride is 3E, not H*D), but the
    chain's result is one: strides (3E, D, B*3E, 1). The kernel reads it in place."""
    from opfuse.frontend.load import load_and_specialize
    from opfuse.fusion.views import input_view
    from opfuse.graph import graph_from_onnx
    from tests.unit.test_fusion import check_against_ort

    rng = np.random.default_rng(8)
    s, b, h, d = 5, 3, 2, 4
    e = h * d
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["proj"], name="proj"),  # [S, B, 3E]
        helper.make_node("Slice", ["proj", "st", "en", "ax"], ["q"], name="q_window"),
        helper.make_node("Reshape", ["q", "s1"], ["r1"], name="merge_heads_into_batch"),
        helper.make_node("Transpose", ["r1"], ["t"], name="seq_second", perm=[1, 0, 2]),
        helper.make_node("Reshape", ["t", "s2"], ["r2"], name="split_heads"),
        helper.make_node("Sigmoid", ["r2"], ["sg"], name="sig"),
        helper.make_node("Mul", ["sg", "r2"], ["y"], name="mul"),
    ]
    model = make_model(nodes, {"a": [s, b, e]}, {"y": [b, h, s, d]}, {"w": rng.standard_normal((e, 3 * e))})
    for name, v in (("s1", [s, b * h, d]), ("s2", [b, h, s, d]), ("st", [e]), ("en", [2 * e]), ("ax", [2])):
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(v, np.int64), name))
    _, spec = load_and_specialize(model, {"a": [s, b, e]}, SUPPORTED_OPS)
    view = input_view(graph_from_onnx(spec), "r2")
    assert view.base == "proj" and view.shape == (b, h, s, d)
    assert view.strides == (3 * e, d, b * 3 * e, 1) and view.offset == e
    cm = check_against_ort(model, {"a": [s, b, e]}, precision)
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "pointwise"]
    assert k.inputs == ["proj"]
    assert not any(st.op_type in ("Reshape", "Transpose") for st in cm.plan.steps)


@pytest.mark.parametrize(
    "precision, device, depthwise, nhwc",
    [
        ("fp32", "cuda", False, False),  # dense convolutions in fp32 on the GPU: NCHW
        ("fp32", "cuda", True, True),  # a depthwise convolution in the region: channels-last
        ("fp16", "cuda", False, True),
        ("tf32", "cuda", False, True),
        ("fp32", "cpu", False, True),  # the interpreter runs either; the tests cover NHWC
    ],
)
def test_dense_fp32_convolutions_stay_nchw_on_the_gpu(
    precision: str, device: str, depthwise: bool, nhwc: bool
) -> None:
    """The layout decision is a graph pass: run here for either device, no GPU needed."""
    from opfuse.frontend.load import load_and_specialize
    from opfuse.graph import graph_from_onnx
    from opfuse.passes.layout import FP32_DENSE_REASON, FP32_DENSE_RULE
    from opfuse.passes.pipeline import run_passes
    from opfuse.runtime.ops import SUPPORTED_OPS

    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1], group=8 if depthwise else 1),
    ]
    w2 = RNG.standard_normal((8, 1, 3, 3) if depthwise else (8, 8, 3, 3))
    model = make_model(
        nodes, {"x": [1, 3, 6, 6]}, {"y": [1, 8, 6, 6]}, {"w1": RNG.standard_normal((8, 3, 3, 3)), "w2": w2}
    )
    _, spec = load_and_specialize(model, {"x": [1, 3, 6, 6]}, SUPPORTED_OPS)
    graph = graph_from_onnx(spec)
    result = run_passes(graph, (), precision, device)
    ops = {n.op_type for n in graph.nodes}
    assert ("opfuse.ConvNHWC" in ops) == nhwc and ("Conv" in ops) == (not nhwc)
    assert result.fired.get("channels_last", 0) == (2 if nhwc else 0)
    assert result.fired.get(FP32_DENSE_RULE, 0) == (0 if nhwc else 2)
    reasons = [nf.reason for nf in result.not_fired if nf.rule == "channels_last"]
    assert reasons == ([] if nhwc else [FP32_DENSE_REASON])
    if not nhwc:  # the switch: the same graph channels-last
        graph = graph_from_onnx(spec)
        run_passes(graph, (FP32_DENSE_RULE,), precision, device)
        assert "opfuse.ConvNHWC" in {n.op_type for n in graph.nodes}


def test_a_concat_left_as_a_copy_is_explained() -> None:
    """Two branches concatenated, `concat_select` off: the Concat is one copy kernel, and
    fusion.not_fused says why. With the rule on, the Tanh's kernel selects the Concat."""
    from tests.unit.test_fusion import check_against_ort

    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["x"], ["b"]),
        helper.make_node("Concat", ["a", "b"], ["c"], axis=1, name="branches"),
        helper.make_node("Tanh", ["c"], ["y"]),
    ]
    model = make_model(nodes, {"x": [2, 3, 4]}, {"y": [2, 6, 4]})
    cm = check_against_ort(model, {"x": [2, 3, 4]}, fusion_disable=("concat_select",))
    (entry,) = [n for n in cm.report["fusion"]["not_fused"] if any("branches" in x for x in n["nodes"])]
    assert entry["rule"] == "layout_views"
    assert "Concat of 2 inputs along axis 1 runs as a copy" in entry["reason"]
    assert cm.report["kernels"]["after"] == 4  # Relu, Sigmoid, the copy, Tanh
    cm = check_against_ort(model, {"x": [2, 3, 4]})
    assert cm.report["kernels"]["after"] == 3  # Relu, Sigmoid, the Concat and Tanh
    assert [n for n in cm.report["fusion"]["not_fused"] if any("branches" in x for x in n["nodes"])] == []
