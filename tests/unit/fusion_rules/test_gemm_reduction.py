"""`gemm_reduction` (opfuse/fusion/rules/gemm_reduction.py): a transformer layer's Linear computed
on the tiles of the row kernel that adds its bias and the residual and normalizes the row."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

import opfuse
from opfuse.frontend import rule_registry as names
from tests.builders import TEST_DEVICE, assert_every_config, claimed, planned, refusals, tiny_model, weights

n = helper.make_node
RULE = f"{names.ROW_REDUCTION}+{names.GEMM_REDUCTION}"


def linear_norm(
    rows: tuple[int, ...] = (2, 5),
    k: int = 24,
    cols: int = 48,
    pre_norm: bool = False,
    read_outside: bool = False,
    gemm: bool = False,
) -> onnx.ModelProto:
    """y = LayerNorm(x @ w + b + r) (post-norm, BERT); `pre_norm`: the sum is an output too, the
    residual stream beside its norm (GPT-2). `read_outside`: the product is an output as well.
    `gemm`: a Gemm with transB (w stored [cols, k]) on 2-D rows, as the TorchScript exporter
    writes a Linear."""
    shape = [*rows, cols]
    if gemm:
        mm = n("Gemm", ["x", "wt"], ["h"], name="fc", transB=1)
    else:
        mm = n("MatMul", ["x", "w"], ["h"], name="fc")
    nodes = [
        mm,
        n("Add", ["h", "b"], ["hb"], name="bias"),
        n("Add", ["hb", "r"], ["s"], name="residual"),
        n("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
    ]
    outputs = {"y": shape}
    if pre_norm:
        outputs["s"] = shape
    if read_outside:
        outputs["h"] = shape
    w = weights(k, cols, seed=1)
    inits = {
        "wt" if gemm else "w": np.ascontiguousarray(w.T) if gemm else w,
        "b": weights(cols, seed=2),
        "gamma": 1.0 + weights(cols, seed=3),
        "beta": weights(cols, seed=4),
    }
    return tiny_model(nodes, {"x": [*rows, k], "r": shape}, outputs, inits)


def test_the_gemm_is_computed_on_the_row_kernels_tiles() -> None:
    _, plan = planned(linear_norm())
    assert [c for c in claimed(plan) if c[0] == "rowwise"] == [
        ("rowwise", RULE, ["fc", "bias", "residual", "ln"])
    ]
    assert plan.lone == []  # the lone GEMM is the row group's prologue now


def test_a_product_read_outside_the_row_kernel_is_stored_by_it() -> None:
    _, plan = planned(linear_norm(read_outside=True))
    (row,) = [g for g in plan.groups if g.kind == "rowwise"]
    assert row.rule == RULE and [x.name for x in row.prologue] == ["fc"]
    assert "h" in row.outputs and plan.lone == []


def test_a_row_longer_than_a_tile_is_refused() -> None:
    _, plan = planned(linear_norm(rows=(4,), k=8, cols=2048))
    assert refusals(plan, names.GEMM_REDUCTION) == [
        (["fc", "ln"], "a row of 2048 columns is longer than one tile of the row kernel holds (1024)")
    ]


def test_a_reduction_over_other_axes_is_refused() -> None:
    """A LayerNorm over the last two axes of [2, 3, 4, 16] reduces over the product's columns and
    some of its rows: neither a row of it, the rows of one item, nor a whole item."""
    nodes = [
        n("MatMul", ["x", "w"], ["h"], name="fc"),
        n("LayerNormalization", ["h", "gamma"], ["y"], name="ln", axis=2),
    ]
    inits = {"w": weights(8, 16), "gamma": 1.0 + weights(4, 16, seed=1)}
    model = tiny_model(nodes, {"x": [2, 3, 4, 8]}, {"y": [2, 3, 4, 16]}, inits)
    _, plan = planned(model)
    assert refusals(plan, names.GEMM_REDUCTION) == [
        (
            ["fc", "ln"],
            "the row kernel does not reduce over the GEMM's output columns alone, nor over its rows of one item",
        )
    ]


def test_switched_off_the_gemm_runs_on_its_own() -> None:
    _, plan = planned(linear_norm(), disabled=(names.GEMM_REDUCTION,))
    assert ("rowwise", names.ROW_REDUCTION, ["bias", "residual", "ln"]) in claimed(plan)
    assert [g.nodes[0].name for g in plan.lone] == ["fc"]


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def _compiled(model: onnx.ModelProto, shapes: dict[str, list[int]], precision: str) -> Any:
    """The compiled model, untuned: on the GPU tuning times the one kernel against its split form
    and may keep either, and these tests assert the one kernel (at each tuning candidate's config
    themselves, `_every_config`). In fp32 on the GPU a region of dense convs stays NCHW
    (`fp32_dense_nchw`), where no conv is an NHWC implicit GEMM: off, the conv forms run there
    as on the CPU."""
    return opfuse.compile(
        model,
        input_shapes=shapes,
        precision=precision,
        device=TEST_DEVICE,
        tune_budget_s=0,
        fusion_disable=(names.FP32_DENSE_NCHW,),
    )


def _every_config(cm: Any, model: onnx.ModelProto, shapes: dict[str, list[int]], precision: str) -> int:
    """The compiled plan with its row kernel at its own config and at each tuning candidate (fresh
    random inputs each time, outputs poisoned by the suite): every element of every output against
    onnxruntime. Returns the row kernel's launches per run."""
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "rowwise"]
    assert "tl.dot(" in k.source and "BLOCK_K" in k.config
    assert_every_config(cm, model, k, shapes, precision, seed=11)
    return sum(1 for s in cm.plan.steps if s.kind == "kernel")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    "form",
    [
        {},  # post-norm, rows (2, 5) at K 24, N 48: neither a multiple of a tile
        {"pre_norm": True},  # the residual stream stored beside its norm
        {"gemm": True, "rows": (7,)},  # Gemm with transB on 2-D rows
        {"rows": (3, 40), "k": 40, "cols": 64},  # more rows than one program's tile
        {"read_outside": True},  # the product stored by the row kernel too
    ],
)
def test_it_computes_what_onnxruntime_does(form: dict[str, Any], precision: str) -> None:
    model = linear_norm(**form)
    rows = tuple(form.get("rows", (2, 5)))
    shapes = {"x": [*rows, form.get("k", 24)], "r": [*rows, form.get("cols", 48)]}
    cm = _compiled(model, shapes, precision)
    assert cm.report["verification"]["passed"] is True
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert g["rule"] == RULE and g["nodes"][0] == "fc"
    assert _every_config(cm, model, shapes, precision) == 1  # one launch for the whole layer end


