"""The same small models written at opsets 7, 9, 11, 13, 18 and the newest onnx knows, compiled by
opfuse and compared with onnxruntime running them at their own opset (the ONNX reference evaluator
for opsets onnxruntime does not know yet). Each op is written in the form its opset has: attributes
that later became inputs (Pad, Clip, Squeeze, ReduceMean, Split, Slice, TopK, Dropout), Upsample
before Resize, Softmax and Hardmax before opset 13 flattening to 2-D.

Below those, one test per fix opfuse makes around onnx's version converter (opfuse/frontend/opsets.py).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import opfuse
from opfuse.frontend.opsets import convert_opset
from opfuse.frontend.static_values import check_static_shape_inputs

NEWEST = onnx.defs.onnx_opset_version()
OPSETS = [7, 9, 11, 13, 18, NEWEST]
ORT_NEWEST = 26  # the newest default-domain opset onnxruntime 1.31 runs
n = helper.make_node


class Builder:
    """Nodes and initializers of one model, each op written the way `opset` spells it."""

    def __init__(self, opset: int, seed: int = 0) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def const(self, value: np.ndarray | list[int] | list[float], dtype: type = np.int64) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, *shape: int, scale: float = 0.3) -> str:
        return self.const(self.rng.standard_normal(shape) * scale, np.float32)

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs: object) -> list[str]:
        outs = [f"v{self.count}_{i}" for i in range(n_out)]
        self.count += 1
        self.nodes.append(n(op_type, inputs, outs, name=f"{op_type.lower()}{self.count}", **attrs))
        return outs

    def one(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        return self.op(op_type, inputs, **attrs)[0]

    # Ops whose spelling changed with the opset.
    def pad(self, x: str, pads: list[int], mode: str) -> str:
        if self.opset < 11:
            return self.one("Pad", [x], pads=pads, mode=mode)
        return self.one("Pad", [x, self.const(pads)], mode=mode)

    def clip(self, x: str, lo: float, hi: float) -> str:
        if self.opset < 11:
            return self.one("Clip", [x], min=lo, max=hi)
        return self.one("Clip", [x, self.const(lo, np.float32), self.const(hi, np.float32)])

    def upsample2x(self, x: str, mode: str) -> str:
        scales = [1.0, 1.0, 2.0, 2.0]
        if self.opset < 9:
            return self.one("Upsample", [x], scales=scales, mode=mode)
        if self.opset < 10:
            return self.one("Upsample", [x, self.const(scales, np.float32)], mode=mode)
        if self.opset < 11:
            return self.one("Resize", [x, self.const(scales, np.float32)], mode=mode)
        # What exporters write at 11+ for torch's nn.Upsample(scale_factor=2).
        attrs = {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
        if mode == "linear":
            attrs = {"coordinate_transformation_mode": "half_pixel"}
        # roi is a required input until opset 13, unused (empty) outside tf_crop_and_resize.
        roi = self.const([], np.float32) if self.opset < 13 else ""
        return self.one("Resize", [x, roi, self.const(scales, np.float32)], mode=mode, **attrs)

    def reduce_mean(self, x: str, axes: list[int], keepdims: int) -> str:
        if self.opset < 18:
            return self.one("ReduceMean", [x], axes=axes, keepdims=keepdims)
        return self.one("ReduceMean", [x, self.const(axes)], keepdims=keepdims)

    def squeeze(self, op_type: str, x: str, axes: list[int]) -> str:
        if self.opset < 13:
            return self.one(op_type, [x], axes=axes)
        return self.one(op_type, [x, self.const(axes)])

    def split(self, x: str, axis: int, sizes: list[int] | None, parts: int) -> list[str]:
        if sizes is None and self.opset >= 18:
            return self.op("Split", [x], parts, axis=axis, num_outputs=parts)
        if sizes is None:
            return self.op("Split", [x], parts, axis=axis)
        if self.opset < 13:
            return self.op("Split", [x], len(sizes), axis=axis, split=sizes)
        return self.op("Split", [x, self.const(sizes)], len(sizes), axis=axis)

    def slice(self, x: str, starts: list[int], ends: list[int], axes: list[int]) -> str:
        if self.opset < 10:
            return self.one("Slice", [x], starts=starts, ends=ends, axes=axes)
        return self.one("Slice", [x, self.const(starts), self.const(ends), self.const(axes)])

    def top_k(self, x: str, k: int, axis: int) -> list[str]:
        if self.opset < 10:
            return self.op("TopK", [x], 2, k=k, axis=axis)
        return self.op("TopK", [x, self.const([k])], 2, axis=axis)

    def dropout(self, x: str) -> str:
        if self.opset < 12:
            return self.one("Dropout", [x], ratio=0.3)
        return self.one("Dropout", [x, self.const(0.3, np.float32)])

    def model(self, inputs: dict[str, list[int]], outputs: dict[str, list[int]]) -> onnx.ModelProto:
        """The model at the oldest IR version its opset allows; before IR 4 that means listing every
        initializer as a graph input too, as old exporters did."""
        opsets = [helper.make_opsetid("", self.opset)]
        ir_version = helper.find_min_ir_version_for(opsets)
        graph_inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()]
        if ir_version < 4:
            graph_inputs += [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in self.inits]
        graph = helper.make_graph(
            self.nodes,
            f"opset{self.opset}",
            graph_inputs,
            [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in outputs.items()],
            initializer=self.inits,
        )
        m = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
        onnx.checker.check_model(m)
        return m


def small_cnn(opset: int) -> onnx.ModelProto:
    """Conv/BN/ReLU/MaxPool, reflect Pad, Clip, 2x nearest upsampling, LRN, a reduction, legacy-axis
    Softmax, Squeeze/Unsqueeze, Split/Slice/Concat, Flatten and Gemm."""
    b = Builder(opset)
    x = b.one("Conv", ["x", b.weight(4, 3, 3, 3), b.weight(4)], pads=[1, 1, 1, 1])
    bn = [b.const(1 + 0.1 * b.rng.standard_normal(4), np.float32) for _ in range(2)]
    x = b.one("BatchNormalization", [x, bn[0], b.weight(4), b.weight(4), bn[1]], epsilon=1e-3)
    x = b.one("Relu", [x])
    x = b.one("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])  # 4x4
    x = b.pad(x, [0, 0, 1, 1, 0, 0, 1, 1], "reflect")  # 6x6
    x = b.clip(x, -0.4, 1.5)
    x = b.upsample2x(x, "nearest")  # 12x12
    x = b.one("LRN", [x], size=3)
    m = b.reduce_mean(x, [2], 0)  # (N, 4, 12)
    s = b.one("Softmax", [m], axis=1)  # before 13: over 4 * 12 values; from 13: over the 4
    h = b.one("Hardmax", [b.one("Add", [s, m])], axis=1)
    u = b.squeeze("Squeeze", b.squeeze("Unsqueeze", b.one("Add", [s, h]), [1]), [1])
    p1, p2 = b.split(u, 2, [5, 7], 2)
    q = b.slice(p2, [1], [6], [2])  # 5 wide
    c = b.one("Concat", [p1, q], axis=1)  # (N, 8, 5)
    f = b.one("Flatten", [c], axis=1)
    y = b.one("Gemm", [f, b.weight(40, 6), b.weight(6)])
    return b.model({"x": [2, 3, 8, 8]}, {y: [2, 6]})


def small_transformer(opset: int) -> onnx.ModelProto:
    """LayerNorm written out, Q/K/V from one MatMul and a Split, attention with a legacy-axis Softmax
    over the last axis of 2-D scores, sigmoid GELU, TopK, Dropout and upsampling by linear Resize."""
    b = Builder(opset, seed=1)
    d = 8
    mu = b.reduce_mean("x", [-1], 1)
    diff = b.one("Sub", ["x", mu])
    var = b.reduce_mean(b.one("Mul", [diff, diff]), [-1], 1)
    ln = b.one("Div", [diff, b.one("Sqrt", [b.one("Add", [var, b.const(1e-5, np.float32)])])])
    qkv = b.one("MatMul", [ln, b.weight(d, 3 * d)])  # (5, 24): one sequence, 2-D
    q, k, v = b.split(qkv, 1, None, 3)
    scores = b.one("MatMul", [q, b.one("Transpose", [k], perm=[1, 0])])
    att = b.one("Softmax", [b.one("Mul", [scores, b.const(d**-0.5, np.float32)])], axis=1)
    ctx = b.one("MatMul", [att, v])
    h = b.one("MatMul", [ctx, b.weight(d, 16)])
    g = b.one("Mul", [h, b.one("Sigmoid", [b.one("Mul", [h, b.const(1.702, np.float32)])])])  # GELU
    out = b.dropout(b.one("Add", [b.one("MatMul", [g, b.weight(16, d)]), "x"]))
    values, _ = b.top_k(out, 3, 1)
    img = b.squeeze("Unsqueeze", values, [0, 1])  # (1, 1, 5, 3)
    up = b.upsample2x(img, "linear")
    return b.model({"x": [5, d]}, {out: [5, d], up: [1, 1, 10, 6]})


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    if model.opset_import[0].version > ORT_NEWEST:
        return [np.asarray(v) for v in ReferenceEvaluator(model).run(None, feeds)]
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, feeds)]


def _assert_matches(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    want = _reference(model, feeds)
    cm = opfuse.compile(model, device="cpu", verify=False)
    got = cm.run(feeds)
    for vi, w in zip(model.graph.output, want, strict=True):
        g = np.asarray(got[vi.name])
        assert g.shape == w.shape, vi.name
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-12)
        assert err <= 1e-4, f"{vi.name}: relative L2 error {err:.2e}"


@pytest.mark.parametrize("opset", OPSETS)
def test_small_cnn_at_every_opset(opset: int) -> None:
    rng = np.random.default_rng(opset)
    _assert_matches(small_cnn(opset), {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)})


@pytest.mark.parametrize("opset", OPSETS)
def test_small_transformer_at_every_opset(opset: int) -> None:
    rng = np.random.default_rng(opset)
    _assert_matches(small_transformer(opset), {"x": rng.standard_normal((5, 8)).astype(np.float32)})


def test_models_really_differ_across_opsets() -> None:
    # The legacy Softmax flattens to 2-D: the same nodes mean something else before opset 13, so a
    # frontend that ignored the opset could not pass both tests above.
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}
    assert not np.allclose(_reference(small_cnn(11), feeds)[0], _reference(small_cnn(13), feeds)[0])


# --- the fixes around onnx's version converter ----------------------------------------------------


def _single(
    op_type: str,
    opset: int,
    shape: list[int],
    inputs: list[str] | None = None,
    inits: dict[str, np.ndarray] | None = None,
    out_shape: list[int] | None = None,
    **attrs: object,
) -> onnx.ModelProto:
    """One node reading x (and initializers), at the given opset; y has x's shape unless given."""
    b = Builder(opset)
    b.nodes.append(n(op_type, ["x", *(inputs or [])], ["y"], **attrs))
    b.inits = [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()]
    return b.model({"x": shape}, {"y": out_shape or shape})


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax", "Hardmax"])
def test_flatten_legacy_softmax(op_type: str) -> None:
    # onnx's converter leaves Hardmax as it is (wrong from opset 13 on); opfuse rewrites all three.
    m = _single(op_type, 11, [2, 3, 4], axis=1)
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    _assert_matches(m, {"x": x})
    converted = convert_opset(m)
    assert [nd.op_type for nd in converted.graph.node] == ["Shape", "Flatten", op_type, "Reshape"]


