"""`operand_prologue` (opfuse/fusion/rules/operand_prologue.py): the pointwise ops that compute a
GEMM's A operand run on its A tiles, so A is never written: gMLP's gate before its projection,
a rescaled attention map before it meets V, a scaled query before Q @ Kᵀ."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals
from tests.unit.test_conv import check_every_candidate
from tests.unit.test_fusion import NHWC_ALWAYS, check_against_ort, make_model, ort_run

RNG = np.random.default_rng(53)
RULE = f"{names.GEMM_EPILOGUE}+{names.OPERAND_PROLOGUE}"


def gating_unit(tokens: int = 6, width: int = 16, d: int = 12) -> Any:
    """gMLP's block on x [2, tokens, width]: u, v = split(gelu(x @ w1 + b1)); the spatial
    projection over the tokens, transpose(transpose(v) @ wt + bt); then (u * that) @ w2 + b2 + x.
    The gate's inputs are one half of a Split and a Transpose: both read as views."""
    n = helper.make_node
    inits = {
        "w1": RNG.standard_normal((width, 2 * d)) / width**0.5,
        "b1": RNG.standard_normal(2 * d) * 0.1,
        "wt": RNG.standard_normal((tokens, tokens)) / tokens**0.5,
        "bt": RNG.uniform(0.5, 1.5, tokens),
        "w2": RNG.standard_normal((d, width)) / d**0.5,
        "b2": RNG.standard_normal(width) * 0.1,
        "halves": np.array([d, d]),
    }
    nodes = [
        n("MatMul", ["x", "w1"], ["h"], name="fc1"),
        n("Add", ["h", "b1"], ["hb"], name="fc1_bias"),
        n("Gelu", ["hb"], ["g"], name="gelu", domain=""),
        n("Split", ["g", "halves_i"], ["u", "v"], axis=2, name="chunk"),
        n("Transpose", ["v"], ["vt"], perm=[0, 2, 1], name="to_tokens"),
        n("MatMul", ["vt", "wt"], ["p"], name="proj"),
        n("Add", ["p", "bt"], ["pb"], name="proj_bias"),
        n("Transpose", ["pb"], ["gate"], perm=[0, 2, 1], name="back"),
        n("Mul", ["u", "gate"], ["a"], name="gate_mul"),
        n("MatMul", ["a", "w2"], ["o"], name="fc2"),
        n("Add", ["o", "b2"], ["ob"], name="fc2_bias"),
        n("Add", ["ob", "x"], ["y"], name="residual"),
    ]
    model = make_model(nodes, {"x": [2, tokens, width]}, {"y": [2, tokens, width]}, inits)
    # Split's sizes are int64 (make_model writes float initializers).
    model.graph.initializer.append(helper.make_tensor("halves_i", 7, [2], [d, d]))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "halves"))
    model.opset_import[0].version = 20  # Gelu
    return model


def scaled_scores(heads: int = 3, m: int = 5, k: int = 8, n: int = 7) -> Any:
    """A batched MatMul of a scaled query and a transposed key, nothing after it (no Softmax: no
    attention rule takes it): (q * 0.35) @ transpose(kx)."""
    nd = helper.make_node
    nodes = [
        nd("Mul", ["q", "scale"], ["qs"], name="scale_q"),
        nd("Transpose", ["kx"], ["kt"], perm=[0, 1, 3, 2], name="k_t"),
        nd("MatMul", ["qs", "kt"], ["y"], name="scores"),
    ]
    return make_model(
        nodes,
        {"q": [2, heads, m, k], "kx": [2, heads, n, k]},
        {"y": [2, heads, m, n]},
        {"scale": np.array(0.35)},
    )


