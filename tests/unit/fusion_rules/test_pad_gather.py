"""`pad_gather` (opfuse/fusion/pad_gather.py, codegen/index_map.py): a constant Pad, or a Gather
by constant indices, with the layout ops around it, read only by one pointwise kernel is computed
by that kernel's loads; every output element against onnxruntime."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

import opfuse
from bench.kernels import view_copies
from tests.builders import TEST_DEVICE, tiny_model
from tests.unit.test_fusion import ort_run

n = helper.make_node


def shifted_rows() -> onnx.ModelProto:
    """Pad by 2.5 (one row before, two columns after), merge the rows, take every second row and
    column from the second, add y, Relu."""
    return tiny_model(
        [
            n("Pad", ["x", "pads", "fill"], ["p"]),
            n("Reshape", ["p", "rows"], ["r"]),
            n("Slice", ["r", "starts", "ends", "axes", "steps"], ["s"]),
            n("Add", ["s", "y"], ["a"]),
            n("Relu", ["a"], ["out"]),
        ],
        {"x": [2, 3, 4], "y": [4, 3]},
        {"out": [4, 3]},
        {
            "pads": np.array([0, 1, 0, 0, 0, 2]),
            "fill": np.array(2.5),
            "rows": np.array([8, 6]),
            "starts": np.array([1, 0]),
            "ends": np.array([8, 6]),
            "axes": np.array([0, 1]),
            "steps": np.array([2, 2]),
        },
    )


def nested_pads() -> onnx.ModelProto:
    """Two Pads of different values around a flatten, then a reshape, a transpose and an expand
    before the kernel's Mul and Sigmoid (the relative-position shift's shape, with borders that
    are not zero)."""
    return tiny_model(
        [
            n("Pad", ["x", "pads1", "fill1"], ["p1"]),
            n("Reshape", ["p1", "flat"], ["f"]),
            n("Pad", ["f", "pads2", "fill2"], ["p2"]),
            n("Reshape", ["p2", "grid"], ["g"]),
            n("Transpose", ["g"], ["t"], perm=[1, 0]),
            n("Expand", ["t", "wide"], ["e"]),
            n("Mul", ["e", "y"], ["m"]),
            n("Sigmoid", ["m"], ["out"]),
        ],
        {"x": [3, 5], "y": [2, 11, 3]},
        {"out": [2, 11, 3]},
        {
            "pads1": np.array([1, 0, 0, 2]),
            "fill1": np.array(1.5),
            "flat": np.array([28]),
            "pads2": np.array([2, 3]),
            "fill2": np.array(-3.0),
            "grid": np.array([3, 11]),
            "wide": np.array([2, 11, 3]),
        },
    )


def overlapping_windows() -> onnx.ModelProto:
    """Windows of three columns at stride two, clamped at the edge (the dynamo exporter's adaptive
    pooling: flatten the pixels, gather each window's, move the window axis in), scaled by y."""
    cols = np.minimum(np.arange(4)[:, None] * 2 + np.arange(3)[None, :], 6)  # [window, tap]
    return tiny_model(
        [
            n("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
            n("Gather", ["t", "cols"], ["g"], axis=0),
            n("Transpose", ["g"], ["w"], perm=[2, 3, 0, 1]),
            n("Mul", ["w", "y"], ["out"]),
        ],
        {"x": [2, 5, 7], "y": [5, 4, 3]},
        {"out": [2, 5, 4, 3]},
        {"cols": cols},
    )


def nd_picks() -> onnx.ModelProto:
    """GatherND of (row, column) tuples in no order, some repeated (gathernd_as_gather: a
    Reshape and a Gather), then a Pad of the picks and a Sigmoid: both in the loads."""
    picks = np.array([[[2, 1], [0, 0]], [[4, 3], [2, 1]], [[1, 2], [3, 0]]])
    return tiny_model(
        [
            n("GatherND", ["x", "picks"], ["g"]),
            n("Pad", ["g", "pads", "fill"], ["p"]),
            n("Sigmoid", ["p"], ["out"]),
        ],
        {"x": [5, 4, 6]},
        {"out": [3, 3, 6]},
        {"picks": picks, "pads": np.array([0, 1, 0, 0, 0, 0]), "fill": np.array(0.5)},
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("build", [shifted_rows, nested_pads, overlapping_windows, nd_picks])
def test_the_kernel_loads_through_the_pads(build, precision: str) -> None:  # type: ignore[no-untyped-def]
    _one_kernel(build(), precision, "pointwise+pad_gather")


def _one_kernel(model: onnx.ModelProto, precision: str, rule: str) -> None:
    """`model` compiles to one kernel of `rule`, verifies, and matches onnxruntime on every
    element of random inputs."""
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    cm = opfuse.compile(model, shapes, precision=precision, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    launched = [s for s in cm.plan.steps if s.launches]
    assert len(launched) == 1 and launched[0].kind == "kernel", [s.op_type for s in launched]
    assert [g["rule"] for g in cm.report["fusion"]["groups"]] == [rule]
    rng = np.random.default_rng(3)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    (ref,) = ort_run(model, feeds)
    tol = 1e-5 if precision == "fp32" else 1e-2
    np.testing.assert_allclose(cm.run(feeds)["out"], ref, rtol=tol, atol=tol)


def test_the_gathers_index_table_is_clamped_into_the_axis() -> None:
    """Tuning runs a kernel on random inputs, its index tables too: a table entry past the axis
    reads its last element, one below it the first, never outside the buffer."""
    from opfuse.codegen.index_map import index_map_load
    from opfuse.ir.index_map import IndexMap, IndexStep

    step = IndexStep("gather", (7, 2), (3, 2), axis=0, table="cols", index_shape=(3,))
    lines: list[str] = []
    value = index_map_load("m", "in0", IndexMap("x", (7, 2), (3, 2), (step,)), lines, tables={"cols": "tab0"})
    assert lines[1:] == [
        "m_g0 = tl.load(tab0 + (m_f0 // 2), mask=mask, other=0)",
        "m_g0 = tl.minimum(tl.maximum(m_g0, 0), 6)",
    ]
    assert value == "tl.load(in0 + m_g0 * 2 + (m_f0 % 2), mask=mask, other=0.0).to(tl.float32)"


def test_a_pad_read_elsewhere_too_stays() -> None:
    """A Pad whose output another node reads as well is written once, by its own kernel."""
    model = tiny_model(
        [
            n("Pad", ["x", "pads"], ["p"]),
            n("Add", ["p", "y"], ["a"]),
            n("Relu", ["a"], ["out"]),
            n("Neg", ["p"], ["other"]),
        ],
        {"x": [3, 4], "y": [3, 6]},
        {"out": [3, 6], "other": [3, 6]},
        {"pads": np.array([0, 1, 0, 1])},
    )
    cm = opfuse.compile(model, {"x": [3, 4], "y": [3, 6]}, device=TEST_DEVICE)
    assert [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches] == ["Pad", "Neg"]
    assert "pad_gather" not in str(cm.report["fusion"]["groups"])


def test_the_rule_can_be_switched_off() -> None:
    model = shifted_rows()
    cm = opfuse.compile(
        model, {"x": [2, 3, 4], "y": [4, 3]}, device=TEST_DEVICE, fusion_disable=("pad_gather",)
    )
    assert "Pad" in [s.op_type for s in cm.plan.steps if s.launches]


def test_a_concat_loads_a_pad_at_its_selections_offsets() -> None:
    """A Concat's selection loads each input at that input's own offsets: a Pad it reads is
    computed by those loads, also where another op of the kernel (the Add, broadcasting it) reads
    it at the kernel's offsets."""
    model = tiny_model(
        [
            n("Pad", ["x", "pads", "fill"], ["p"]),
            n("Concat", ["p", "y"], ["c"], axis=0),
            n("Add", ["c", "p"], ["out"]),
        ],
        {"x": [1, 4], "y": [5, 6]},
        {"out": [6, 6]},
        {"pads": np.array([0, 1, 0, 1]), "fill": np.array(0.75)},
    )
    _one_kernel(model, "fp32", "pointwise+concat_select+pad_gather")


def padded_blocks() -> onnx.ModelProto:
    """LongT5's local attention: pad the sequence to whole blocks, cut it into blocks, pad one
    block on each side, and concatenate each block with its neighbours (three Slices of the one
    padded value into one Concat); then scale by y."""
    return tiny_model(
        [
            n("Pad", ["x", "pads1"], ["p1"]),
            n("Reshape", ["p1", "blocks"], ["b"]),
            n("Pad", ["b", "pads2", "fill"], ["p2"]),
            n("Slice", ["p2", "s0", "e0", "axis"], ["l"]),
            n("Slice", ["p2", "s1", "e1", "axis"], ["m"]),
            n("Slice", ["p2", "s2", "e2", "axis"], ["r"]),
            n("Concat", ["l", "m", "r"], ["c"], axis=2),
            n("Mul", ["c", "y"], ["out"]),
        ],
        {"x": [2, 7, 3], "y": [2, 3, 9, 3]},
        {"out": [2, 3, 9, 3]},
        {
            "pads1": np.array([0, 0, 0, 0, 2, 0]),
            "blocks": np.array([2, 3, 3, 3]),
            "pads2": np.array([0, 1, 0, 0, 0, 1, 0, 0]),
            "fill": np.array(-1.25),
            "s0": np.array([0]),
            "e0": np.array([3]),
            "s1": np.array([1]),
            "e1": np.array([4]),
            "s2": np.array([2]),
            "e2": np.array([5]),
            "axis": np.array([1]),
        },
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_chains_that_share_a_pad_load_it_each(precision: str) -> None:
    _one_kernel(padded_blocks(), precision, "pointwise+concat_select+pad_gather")


def test_a_shared_pad_read_outside_the_kernel_stays() -> None:
    """Where a node the chains share is read by another kernel as well, the shared part is
    written once (by its own kernel) and the chains stop before it."""
    model = padded_blocks()
    model.graph.node.append(n("Neg", ["b"], ["other"]))
    model.graph.output.append(helper.make_tensor_value_info("other", onnx.TensorProto.FLOAT, [2, 3, 3, 3]))
    shapes = {"x": [2, 7, 3], "y": [2, 3, 9, 3]}
    cm = opfuse.compile(model, shapes, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    ops = [s.op_type or s.kind for s in cm.plan.steps if s.launches]
    assert ops.count("Pad") == 1 and "kernel" in ops, ops  # the first Pad; the second gathered
    rng = np.random.default_rng(6)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    ref = ort_run(model, feeds)
    got = cm.run(feeds)
    for name, want in zip(["out", "other"], ref, strict=True):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("batched", [False, True])
def test_a_gemm_epilogue_loads_through_the_pad(batched: bool, precision: str) -> None:
    """CoaT's factorized attention adds its convolutional position term, padded with a zero row
    for the class token, in the epilogue of a (batched) GEMM: the epilogue loads through the Pad,
    which runs no kernel of its own."""
    lead = [2] if batched else []
    model = tiny_model(
        [
            n("MatMul", ["a", "b"], ["c"]),
            n("Mul", ["q", "v"], ["crpe"]),
            n("Pad", ["crpe", "pads"], ["p"]),
            n("Add", ["c", "p"], ["out"]),
        ],
        {"a": [*lead, 7, 16], "b": [*lead, 16, 8], "q": [*lead, 6, 8], "v": [*lead, 6, 8]},
        {"out": [*lead, 7, 8]},
        {"pads": np.array([*([0] * len(lead)), 1, 0, *([0] * len(lead)), 0, 0])},
    )
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    cm = opfuse.compile(model, shapes, precision=precision, device=TEST_DEVICE, tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True
    assert "Pad" not in [s.op_type for s in cm.plan.steps if s.launches]
    assert any(g["rule"].endswith("+pad_gather") for g in cm.report["fusion"]["groups"]), cm.report["fusion"]
    rng = np.random.default_rng(5)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    (ref,) = ort_run(model, feeds)
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(cm.run(feeds)["out"], ref, rtol=tol, atol=tol)


def padded_windows() -> onnx.ModelProto:
    """TinyViT's window attention input: a channels-last map padded to whole 7x7 windows, cut
    into windows, then the attention's LayerNorm over the channels."""
    return tiny_model(
        [
            n("Pad", ["x", "pads"], ["p"]),
            n("Reshape", ["p", "grid"], ["g"]),
            n("Transpose", ["g"], ["t"], perm=[0, 1, 3, 2, 4, 5]),
            n("Reshape", ["t", "windows"], ["w"]),
            n("LayerNormalization", ["w", "scale", "bias"], ["out"], axis=-1),
        ],
        {"x": [1, 8, 8, 16]},
        {"out": [4, 49, 16]},
        {
            "pads": np.array([0, 0, 0, 0, 0, 6, 6, 0]),
            "grid": np.array([1, 2, 7, 2, 7, 16]),
            "windows": np.array([4, 49, 16]),
            "scale": np.random.default_rng(1).uniform(0.5, 1.5, 16).astype(np.float32),
            "bias": np.random.default_rng(2).standard_normal(16).astype(np.float32),
        },
    )


def gathered_rows() -> onnx.ModelProto:
    """Rows picked by constant indices, repeated and out of order, then a Softmax over each."""
    return tiny_model(
        [
            n("Gather", ["x", "rows"], ["g"], axis=1),
            n("Softmax", ["g"], ["out"], axis=-1),
        ],
        {"x": [2, 5, 12]},
        {"out": [2, 3, 2, 12]},
        {"rows": np.array([[4, 0], [0, 3], [2, 2]])},
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("build", [padded_windows, gathered_rows])
def test_a_row_kernel_loads_through_the_pad_or_gather(build, precision: str) -> None:  # type: ignore[no-untyped-def]
    """The row kernel (a LayerNorm, a Softmax) loads its input through the chain: one launch."""
    _one_kernel(build(), precision, "row_reduction+pad_gather")


def test_a_saved_bundle_loads_the_gathers_index_table_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The bundle's kernel spec names the index table; the loaded plan renders the kernel again
    and passes the table from the bundle's constants: the same result as onnxruntime's."""
    model = overlapping_windows()
    shapes = {"x": [2, 5, 7], "y": [5, 4, 3]}
    cm = opfuse.compile(model, shapes, device=TEST_DEVICE)
    cm.save(tmp_path / "bundle.zip")
    loaded = opfuse.load(tmp_path / "bundle.zip", device=TEST_DEVICE)
    assert [s.kind for s in loaded.plan.steps if s.launches] == ["kernel"]
    rng = np.random.default_rng(5)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    (ref,) = ort_run(model, feeds)
    np.testing.assert_allclose(loaded.run(feeds)["out"], ref, rtol=1e-5, atol=1e-5)


def reversed_windows() -> onnx.ModelProto:
    """Swin's and DaViT's window reverse: windows [4, 2, 3, 5] (2x2 windows of 2x3 pixels) put
    back into a 4x6 map (Reshape, Transpose, Reshape: dims no one stride spans), cropped to 3x5
    (the padding's removal), flattened to tokens and added to the residual y: no Pad, and no
    strided view reaches the windows (the runtime would copy), so the Add loads the windows
    through the chain."""
    return tiny_model(
        [
            n("Sigmoid", ["w"], ["s"]),
            n("Reshape", ["s", "grid"], ["g"]),
            n("Transpose", ["g"], ["t"], perm=[0, 1, 3, 2, 4, 5]),
            n("Reshape", ["t", "map"], ["m"]),
            n("Slice", ["m", "starts", "ends", "axes"], ["c"]),
            n("Reshape", ["c", "tokens"], ["k"]),
            n("Add", ["k", "y"], ["out"]),
        ],
        {"w": [4, 2, 3, 5], "y": [1, 15, 5]},
        {"out": [1, 15, 5]},
        {
            "grid": np.array([1, 2, 2, 2, 3, 5]),
            "map": np.array([1, 4, 6, 5]),
            "starts": np.array([0, 0]),
            "ends": np.array([3, 5]),
            "axes": np.array([1, 2]),
            "tokens": np.array([1, 15, 5]),
        },
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_chain_no_stride_spans_is_loaded_through(precision: str) -> None:
    model = reversed_windows()
    shapes = {"w": [4, 2, 3, 5], "y": [1, 15, 5]}
    cm = opfuse.compile(model, shapes, precision=precision, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    assert [s.op_type or s.kind for s in cm.plan.steps if s.launches] == ["Sigmoid", "kernel"]
    (group,) = cm.report["fusion"]["groups"]
    assert group["rule"] == "pointwise+pad_gather"
    kernel = next(k for k in cm.plan.kernels.values())
    assert kernel.inputs == ["s", "y"]  # the Sigmoid's output itself, no copy of it
    rng = np.random.default_rng(8)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    (ref,) = ort_run(model, feeds)
    tol = 1e-5 if precision == "fp32" else 1e-2
    np.testing.assert_allclose(cm.run(feeds)["out"], ref, rtol=tol, atol=tol)


def partitioned_windows(fill: float, pad: bool = True) -> onnx.ModelProto:
    """Swin's and DaViT's window partition before the attention's projection: a channels-last
    map (the Sigmoid's output, 1x5x5x8) padded to whole 3x3 windows (or a 6x6 map, not padded),
    cut into its four windows (Reshape, Transpose, Reshape: the windows' pixels are no strided
    view of the map), each window's nine tokens the rows of A; then Linear (MatMul, bias)."""
    side = 5 if pad else 6
    nodes = [n("Sigmoid", ["x"], ["s"])]
    if pad:
        nodes.append(n("Pad", ["s", "pads", "fill"], ["p"]))
    nodes += [
        n("Reshape", ["p" if pad else "s", "grid"], ["g"]),
        n("Transpose", ["g"], ["t"], perm=[0, 1, 3, 2, 4, 5]),
        n("Reshape", ["t", "rows"], ["a"]),
        n("MatMul", ["a", "w"], ["m"]),
        n("Add", ["m", "bias"], ["out"]),
    ]
    rng = np.random.default_rng(4)
    return tiny_model(
        nodes,
        {"x": [1, side, side, 8]},
        {"out": [4, 9, 16]},
        {
            "pads": np.array([0, 0, 0, 0, 0, 1, 1, 0]),
            "fill": np.array(fill, dtype=np.float32),
            "grid": np.array([1, 2, 3, 2, 3, 8]),
            "rows": np.array([4, 9, 8]),
            "w": rng.standard_normal((8, 16)).astype(np.float32),
            "bias": rng.standard_normal(16).astype(np.float32),
        },
    )


def _gemm_reads_the_windows(model: onnx.ModelProto, precision: str) -> Any:
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    cm = opfuse.compile(model, shapes, precision=precision, device=TEST_DEVICE, tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True
    rng = np.random.default_rng(6)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    (ref,) = ort_run(model, feeds)
    tol = 1e-5 if precision == "fp32" else 1e-2
    np.testing.assert_allclose(cm.run(feeds)["out"], ref, rtol=tol, atol=tol)
    return cm


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("fill", [0.0, 0.5])
def test_a_gemm_loads_its_a_rows_through_a_window_partition(fill: float, precision: str) -> None:
    """The GEMM loads each row of A from its token of the Sigmoid's output, a padded token's row
    the Pad's value: the Pad runs no kernel and the runtime copies nothing."""
    cm = _gemm_reads_the_windows(partitioned_windows(fill), precision)
    assert [s.op_type or s.kind for s in cm.plan.steps if s.launches] == ["Sigmoid", "kernel"]
    (group,) = cm.report["fusion"]["groups"]
    assert group["rule"].endswith("+pad_gather"), group
    (kernel,) = cm.plan.kernels.values()
    assert kernel.inputs[0] == "s"  # the Sigmoid's output itself
    assert view_copies(cm.plan) == 0


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_gemm_loads_a_window_partition_without_a_pad(precision: str) -> None:
    """Whole windows, no Pad: the Reshape of the permuted windows was a copy the runtime made."""
    cm = _gemm_reads_the_windows(partitioned_windows(0.0, pad=False), precision)
    (kernel,) = cm.plan.kernels.values()
    assert kernel.inputs[0] == "s"
    assert view_copies(cm.plan) == 0


def test_a_chain_that_moves_k_is_not_an_index_map_of_a() -> None:
    """Channels moved off A's last axis (a Transpose of K): the GEMM's rows are no rows of the
    buffer behind, so the Pad keeps its kernel and the GEMM reads its output."""
    model = tiny_model(
        [
            n("Pad", ["x", "pads"], ["p"]),
            n("Transpose", ["p"], ["a"], perm=[1, 0]),
            n("MatMul", ["a", "w"], ["out"]),
        ],
        {"x": [6, 5]},
        {"out": [6, 4]},
        {
            "pads": np.array([0, 1, 0, 0]),
            "w": np.random.default_rng(2).standard_normal((6, 4)).astype(np.float32),
        },
    )
    cm = _gemm_reads_the_windows(model, "fp32")
    assert "Pad" in [s.op_type for s in cm.plan.steps if s.launches]


def test_an_index_maps_rows_drop_the_last_axis_only_where_no_step_touches_it() -> None:
    from opfuse.ir.index_map import IndexMap, IndexStep

    pad = IndexStep("pad", (1, 5, 5, 8), (1, 6, 6, 8), begins=(0, 1, 0, 0), value=0.5)
    flat = IndexStep("reshape", (1, 6, 6, 8), (36, 8))
    rows = IndexMap("s", (1, 5, 5, 8), (36, 8), (flat, pad)).rows()
    assert rows == IndexMap(
        "s",
        (1, 5, 5),
        (36,),
        (
            IndexStep("reshape", (1, 6, 6), (36,)),
            IndexStep("pad", (1, 5, 5), (1, 6, 6), begins=(0, 1, 0), value=0.5),
        ),
    )
    touched = [
        IndexStep("pad", (2, 7), (2, 8), begins=(0, 1)),  # the last axis padded
        IndexStep("transpose", (8, 2), (2, 8), perm=(1, 0)),  # moved
        IndexStep("slice", (2, 16), (2, 8), starts=(0, 0), steps=(1, 2)),  # sliced
        IndexStep("reshape", (4, 4), (2, 8)),  # regrouped
        IndexStep("gather", (2, 5), (2, 8), axis=1, table="t", index_shape=(8,)),  # gathered
    ]
    for step in touched:
        assert IndexMap("s", step.in_shape, (2, 8), (step,)).rows() is None, step.op