def test_legacy_softmax_on_the_last_axis_is_left_alone() -> None:
    converted = convert_opset(_single("Softmax", 11, [2, 3, 4], axis=2))
    assert [nd.op_type for nd in converted.graph.node] == ["Softmax"]


def test_expand_spatial0_batchnorm() -> None:
    # Per-element statistics (spatial=0): onnx's converter drops the attribute, changing the meaning.
    rng = np.random.default_rng(2)
    stats = {k: (rng.random((3, 4)) + 0.5).astype(np.float32) for k in ["s", "b", "m", "v"]}
    m = _single("BatchNormalization", 7, [2, 3, 4], ["s", "b", "m", "v"], stats, spatial=0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    want = (x - stats["m"]) / np.sqrt(stats["v"] + 1e-5) * stats["s"] + stats["b"]
    np.testing.assert_allclose(_reference(m, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    _assert_matches(m, {"x": x})


@pytest.mark.parametrize(
    ("opset", "mode", "scales"),
    [
        (7, "linear", [1.0, 1.0, 2.0, 1.5]),
        (9, "nearest", [1.0, 1.0, 1.7, 2.6]),
        (9, "linear", [1.0, 1.0, 2.0, 2.0]),
        (10, "nearest", [1.0, 1.0, 0.6, 0.5]),
        (10, "linear", [1.0, 1.0, 1.5, 0.7]),
    ],
)
def test_legacy_resize_modes(opset: int, mode: str, scales: list[float]) -> None:
    # Upsample and Resize-10 map coordinates asymmetrically; onnx's converter writes a Resize with the
    # default half_pixel mapping, which would shift every pixel.
    sc = np.array(scales, dtype=np.float32)
    out = [int(np.floor(d * f)) for d, f in zip([1, 2, 5, 6], sc.astype(np.float64), strict=True)]
    if opset < 9:
        m = _single("Upsample", opset, [1, 2, 5, 6], out_shape=out, mode=mode, scales=scales)
    else:
        op_type = "Upsample" if opset == 9 else "Resize"
        m = _single(op_type, opset, [1, 2, 5, 6], ["s"], {"s": sc}, out_shape=out, mode=mode)
    x = np.random.default_rng(3).standard_normal((1, 2, 5, 6)).astype(np.float32)
    _assert_matches(m, {"x": x})


def test_legacy_nearest_resize_that_grows_and_shrinks_is_refused() -> None:
    sc = np.array([1.0, 1.0, 0.5, 2.0], dtype=np.float32)
    m = _single("Resize", 10, [1, 2, 4, 4], ["s"], {"s": sc}, out_shape=[1, 2, 2, 8], mode="nearest")
    with pytest.raises(opfuse.ModelError, match="re-export the model at opset 11"):
        opfuse.compile(m, device="cpu", verify=False)


def test_explicit_mvn_axes() -> None:
    # ONNX shape inference fails on MeanVarianceNormalization's function body when `axes` is left
    # to its default; opfuse writes the default out.
    m = _single("MeanVarianceNormalization", 13, [2, 3, 4, 5])
    x = np.random.default_rng(4).standard_normal((2, 3, 4, 5)).astype(np.float32)
    _assert_matches(m, {"x": x})


def test_old_models_keep_shape_inputs_static_after_conversion() -> None:
    # Attributes that became inputs (here Pad's pads) are constants after conversion, so the
    # static-shape check has nothing to refuse.
    m = convert_opset(_single("Pad", 7, [2, 3], out_shape=[2, 6], pads=[0, 1, 0, 2]))
    check_static_shape_inputs(m)