def renormalized(heads: int = 3, m: int = 6, n: int = 5) -> Any:
    """ConViT's renormalized attention map meeting V: (attn / total) @ v, the total one value per
    row ([.., M, 1], broadcast along A's K axis)."""
    nd = helper.make_node
    nodes = [
        nd("Div", ["attn", "total"], ["a"], name="renorm"),
        nd("MatMul", ["a", "v"], ["y"], name="attn_v"),
    ]
    return make_model(
        nodes,
        {"attn": [2, heads, m, m], "total": [2, heads, m, 1], "v": [2, heads, m, n]},
        {"y": [2, heads, m, n]},
    )


def _fused_and_split_match(model: Any, shapes: dict[str, list[int]], *plans: Any) -> None:
    """Each plan (the fused one, the split form) gives onnxruntime's `y` on random inputs."""
    from opfuse.runtime.executor import Executor
    from tests.builders import TEST_DEVICE

    feeds = {x: RNG.standard_normal(s).astype(np.float32) for x, s in shapes.items()}
    want = ort_run(model, feeds)[0]
    for plan in plans:
        got = np.asarray(Executor(plan, TEST_DEVICE).run(feeds)["y"])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_gate_is_computed_on_the_projections_a_tiles() -> None:
    _, plan = planned(gating_unit())
    (group,) = [g for g in plan.groups if g.nodes[0].name == "fc2"]
    assert group.rule == RULE
    assert [n.name for n in group.prologue] == ["gate_mul"]
    assert [n.name for n in group.nodes] == ["fc2", "fc2_bias", "residual"]
    # The gate's inputs are read through the Split and the Transpose: the Transpose leaves the plan.
    assert sorted(group.views) == ["gate", "u"]
    assert "back" in [n.name for n in group.absorbed]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_gated_projection_matches_onnxruntime_at_every_candidate(precision: str) -> None:
    model = gating_unit()
    cm = check_against_ort(model, {"x": [2, 6, 16]}, precision, tune_budget_s=0)
    steps = [s for s in cm.plan.steps if s.launches]
    assert not [s for s in steps if s.kind == "op" and s.op_type == "Mul"]
    (k,) = [k for k in cm.plan.kernels.values() if "gate_mul" in k.source]
    assert "prologue: computed on A's tiles" in k.source and "a_tile = tl.where(a_ok" in k.source
    x = RNG.standard_normal((2, 6, 16)).astype(np.float32)
    # BLOCK_K 16 over K = 12: the lanes past K masked (tl.dot takes no K block under 16 on a GPU).
    check_every_candidate(cm, k, model, {"x": x}, precision, [{"BLOCK_K": 16}])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_scaled_query_in_a_batched_matmul(precision: str) -> None:
    """The batched template computes A = q * 0.35 at each tile (the scale a literal) and reads Kᵀ
    through its Transpose: one launch, every element against onnxruntime."""
    model = scaled_scores()
    shapes = {"q": [2, 3, 5, 8], "kx": [2, 3, 7, 8]}
    cm = check_against_ort(model, shapes, precision, tune_budget_s=0)
    assert cm.report["kernels"]["after"] == 1
    assert [g["rule"] for g in cm.report["fusion"]["groups"]] == [RULE]
    (k,) = cm.plan.kernels.values()
    assert "q0 * 0.3" in k.source  # the constant as a literal, in the precision's type
    feeds = {x: RNG.standard_normal(s).astype(np.float32) for x, s in shapes.items()}
    check_every_candidate(cm, k, model, feeds, precision)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_divisor_broadcast_along_k(precision: str) -> None:
    """total [.., M, 1] is loaded once per row of the tile, attn at each element; lanes past K
    (BLOCK_K 16 over K = 6) divide 0 by 0 and must not reach the sum."""
    model = renormalized()
    shapes = {"attn": [2, 3, 6, 6], "total": [2, 3, 6, 1], "v": [2, 3, 6, 5]}
    cm = check_against_ort(model, shapes, precision, tune_budget_s=0)
    assert cm.report["kernels"]["after"] == 1
    (k,) = cm.plan.kernels.values()
    feeds = {x: RNG.standard_normal(s).astype(np.float32) for x, s in shapes.items()}
    feeds["total"] = RNG.uniform(1.0, 2.0, shapes["total"]).astype(np.float32)
    check_every_candidate(cm, k, model, feeds, precision, [{"BLOCK_K": 16}])