def _split_form_computes_the_same(model: onnx.ModelProto, shapes: dict[str, list[int]], anchor: str) -> None:
    """What tuning measures against the one kernel: the library's `anchor`, then the row kernel
    (reading the anchor's output through the folded layout ops, where it did)."""
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor

    p = plan_model(model, shapes, "fp32")
    (g,) = [g for g in p.fusion.groups if g.kind == "rowwise" and g.prologue]
    split = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    mine = [(s.kind, s.op_type) for s in split.steps if s.group == g.id]
    assert mine == [("op", anchor), ("kernel", "")]
    rng = np.random.default_rng(5)
    feeds = {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}
    want = _ort(model, feeds)
    for plan in (p.plan, split):
        got = Executor(plan, TEST_DEVICE).run(feeds)
        for name, w in want.items():
            np.testing.assert_allclose(np.asarray(got[name]), w, rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_split_form_computes_the_same() -> None:
    _split_form_computes_the_same(linear_norm(pre_norm=True), {"x": [2, 5, 24], "r": [2, 5, 48]}, "MatMul")


def parallel_residual(rows: tuple[int, ...] = (2, 5), d: int = 32, hidden: int = 64) -> onnx.ModelProto:
    """GPT-NeoX's layer end: y = LayerNorm(x + a @ wo + gelu(u) @ w2), both products read only by
    the row kernel; `u` is the MLP's half of a merged projection (a Split of p), so gelu reads a
    view."""
    nodes = [
        n("MatMul", ["h", "wp"], ["p"], name="proj"),
        n("Split", ["p", "parts"], ["q", "u"], name="split", axis=-1),
        n("Gelu", ["u"], ["g"], name="gelu"),
        n("MatMul", ["g", "w2"], ["mlp"], name="down"),
        n("Relu", ["q"], ["a"], name="act"),
        n("MatMul", ["a", "wo"], ["attn"], name="out"),
        n("Add", ["x", "attn"], ["s1"], name="add_attn"),
        n("Add", ["s1", "mlp"], ["s"], name="add_mlp"),
        n("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
    ]
    inits = {
        "wp": weights(d, d + hidden, seed=1),
        "parts": np.array([d, hidden], dtype=np.int64),
        "w2": weights(hidden, d, seed=2),
        "wo": weights(d, d, seed=3),
        "gamma": 1.0 + weights(d, seed=4),
        "beta": weights(d, seed=5),
    }
    return tiny_model(nodes, {"x": [*rows, d], "h": [*rows, d]}, {"y": [*rows, d]}, inits, opset=20)


def test_the_gemm_a_row_kernel_leaves_computes_its_operand() -> None:
    """One GEMM per row kernel: the other one, left lone, computes gelu on its A tiles (read
    through the Split) instead of a Gelu kernel writing A; both match onnxruntime."""
    model = parallel_residual()
    shapes = {"x": [2, 5, 32], "h": [2, 5, 32]}
    cm = _compiled(model, shapes, "fp32")
    groups = cm.report["fusion"]["groups"]
    (row,) = [g for g in groups if g["kind"] == "rowwise"]
    assert row["rule"].startswith(RULE)
    (down,) = [g for g in groups if "down" in g["nodes"]]
    assert down["rule"].endswith(names.OPERAND_PROLOGUE) and down["nodes"][:2] == ["gelu", "down"]
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type == "Gelu"]
    rng = np.random.default_rng(3)
    for _ in range(2):
        feeds = {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}
        got = cm.run(feeds)
        np.testing.assert_allclose(np.asarray(got["y"]), _ort(model, feeds)["y"], rtol=1e-4, atol=1e-4)


def test_switched_off_the_left_gemm_keeps_its_gelu_kernel() -> None:
    _graph, plan = planned(parallel_residual(), disabled=(names.OPERAND_PROLOGUE,))
    assert "down" in [g.nodes[0].name for g in plan.lone]


# A dense conv is the same GEMM, implicit: the patch embedding (or spatial-reduction conv) before a
# LayerNorm over its channels, as PVT, SegFormer, ConvNeXt's stem and wav2vec2-style feature
# encoders write it.


def conv_norm(
    channels: int = 5,
    out_channels: int = 24,
    size: tuple[int, int] = (9, 11),
    kernel: tuple[int, int] = (3, 3),
    stride: int = 2,
    pad: int = 1,
    images: int = 2,
    layout: str = "tokens",
    group: int = 1,
    read_outside: bool = False,
) -> tuple[onnx.ModelProto, dict[str, list[int]]]:
    """y = LayerNorm over the channels of Conv(x) + bias, the conv's output reached as the model
    writes it. `layout`: "tokens" (`flatten(2).transpose(1, 2)`: [N, H*W, C], PVT and SegFormer),
    "nhwc" (`permute(0, 2, 3, 1)`, ConvNeXt's stem) or "1d" (a Conv1d over [N, C, L] and
    `transpose(1, 2)`, a speech feature encoder). `read_outside`: the conv's output is an output
    too."""
    one_d = layout == "1d"
    spatial = [size[1]] if one_d else list(size)
    kshape = [kernel[1]] if one_d else list(kernel)
    out = [(s + 2 * pad - k) // stride + 1 for s, k in zip(spatial, kshape, strict=True)]
    conv = n(
        "Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=kshape, strides=[stride] * len(kshape),
        pads=[pad] * (2 * len(kshape)), group=group,
    )  # fmt: skip
    if layout == "tokens":
        layout_ops = [
            n("Reshape", ["c", "flat"], ["cf"], name="flatten"),
            n("Transpose", ["cf"], ["t"], name="tokens", perm=[0, 2, 1]),
        ]
        shape = [images, out[0] * out[1], out_channels]
    elif layout == "nhwc":
        layout_ops = [n("Transpose", ["c"], ["t"], name="tokens", perm=[0, 2, 3, 1])]
        shape = [images, *out, out_channels]
    else:
        layout_ops = [n("Transpose", ["c"], ["t"], name="tokens", perm=[0, 2, 1])]
        shape = [images, out[0], out_channels]
    nodes = [
        conv,
        *layout_ops,
        n("LayerNormalization", ["t", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
    ]
    inits = {
        "w": weights(out_channels, channels // group, *kshape, seed=1),
        "b": weights(out_channels, seed=2),
        "gamma": 1.0 + weights(out_channels, seed=3),
        "beta": weights(out_channels, seed=4),
    }
    if layout == "tokens":
        inits["flat"] = np.array([images, out_channels, -1], dtype=np.int64)
    outputs = {"y": shape}
    if read_outside:
        outputs["c"] = [images, out_channels, *out]
    shapes = {"x": [images, channels, *spatial]}
    return tiny_model(nodes, shapes, outputs, inits), shapes


def test_a_conv_is_computed_on_the_row_kernels_tiles() -> None:
    """The conv's output reaches the norm through layout ops that read it in its own order (NHWC
    as [N, H*W, C]): the conv joins the row kernel, the layout ops with it."""
    for layout in ("tokens", "nhwc", "1d"):
        model, _ = conv_norm(layout=layout)
        _, plan = planned(model)
        (row,) = [g for g in plan.groups if g.kind == "rowwise"]
        assert row.rule == RULE and [x.name for x in row.prologue] == ["conv"], layout
        assert plan.lone == [], layout


def test_a_conv_of_many_groups_or_one_read_outside_is_not_taken() -> None:
    model, _ = conv_norm(group=32, channels=32, out_channels=64)
    _, plan = planned(model)
    assert [g.nodes[0].name for g in plan.lone] == ["conv"]  # 32 groups: the library's conv
    model, _ = conv_norm(read_outside=True)
    _, plan = planned(model)
    assert [g.nodes[0].name for g in plan.lone] == ["conv"]
    assert all(names.GEMM_REDUCTION not in rule for _, rule, _ in claimed(plan))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    "form",
    [
        {},  # 3x3 stride 2 pad 1 over [N, H*W, C] tokens: K 45, taps across the image edge
        {"layout": "nhwc", "kernel": (4, 4), "stride": 4, "pad": 0, "size": (16, 12)},  # a stem
        {"layout": "1d", "kernel": (1, 3), "stride": 2, "pad": 0, "size": (1, 29), "channels": 16},
        {"kernel": (1, 1), "stride": 1, "pad": 0, "channels": 40},  # 1x1: the NHWC buffer as A
        {"kernel": (7, 7), "stride": 4, "pad": 3, "size": (23, 19), "images": 3},  # SegFormer's first
        # A grouped Conv1d (a speech encoder's positional conv): the block-diagonal weight
        {"layout": "1d", "kernel": (1, 5), "stride": 1, "pad": 2, "size": (1, 21), "channels": 8, "group": 4},
    ],
)
def test_the_conv_form_computes_what_onnxruntime_does(form: dict[str, Any], precision: str) -> None:
    model, shapes = conv_norm(**form)
    cm = _compiled(model, shapes, precision)
    assert cm.report["verification"]["passed"] is True
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert g["rule"] == RULE and g["nodes"][0] == "conv"
    assert _every_config(cm, model, shapes, precision) == 1  # the conv and its norm: one launch


def test_the_conv_forms_split_form_computes_the_same() -> None:
    _split_form_computes_the_same(*conv_norm(), "opfuse.ConvNHWC")


def reshaped_linear_norm(gelu: bool = False) -> tuple[onnx.ModelProto, dict[str, list[int]]]:
    """A Linear on the tokens flattened to 2-D ([B*S, K] @ W), its product reshaped back to
    [B, S, N] before the residual add and the norm (torchvision's ViT writes its MLP so); `gelu`:
    a GELU computes the Linear's input."""
    rows, k, cols = (3, 7), 24, 40
    nodes = [
        *([n("Gelu", ["x"], ["a"], name="gelu")] if gelu else []),
        n("MatMul", ["a" if gelu else "x", "w"], ["h"], name="fc"),
        n("Reshape", ["h", "shape"], ["h3"], name="unflatten"),
        n("Add", ["h3", "r"], ["s"], name="residual"),
        n("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
    ]
    inits = {
        "w": weights(k, cols, seed=1),
        "shape": np.array([*rows, cols], dtype=np.int64),
        "gamma": 1.0 + weights(cols, seed=3),
        "beta": weights(cols, seed=4),
    }
    shapes = {"x": [rows[0] * rows[1], k], "r": [*rows, cols]}
    return tiny_model(nodes, shapes, {"y": [*rows, cols]}, inits, opset=20), shapes


def test_a_product_read_through_a_reshape_is_computed_on_the_tiles() -> None:
    """The reshape reads the product in order, so the row kernel computes the product on its
    tiles."""
    model, shapes = reshaped_linear_norm()
    _, plan = planned(model)
    (row,) = [g for g in plan.groups if g.kind == "rowwise"]
    assert row.rule == RULE and [x.name for x in row.prologue] == ["fc"] and plan.lone == []
    cm = _compiled(model, shapes, "fp32")
    assert cm.report["verification"]["passed"] is True
    assert _every_config(cm, model, shapes, "fp32") == 1


def test_a_concat_in_the_operand_prologue_is_not_also_a_convs_epilogue() -> None:
    """MambaOut's gated block: fc2(silu(g) * cat(i, dwconv(c))) + x, then a LayerNorm. The row
    kernel computes fc2 on its tiles and its A through the Concat, reading the conv's output in
    place; `concat_epilogue` must not also give the Concat to the conv (which would then write
    only the Concat's output, never its own, and the row kernel's first run raised KeyError)."""
    d, hidden = 16, 32
    nodes = [
        n("MatMul", ["x", "w1"], ["h"], name="fc1"),
        n("Split", ["h", "parts"], ["g", "i", "c"], name="split", axis=-1),
        n("Transpose", ["c"], ["cn"], name="to_nchw", perm=[0, 3, 1, 2]),
        n("Conv", ["cn", "wdw", "bdw"], ["cc"], name="dwconv", group=d, pads=[1, 1, 1, 1]),
        n("Transpose", ["cc"], ["ct"], name="to_nhwc", perm=[0, 2, 3, 1]),
        n("Concat", ["i", "ct"], ["cat"], name="cat", axis=-1),
        n("Sigmoid", ["g"], ["sg"], name="sigmoid"),
        n("Mul", ["g", "sg"], ["silu"], name="silu"),
        n("Mul", ["silu", "cat"], ["a"], name="gate"),
        n("MatMul", ["a", "w2"], ["p"], name="fc2"),
        n("Add", ["p", "x"], ["s"], name="residual"),
        n("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
    ]
    inits = {
        "w1": weights(d, hidden + 2 * d, seed=1),
        "parts": np.array([hidden, d, d], dtype=np.int64),
        "wdw": weights(d, 1, 3, 3, seed=2),
        "bdw": weights(d, seed=3),
        "w2": weights(hidden, d, seed=4),
        "gamma": 1.0 + weights(d, seed=5),
        "beta": weights(d, seed=6),
    }
    shapes = {"x": [2, 6, 5, d]}
    model = tiny_model(nodes, shapes, {"y": [2, 6, 5, d]}, inits)
    cm = _compiled(model, shapes, "fp32")
    report = cm.report
    assert not [x for x in report["fusion"]["not_fused"] if "raised" in x["reason"]]
    assert report["verification"]["passed"] is True and not report["verification"]["rolled_back"]
    (row,) = [g for g in report["fusion"]["groups"] if g["kind"] == "rowwise" and "fc2" in g["nodes"]]
    assert row["rule"] == f"{RULE}+{names.OPERAND_PROLOGUE}" and "cat" in row["nodes"]
    assert all("cat" not in g["nodes"] for g in report["fusion"]["groups"] if g is not row)
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal(shapes["x"]).astype(np.float32)}
    np.testing.assert_allclose(np.asarray(cm.run(feeds)["y"]), _ort(model, feeds)["y"], rtol=1e-4, atol=1e-4)


def test_a_product_read_through_a_reshape_with_its_operand_computed() -> None:
    """The same, A computed on the tiles too (`operand_prologue`): the reshaped product is still no
    input of the row kernel (the group's boundary is taken again once the prologue joins)."""
    model, shapes = reshaped_linear_norm(gelu=True)
    _, plan = planned(model)
    (row,) = [g for g in plan.groups if g.kind == "rowwise"]
    assert [x.name for x in row.prologue] == ["gelu", "fc"] and "h3" not in row.inputs
    cm = _compiled(model, shapes, "fp32")
    assert not [x for x in cm.report["fusion"]["not_fused"] if "raised" in x["reason"]]
    assert _every_config(cm, model, shapes, "fp32") == 1


# A reduction over the product's rows of one item (an image's pixels, a sequence's tokens): the
# strided row kernel's tile is that item's R rows by BLOCK_I columns of the product, so the GEMM
# (or conv) and the reduction are one launch, the product stored only where others read it.


def pooled_product(form: str, items: int = 2) -> tuple[onnx.ModelProto, dict[str, list[int]]]:
    """`form` "grn": g = Gelu(x @ w + b) on NHWC [N, 4, 5, 24] -> 40 and s = ReduceL2(g) over the
    pixels (ConvNeXt V2's global response norm), both outputs; "eca": y = c * Sigmoid(mean(c))
    with c = Conv3x3(x) + bias (efficient channel attention's pooling, the conv's output read by
    the Mul too); "tokens": the mean over a sequence of x @ w, [N, 7, 16] -> 20; "gated": the
    same of silu(x) @ w."""
    if form == "grn":
        nodes = [
            n("MatMul", ["x", "w"], ["h"], name="fc"),
            n("Add", ["h", "b"], ["hb"], name="bias"),
            n("Gelu", ["hb"], ["g"], name="gelu"),
            n("ReduceL2", ["g", "axes"], ["s"], name="l2", keepdims=1),
        ]
        inits = {"w": weights(24, 40, seed=1), "b": weights(40, seed=2), "axes": np.array([1, 2])}
        shapes = {"x": [items, 4, 5, 24]}
        return tiny_model(
            nodes, shapes, {"g": [items, 4, 5, 40], "s": [items, 1, 1, 40]}, inits, opset=20
        ), shapes
    if form == "eca":
        nodes = [
            n("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            n("ReduceMean", ["c", "axes"], ["m"], name="mean", keepdims=1),
            n("Sigmoid", ["m"], ["a"], name="gate"),
            n("Mul", ["c", "a"], ["y"], name="scale"),
        ]
        inits = {"w": weights(24, 6, 3, 3, seed=1), "b": weights(24, seed=2), "axes": np.array([2, 3])}
        shapes = {"x": [items, 6, 7, 9]}
        return tiny_model(nodes, shapes, {"y": [items, 24, 7, 9]}, inits, opset=18), shapes
    nodes = [
        n("MatMul", ["x", "w"], ["h"], name="fc"),
        n("ReduceMean", ["h", "axes"], ["s"], name="mean", keepdims=0),
    ]
    if form == "gated":  # A computed on the tiles too: x * sigmoid(x) (operand_prologue)
        nodes = [n("Sigmoid", ["x"], ["g"], name="gate"), n("Mul", ["x", "g"], ["a"], name="silu"), *nodes]
        nodes[2] = n("MatMul", ["a", "w"], ["h"], name="fc")
    shapes = {"x": [items, 7, 16]}
    inits = {"w": weights(16, 20, seed=1), "axes": np.array([1])}
    return tiny_model(nodes, shapes, {"s": [items, 20]}, inits, opset=18), shapes


@pytest.mark.parametrize("form", ["grn", "eca", "tokens", "gated"])
def test_a_gemm_before_a_reduction_over_its_rows_is_computed_on_the_strided_tiles(form: str) -> None:
    model, _ = pooled_product(form)
    _, plan = planned(model)
    (row,) = [g for g in plan.groups if g.kind == "rowwise"]
    anchor = ["conv"] if form == "eca" else ["gate", "silu", "fc"] if form == "gated" else ["fc"]
    assert row.rule.startswith(RULE) and [x.name for x in row.prologue] == anchor
    assert plan.lone == []


def test_a_mean_a_gemm_reads_is_left_to_pooled_gemm() -> None:
    """A classifier's head: the conv before the mean stays a conv, and the head's GEMM computes
    the mean on its tiles (pooled_gemm); switched off, the conv joins the mean's row kernel."""
    nodes = [
        n("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        n("ReduceMean", ["c", "axes"], ["m"], name="mean", keepdims=1),
        n("Flatten", ["m"], ["f"], name="flat"),
        n("Gemm", ["f", "wh"], ["y"], name="head", transB=1),
    ]
    inits = {
        "w": weights(24, 6, 3, 3),
        "b": weights(24, seed=1),
        "axes": np.array([2, 3]),
        "wh": weights(10, 24, seed=2),
    }
    model = tiny_model(nodes, {"x": [2, 6, 7, 9]}, {"y": [2, 10]}, inits, opset=18)
    _, plan = planned(model)
    assert refusals(plan, names.GEMM_REDUCTION) == [
        (
            ["conv", "mean"],
            "a GEMM reads the mean: pooled_gemm computes the mean on that GEMM's tiles instead",
        )
    ]
    assert any(names.POOLED_GEMM in rule for _, rule, _ in claimed(plan))
    _, plan = planned(model, disabled=(names.POOLED_GEMM,))
    (row,) = [g for g in plan.groups if g.kind == "rowwise"]
    assert row.rule == RULE and [x.name for x in row.prologue] == ["conv"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("form", ["grn", "eca", "tokens", "gated"])
def test_the_strided_form_computes_what_onnxruntime_does(form: str, precision: str) -> None:
    model, shapes = pooled_product(form, items=3)
    cm = _compiled(model, shapes, precision)
    assert cm.report["verification"]["passed"] is True
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert g["rule"].startswith(RULE)
    assert _every_config(cm, model, shapes, precision) == 1  # the gate applied on the tile too (eca)


def test_the_strided_split_form_computes_the_same() -> None:
    model, shapes = pooled_product("grn")
    _split_form_computes_the_same(model, shapes, "MatMul")


# A norm over each item (GroupNorm with one group; a LayerNorm over a sequence's tokens and
# channels): the item's rows by all its columns, one program per item, reduced over both axes.


class ConvItemNorm(torch.nn.Module):
    """y = GroupNorm(1, C)(conv(x) + r): PoolFormer's and MobileViT V2's norm over each image after
    a conv (the channels-last region writes it as a LayerNorm over H, W and C)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(6, 24, 3, padding=1)
        self.norm = torch.nn.GroupNorm(1, 24)
        torch.nn.init.uniform_(self.norm.weight, 0.5, 1.5)
        torch.nn.init.uniform_(self.norm.bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x) + r)


def item_norm(form: str, tmp_path: Any) -> tuple[onnx.ModelProto, dict[str, list[int]]]:
    """`form` "conv": ConvItemNorm over [3, 6, 5, 7], exported with the default exporter;
    "tokens": LayerNorm over the last two axes of x @ w + b ([3, 9, 12] -> 20)."""
    if form == "conv":
        from tests.unit.test_default_export import export

        torch.manual_seed(0)
        x, r = torch.randn(3, 6, 5, 7), torch.randn(3, 24, 5, 7)
        return export(ConvItemNorm(), (x, r), tmp_path / "m.onnx"), {"x": [3, 6, 5, 7], "r": [3, 24, 5, 7]}
    nodes = [
        n("MatMul", ["x", "w"], ["h"], name="fc"),
        n("Add", ["h", "b"], ["hb"], name="bias"),
        n("LayerNormalization", ["hb", "gamma", "beta"], ["y"], name="ln", axis=1),
    ]
    inits = {
        "w": weights(12, 20, seed=1),
        "b": weights(20, seed=2),
        "gamma": 1.0 + weights(9, 20, seed=3),
        "beta": weights(9, 20, seed=4),
    }
    return tiny_model(nodes, {"x": [3, 9, 12]}, {"y": [3, 9, 20]}, inits), {"x": [3, 9, 12]}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("form", ["conv", "tokens"])
def test_a_gemm_before_a_norm_over_each_item_is_computed_on_its_tile(
    form: str, precision: str, tmp_path: Any
) -> None:
    model, shapes = item_norm(form, tmp_path)
    _, plan = planned(model)
    (row,) = [g for g in plan.groups if g.kind == "rowwise"]
    assert row.rule == RULE and row.prologue[0].op_type in ("MatMul", "opfuse.ConvNHWC")
    cm = _compiled(model, shapes, precision)
    assert cm.report["verification"]["passed"] is True
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "rowwise"]
    assert "ITEM_TILE = True" in k.source
    assert _every_config(cm, model, shapes, precision) == 1