def test_the_vendor_variant_runs_the_prologue_before_the_librarys_gemm() -> None:
    """Tuning's alternative: the gate's Mul as a kernel of its own (reading the Split and the
    Transpose as views, as the GEMM did), the library's GEMM, then its epilogue's kernel; the same
    result as the one kernel."""
    from bench.kernels import plan_model
    from opfuse.codegen.registry import split_form
    from opfuse.lowering import build_plan

    model = gating_unit()
    p = plan_model(model, {"x": [2, 6, 16]}, "fp32")
    (g,) = [g for g in p.fusion.groups if g.rule == RULE]
    vendor = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    mine = [s.op_type or "kernel" for s in vendor.steps if s.group == g.id and s.launches]
    assert mine == ["kernel", "MatMul", "kernel"]
    assert split_form(g) == "split: the prologue's kernel, the library's GEMM, the epilogue's kernel"
    _fused_and_split_match(model, {"x": [2, 6, 16]}, p.plan, vendor)


def test_a_value_read_elsewhere_too_stays_a_buffer() -> None:
    """Where the gate's product is a graph output as well, it must be stored: no prologue."""
    model = gating_unit()
    model.graph.output.append(helper.make_tensor_value_info("a", 1, [2, 6, 12]))
    _, plan = planned(model)
    assert not [g for g in claimed(plan) if names.OPERAND_PROLOGUE in g[1]]


def test_more_inputs_than_the_kernel_loads_per_step_are_refused() -> None:
    nd = helper.make_node
    nodes = [
        nd("Mul", ["a0", "a1"], ["m1"], name="m1"),
        nd("Mul", ["m1", "a2"], ["m2"], name="m2"),
        nd("Add", ["m2", "a3"], ["m3"], name="m3"),
        nd("Sub", ["m3", "a4"], ["a"], name="m4"),
        nd("MatMul", ["a", "w"], ["y"], name="mm"),
    ]
    model = make_model(
        nodes, {f"a{i}": [4, 8] for i in range(5)}, {"y": [4, 3]}, {"w": RNG.standard_normal((8, 3))}
    )
    _, plan = planned(model)
    why = "A is computed from 5 tensors (over 4): a load of each per K step"
    assert refusals(plan, names.OPERAND_PROLOGUE) == [(["m1", "m2", "m3", "m4", "mm"], why)]


def test_disabling_the_rule_gives_the_plan_without_it() -> None:
    _, plan = planned(gating_unit(), (names.OPERAND_PROLOGUE,))
    assert not [g for g in claimed(plan) if names.OPERAND_PROLOGUE in g[1]]
    assert not [g for g in claimed(plan) if "gate_mul" in g[2]]  # the Mul runs on its own


def test_a_chain_over_the_cap_is_refused_whole() -> None:
    """Thirteen ops before the GEMM: taking twelve would leave the last a kernel writing A's size."""
    nd = helper.make_node
    nodes = [nd("Mul", ["x", "h"], ["t0"], name="op0")]
    for i in range(1, 13):
        nodes.append(nd("Mul", [f"t{i - 1}", "h"], [f"t{i}"], name=f"op{i}"))
    nodes.append(nd("MatMul", ["t12", "w"], ["y"], name="mm"))
    model = make_model(
        nodes,
        {"x": [4, 8], "h": [4, 8]},
        {"y": [4, 3]},
        {"w": RNG.standard_normal((8, 3))},
    )
    _, plan = planned(model)
    ((labels, why),) = refusals(plan, names.OPERAND_PROLOGUE)
    assert why == "A is computed by 13 ops (over 12) on every tile of every K step"
    assert sorted(labels) == sorted([*(f"op{i}" for i in range(13)), "mm"])
    assert not [g for g in claimed(plan) if names.OPERAND_PROLOGUE in g[1]]


def gated_norm() -> Any:
    """A T5-style gated FFN's end: (gelu(a) * b) @ w, the residual x added, then a LayerNorm."""
    nd = helper.make_node
    nodes = [
        nd("Gelu", ["a"], ["ga"], name="act", approximate="tanh"),
        nd("Mul", ["ga", "b"], ["m"], name="gate"),
        nd("MatMul", ["m", "w"], ["p"], name="wo"),
        nd("Add", ["p", "x"], ["r"], name="residual"),
        nd("LayerNormalization", ["r", "g", "beta"], ["y"], name="ln", axis=-1),
    ]
    model = make_model(
        nodes,
        {"a": [2, 5, 24], "b": [2, 5, 24], "x": [2, 5, 16]},
        {"y": [2, 5, 16]},
        {
            "w": RNG.standard_normal((24, 16)) / 24**0.5,
            "g": RNG.uniform(0.5, 1.5, 16),
            "beta": RNG.standard_normal(16),
        },
    )
    model.opset_import[0].version = 20  # Gelu
    return model


ROW_RULE = f"{names.ROW_REDUCTION}+{names.GEMM_REDUCTION}+{names.OPERAND_PROLOGUE}"
GATED_SHAPES = {"a": [2, 5, 24], "b": [2, 5, 24], "x": [2, 5, 16]}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_row_kernels_gemm_computes_its_a_too(precision: str) -> None:
    """Only the LayerNorm's row kernel reads the GEMM: gemm_reduction computes it on the row
    kernel's tiles, and the gate's ops with it, on A's tiles in the K loop. One launch, every
    element against onnxruntime, at every candidate and a K block wider than K."""
    model = gated_norm()
    cm = check_against_ort(model, GATED_SHAPES, precision, tune_budget_s=0)
    assert cm.report["kernels"]["after"] == 1
    assert [g["rule"] for g in cm.report["fusion"]["groups"]] == [ROW_RULE]
    (k,) = cm.plan.kernels.values()
    assert "prologue: A of the GEMM computed on the tiles" in k.source
    feeds = {x: RNG.standard_normal(s).astype(np.float32) for x, s in GATED_SHAPES.items()}
    check_every_candidate(cm, k, model, feeds, precision, [{"BLOCK_K": 32}])


def test_the_row_kernels_split_form_runs_the_ops_as_one_kernel() -> None:
    from bench.kernels import plan_model
    from opfuse.codegen.registry import split_form
    from opfuse.lowering import build_plan

    model = gated_norm()
    p = plan_model(model, GATED_SHAPES, "fp32")
    (g,) = p.fusion.groups
    assert split_form(g) == "split: the prologue's kernel, the library's GEMM, then the row kernel"
    vendor = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    assert [s.op_type or "kernel" for s in vendor.steps if s.launches] == ["kernel", "MatMul", "kernel"]
    _fused_and_split_match(model, GATED_SHAPES, p.plan, vendor)


def test_a_gemm_a_row_kernel_takes_gets_no_prologue_of_its_own() -> None:
    """With gemm_reduction off the GEMM is not left to a row kernel: its own kernel takes the
    gate's ops, and the LayerNorm is a row kernel of its own."""
    _, plan = planned(gated_norm(), (names.GEMM_REDUCTION,))
    rules = sorted(g[1] for g in claimed(plan))
    assert rules == sorted([names.ROW_REDUCTION, RULE])


def gated_conv(channels: int, kernel: int) -> Any:
    """StarNet's block: two 1x1 convs of x (merged into one conv and a Split of its channels),
    clip(a, 0, 6) * b, then a kernel x kernel conv (padded to keep the size) of it. The product
    varies over the image: no input scale folds it."""
    nd = helper.make_node
    nodes = [
        nd("Conv", ["x", "wa"], ["a"], name="f1"),
        nd("Conv", ["x", "wb"], ["b"], name="f2"),
        nd("Clip", ["a", "lo", "hi"], ["ca"], name="relu6"),
        nd("Mul", ["ca", "b"], ["m"], name="star"),
        nd("Conv", ["m", "w", "cb"], ["y"], name="conv", pads=[kernel // 2] * 4),
    ]
    return make_model(
        nodes,
        {"x": [2, 5, 6, 6]},
        {"y": [2, 8, 6, 6]},
        {
            "wa": RNG.standard_normal((channels, 5, 1, 1)),
            "wb": RNG.standard_normal((channels, 5, 1, 1)) * 0.5,
            "lo": np.array(0.0),
            "hi": np.array(6.0),
            "w": RNG.standard_normal((8, channels, kernel, kernel)) / (kernel * channels**0.5),
            "cb": RNG.standard_normal(8) * 0.1,
        },
    )


CONV_RULE = f"{names.CONV_EPILOGUE}+{names.OPERAND_PROLOGUE}"


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(("channels", "kernel"), [(24, 3), (24, 1), (6, 3)])
def test_a_convs_input_computed_on_each_taps_tile(precision: str, channels: int, kernel: int) -> None:
    """The window loop (24 channels, 3x3: the ops at each tap, the padding 0 after them), a 1x1
    conv, and the flat loop of a first layer (6 channels): every element against onnxruntime,
    at every tuning candidate."""
    model = gated_conv(channels, kernel)
    shapes = {"x": [2, 5, 6, 6]}
    cm = check_against_ort(model, shapes, precision, NHWC_ALWAYS, tune_budget_s=0)
    assert CONV_RULE in [g["rule"] for g in cm.report["fusion"]["groups"]]
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type in ("Clip", "Mul") and s.launches]
    (k,) = [k for k in cm.plan.kernels.values() if "computed on the input tiles" in k.source]
    feeds = {"x": RNG.standard_normal((2, 5, 6, 6)).astype(np.float32)}
    check_every_candidate(cm, k, model, feeds, precision)


def test_the_convs_split_form_runs_the_ops_as_one_kernel() -> None:
    from bench.kernels import plan_model
    from opfuse.codegen.registry import split_form
    from opfuse.lowering import build_plan

    model = gated_conv(24, 3)
    shapes = {"x": [2, 5, 6, 6]}
    p = plan_model(model, shapes, "fp32", NHWC_ALWAYS)
    (g,) = [g for g in p.fusion.groups if g.rule == CONV_RULE]
    assert split_form(g) == "split: the prologue's kernel, the library's conv, the epilogue's kernel"
    vendor = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    assert [s.op_type or "kernel" for s in vendor.steps if s.group == g.id and s.launches] == [
        "kernel",
        "opfuse.ConvNHWC",
    ]
    _fused_and_split_match(model, shapes, p.plan, vendor)


def test_an_input_behind_a_resize_is_left_to_resize_gather() -> None:
    """An FPN's top-down Add read by the 3x3 conv after it: the Add's own kernel gathers the
    upsampled map from the coarse map (resize_gather), where a prologue would read the Resize's
    output, copied first. The rule says so and leaves the Add alone."""
    nd = helper.make_node
    nodes = [
        nd("Conv", ["x", "wc"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2], name="coarse"),
        nd("Resize", ["c", "", "scales"], ["r"], mode="nearest", name="up"),
        nd("Conv", ["x", "wl"], ["l"], name="lateral"),
        nd("Conv", ["x", "wn"], ["n"], name="next"),
        nd("Relu", ["n"], ["z"], name="next_relu"),
        nd("Add", ["l", "r"], ["s"], name="top_down"),
        nd("Conv", ["s", "wo"], ["y"], pads=[1, 1, 1, 1], name="smooth"),
    ]
    inits = {
        "wc": RNG.standard_normal((8, 4, 3, 3)),
        "wl": RNG.standard_normal((8, 4, 1, 1)),
        "wn": RNG.standard_normal((6, 4, 1, 1)),
        "wo": RNG.standard_normal((8, 8, 3, 3)),
        "scales": np.array([1, 1, 2, 2]),
    }
    model = make_model(nodes, {"x": [2, 4, 10, 12]}, {"y": [2, 8, 10, 12], "z": [2, 6, 10, 12]}, inits)
    _, plan = planned(model, NHWC_ALWAYS)
    why = "an input is a Resize that the ops' own kernel gathers instead of copying (resize_gather)"
    assert refusals(plan, names.OPERAND_PROLOGUE) == [(["top_down", "smooth"], why)]
    assert [g[1] for g in claimed(plan) if "top_down" in g[2]] == [f"{names.POINTWISE}+{names.RESIZE_GATHER}"]


def k_concat(scaled: bool = False, widths: tuple[int, ...] = (12, 20), norm: bool = False) -> Any:
    """Features side by side along K before a projection (Sequencer's two LSTM directions and
    axes, a multi-branch head): concat([p0, p1, ...], -1) @ w + bias, its parts views (p0 the
    transpose of t0 [2, width, 5]; the others as they are), optionally scaled after the Concat;
    then Gelu, or (`norm`) the residual x and a LayerNorm."""
    nd = helper.make_node
    k, n = sum(widths), 16
    nodes = [nd("Transpose", ["t0"], ["p0"], perm=[0, 2, 1], name="to_rows")]
    nodes.append(nd("Concat", [f"p{i}" for i in range(len(widths))], ["c"], axis=-1, name="cat"))
    a = "c"
    if scaled:
        nodes.append(nd("Mul", ["c", "s"], ["cs"], name="scale"))
        a = "cs"
    nodes += [nd("MatMul", [a, "w"], ["h"], name="proj"), nd("Add", ["h", "bias"], ["hb"], name="proj_bias")]
    if norm:
        nodes += [
            nd("Add", ["hb", "x"], ["r"], name="residual"),
            nd("LayerNormalization", ["r", "g", "beta"], ["y"], name="ln", axis=-1),
        ]
    else:
        nodes.append(nd("Gelu", ["hb"], ["y"], name="act"))
    inputs = {"t0": [2, widths[0], 5], **{f"p{i}": [2, 5, w] for i, w in enumerate(widths) if i}}
    if norm:
        inputs["x"] = [2, 5, n]
    inits = {
        "w": RNG.standard_normal((k, n)) / k**0.5,
        "bias": RNG.standard_normal(n) * 0.1,
        "s": RNG.uniform(0.5, 1.5, k),
        "g": RNG.uniform(0.5, 1.5, n),
        "beta": RNG.standard_normal(n),
    }
    model = make_model(nodes, inputs, {"y": [2, 5, n]}, inits)
    model.opset_import[0].version = 20  # Gelu
    return model


def _k_concat_shapes(widths: tuple[int, ...], norm: bool = False) -> dict[str, list[int]]:
    shapes = {"t0": [2, widths[0], 5], **{f"p{i}": [2, 5, w] for i, w in enumerate(widths) if i}}
    return {**shapes, "x": [2, 5, 16]} if norm else shapes


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    "widths, scaled", [((12, 20), False), ((7, 16, 9), True)], ids=["two-parts", "three-parts-scaled"]
)
def test_a_concat_along_k_is_read_in_parts_on_a_tiles(
    widths: tuple[int, ...], scaled: bool, precision: str
) -> None:
    """The Concat is never written: each K step loads every part at its own columns (masked to
    them; p0 through its Transpose), the scale applied after. Parts of 7, 16 and 9 columns cross
    the K blocks; every candidate, every output element against onnxruntime."""
    model = k_concat(scaled, widths)
    shapes = _k_concat_shapes(widths)
    cm = check_against_ort(model, shapes, precision, tune_budget_s=0)
    assert cm.report["kernels"]["after"] == 1
    (g,) = cm.report["fusion"]["groups"]
    assert g["rule"] == RULE
    (k,) = cm.plan.kernels.values()
    assert "cat" in k.source and "prologue: computed on A's tiles" in k.source
    feeds = {x: RNG.standard_normal(s).astype(np.float32) for x, s in shapes.items()}
    check_every_candidate(cm, k, model, feeds, precision, [{"BLOCK_K": 16}])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_row_kernels_gemm_reads_its_concat_in_parts(precision: str) -> None:
    """Sequencer's block end: the projection of the Concat, its bias and the residual, then the
    LayerNorm: one row kernel computing the GEMM from the parts."""
    widths = (12, 20)
    model = k_concat(widths=widths, norm=True)
    shapes = _k_concat_shapes(widths, norm=True)
    cm = check_against_ort(model, shapes, precision, tune_budget_s=0)
    assert cm.report["kernels"]["after"] == 1
    assert [g["rule"] for g in cm.report["fusion"]["groups"]] == [ROW_RULE]
    (k,) = cm.plan.kernels.values()
    feeds = {x: RNG.standard_normal(s).astype(np.float32) for x, s in shapes.items()}
    check_every_candidate(cm, k, model, feeds, precision, [{"BLOCK_K": 32}])


def test_the_concats_split_form_runs_it_as_a_kernel_of_its_own() -> None:
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan

    widths = (7, 16, 9)
    model = k_concat(True, widths)
    shapes = _k_concat_shapes(widths)
    p = plan_model(model, shapes, "fp32")
    (g,) = p.fusion.groups
    vendor = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    assert [s.op_type or "kernel" for s in vendor.steps if s.launches] == ["kernel", "MatMul", "kernel"]
    _fused_and_split_match(model, shapes, p.plan, vendor)


def test_a_concat_part_another_op_reads_too_is_refused() -> None:
    """p1 is a part of the Concat and multiplies it as well: loaded at its own columns and at A's,
    two ways; the prologue is refused, with the reason."""
    nd = helper.make_node
    nodes = [
        nd("Concat", ["p0", "p1"], ["c"], axis=-1, name="cat"),
        nd("Concat", ["p1", "p0"], ["d"], axis=-1, name="cat2"),
        nd("Mul", ["c", "d"], ["a"], name="mix"),
        nd("MatMul", ["a", "w"], ["y"], name="mm"),
    ]
    model = make_model(
        nodes, {"p0": [4, 8], "p1": [4, 8]}, {"y": [4, 3]}, {"w": RNG.standard_normal((16, 3))}
    )
    _, plan = planned(model)
    ((labels, why),) = refusals(plan, names.OPERAND_PROLOGUE)
    assert why == "a part of the Concat along K is read or computed by another of the ops too"
    assert "mm" in labels
    assert not [g for g in claimed(plan) if names.OPERAND_PROLOGUE in g[1]]


@pytest.mark.parametrize(
    "parts, axis, shapes",
    [
        (["p0", "p1"], -2, {"p0": [3, 8], "p1": [5, 8]}),  # rows stacked (M), not K
        (["p0", "p0"], -1, {"p0": [8, 4]}),  # one tensor twice: two offsets for one load
    ],
    ids=["along-m", "a-part-twice"],
)
def test_a_concat_that_is_not_k_parts_stays_a_buffer(
    parts: list[str], axis: int, shapes: dict[str, list[int]]
) -> None:
    nd = helper.make_node
    nodes = [
        nd("Concat", parts, ["c"], axis=axis, name="cat"),
        nd("MatMul", ["c", "w"], ["y"], name="mm"),
    ]
    model = make_model(nodes, shapes, {"y": [8, 3]}, {"w": RNG.standard_normal((8, 3))})
    _, plan = planned(model)
    assert not [g for g in claimed(plan) if names.OPERAND_PROLOGUE in g[1]]
