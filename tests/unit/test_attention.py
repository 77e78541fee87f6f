"""Flash attention: the score matrix, softmax and head split/merge in one kernel."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.builders import TEST_DEVICE
from tests.unit.test_fusion import check_against_ort

RNG = np.random.default_rng(3)
B, S, H, D = 2, 24, 3, 16


def _attention_model(mask: str = "", scale_where: str = "qk", nan_guard: bool = False) -> onnx.ModelProto:
    """Self-attention as exporters write it: projections, head split, scores, softmax, head merge."""
    hd = H * D
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "wq"], ["q0"]),
        n("MatMul", ["x", "wk"], ["k0"]),
        n("MatMul", ["x", "wv"], ["v0"]),
        n("Reshape", ["q0", "split"], ["q1"]),
        n("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        n("Reshape", ["k0", "split"], ["k1"]),
        n("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
        n("Reshape", ["v0", "split"], ["v1"]),
        n("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
    ]
    inits = {
        "wq": RNG.standard_normal((hd, hd)) * 0.2,
        "wk": RNG.standard_normal((hd, hd)) * 0.2,
        "wv": RNG.standard_normal((hd, hd)) * 0.2,
        "c": np.array(D**-0.25),
        "full": np.array(float(np.sqrt(D))),
    }
    ints = {"split": np.array([B, S, H, D], dtype=np.int64), "merge": np.array([B, S, hd], dtype=np.int64)}
    if scale_where == "qk":
        nodes += [
            n("Mul", ["q", "c"], ["qs"]),
            n("Mul", ["kt", "c"], ["ks"]),
            n("MatMul", ["qs", "ks"], ["s0"]),
        ]
        last = "s0"
    else:
        nodes += [n("MatMul", ["q", "kt"], ["s"]), n("Div", ["s", "full"], ["s0"])]
        last = "s0"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, hd])]
    bools: dict[str, np.ndarray] = {}
    if mask == "add":
        inputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, [B, 1, 1, S]))
        nodes.append(n("Add", [last, "m"], ["s1"]))
        last = "s1"
    elif mask == "causal":
        bools["keep"] = np.tril(np.ones((S, S), dtype=bool))[None, None]
        inits["neg"] = np.array(-np.inf)
        nodes.append(n("Where", ["keep", last, "neg"], ["s1"]))
        last = "s1"
    elif mask == "filled":  # DeBERTa's masked_fill(mask, min): the fill first
        bools["masked"] = ~np.tril(np.ones((S, S), dtype=bool))
        inits["low"] = np.array(np.finfo(np.float32).min)
        nodes.append(n("Where", ["masked", "low", last], ["s1"]))
        last = "s1"
    nodes.append(n("Softmax", [last], ["p"], axis=-1))
    if nan_guard:
        inits["zero"] = np.array(0.0)
        nodes += [n("IsNaN", ["p"], ["isnan"]), n("Where", ["isnan", "zero", "p"], ["pg"])]
        probs = "pg"
    else:
        probs = "p"
    nodes += [
        n("MatMul", [probs, "v"], ["o"]),
        n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ot", "merge"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, hd])],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()]
        + [numpy_helper.from_array(v, k) for k, v in {**ints, **bools}.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _shapes(mask: str) -> dict[str, list[int]]:
    return {"x": [B, S, H * D], **({"m": [B, 1, 1, S]} if mask == "add" else {})}


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_exported_self_attention_is_one_kernel(precision: str) -> None:
    m = _attention_model()
    cm = check_against_ort(m, _shapes(""), "fp32" if precision == "fp32" else "fp16")
    if precision == "bf16":
        from opfuse.compiler import compile as opfuse_compile

        cm = opfuse_compile(m, _shapes(""), precision="bf16", device=TEST_DEVICE)
        assert cm.report["verification"]["passed"] and not cm.report["verification"]["rolled_back"]
    groups = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "attention"]
    assert len(groups) == 1
    # The three projections merged into one GEMM, then one kernel: no Reshape/Transpose copies,
    # no score matrix; the kernel reads Q, K and V at their offsets in the merged projection.
    assert cm.report["fusion"]["passes"]["fired"].get("merge_projections") == 1
    assert [s.op_type or "kernel" for s in cm.plan.steps] == ["MatMul", "kernel"]
    (k,) = cm.plan.kernels.values()
    assert k.kind == "attention" and len(set(k.inputs)) == 1 and k.outputs == ["y"]


@pytest.mark.parametrize(
    "mask, scale_where, guard", [("add", "div", False), ("causal", "qk", True), ("causal", "div", False)]
)
def test_masked_and_causal_attention(mask: str, scale_where: str, guard: bool) -> None:
    m = _attention_model(mask, scale_where, guard)
    cm = check_against_ort(m, _shapes(mask))
    assert cm.report["kernels"]["after"] == 2
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "attention"]
    assert ("tl.where(keep != 0" in k.source) == (mask == "causal")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_scores_filled_where_masked_are_one_kernel(precision: str) -> None:
    """Where(mask, min, scores), the fill first: `where_fill_last` negates the constant mask, and
    the attention kernel computes it (projections, then one kernel), every element as
    onnxruntime's."""
    m = _attention_model("filled", "div")
    cm = check_against_ort(m, _shapes("filled"), precision)
    assert cm.report["fusion"]["passes"]["fired"].get("where_fill_last") == 1
    assert cm.report["kernels"]["after"] == 2
    # The projections' GEMM is the library's or (tuned on a GPU) its template: a kernel then too.
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "attention"]
    assert "tl.where(" in k.source


def test_softmax_over_another_axis_is_not_attention() -> None:
    m = _attention_model()
    for node in m.graph.node:
        if node.op_type == "Softmax":
            node.attribute[0].i = 2
    cm = check_against_ort(m, _shapes(""))
    assert not [g for g in cm.report["fusion"]["groups"] if g["kind"] == "attention"]
    assert any(
        nf["rule"] == "attention" and "last axis" in nf["reason"] for nf in cm.report["fusion"]["not_fused"]
    )


def test_views_through_reshape_chains_and_split() -> None:
    """GPT-2 style: one QKV projection split in three, heads split by Reshape/Transpose chains."""
    from opfuse.fusion.views import view_strides

    assert view_strides((2, 3, 4), (12, 4, 1), (6, 4)) == (4, 1)
    assert view_strides((2, 4, 3), (12, 1, 4), (8, 3)) is None  # transposed: a copy is needed
    assert view_strides((4, 6), (1, 4), (4, 2, 3)) == (1, 12, 4)

    n = helper.make_node
    hd = H * D
    nodes = [
        n("MatMul", ["x", "wqkv"], ["qkv"]),
        n("Split", ["qkv"], ["q0", "k0", "v0"], axis=2, num_outputs=3),
        n("Reshape", ["q0", "split"], ["q1"]),
        n("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        n("Reshape", ["k0", "split"], ["k1"]),
        n("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
        n("Reshape", ["v0", "split"], ["v1"]),
        n("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        n("MatMul", ["q", "kt"], ["s"]),
        n("Mul", ["s", "c"], ["s1"]),
        n("Softmax", ["s1"], ["p"], axis=-1),
        n("MatMul", ["p", "v"], ["o"]),
        n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ot", "merge"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qkv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, hd])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, hd])],
        initializer=[
            numpy_helper.from_array((RNG.standard_normal((hd, 3 * hd)) * 0.2).astype(np.float32), "wqkv"),
            numpy_helper.from_array(np.array(D**-0.5, dtype=np.float32), "c"),
            numpy_helper.from_array(np.array([B, S, H, D], dtype=np.int64), "split"),
            numpy_helper.from_array(np.array([B, S, hd], dtype=np.int64), "merge"),
        ],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    cm = check_against_ort(m, {"x": [B, S, hd]})
    assert [s.op_type or "kernel" for s in cm.plan.steps] == ["MatMul", "kernel"]
    (k,) = cm.plan.kernels.values()
    assert (
        k.inputs == ["qkv", "qkv", "qkv"]
        and f"k_ok, {hd} + b" in k.source
        and f"v_ok, {2 * hd} + b" in k.source
    )


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_attention_at_the_zoo_head_dims(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """BERT/ViT/GPT-2 (64), 80, and LLaMA-style (128) heads, causal, a sequence that is no power
    of two (partial tiles, as ViT's 197): one kernel, equal to onnxruntime in fp16."""
    import sys

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "B", 1)
    monkeypatch.setattr(module, "H", 2)
    monkeypatch.setattr(module, "D", head_dim)
    m = _attention_model(mask="causal", scale_where="div")
    cm = check_against_ort(m, _shapes("causal"), "fp16")
    assert [g["kind"] for g in cm.report["fusion"]["groups"]].count("attention") == 1
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "attention"]
    assert str(head_dim) in k.source


def _batched_heads_attention(mask_shape: list[int], out_shape: list[int] | None = None) -> onnx.ModelProto:
    """Attention over [B·H, S, D] (heads folded into the batch, as timm's BottleneckAttn and
    HaloAttn write it) with logits of `mask_shape` added to the scores: relative-position logits
    differ per batch entry."""
    n = helper.make_node
    bh = B * H
    nodes = [
        n("MatMul", ["q", "kt"], ["s"]),
        n("Mul", ["s", "c"], ["s0"]),
        n("Add", ["s0", "m"], ["s1"]),
        n("Softmax", ["s1"], ["p"], axis=-1),
        n("MatMul", ["p", "v"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [bh, S, D]),
        helper.make_tensor_value_info("kt", TensorProto.FLOAT, [bh, D, S]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [bh, S, D]),
        helper.make_tensor_value_info("m", TensorProto.FLOAT, mask_shape),
    ]
    graph = helper.make_graph(
        nodes,
        "batched_heads",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape or [bh, S, D])],
        initializer=[numpy_helper.from_array(np.array(D**-0.5, dtype=np.float32), "c")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("mask_shape", [[B * H, S, S], [B * H, 1, S], [S, S]])
def test_rank3_attention_reads_the_mask_of_each_batch_entry(mask_shape: list[int]) -> None:
    """A rank-3 mask of rank-3 scores is indexed by the batch entry (it was read as if per head,
    so every entry got entry 0's logits and verification rolled the group back)."""
    m = _batched_heads_attention(mask_shape)
    bh = B * H
    cm = check_against_ort(m, {"q": [bh, S, D], "kt": [bh, D, S], "v": [bh, S, D], "m": mask_shape})
    assert [g["kind"] for g in cm.report["fusion"]["groups"]] == ["attention"]
    assert not cm.report["verification"]["rolled_back"]


def test_a_mask_that_enlarges_the_scores_is_refused() -> None:
    bh = B * H
    m = _batched_heads_attention([2, bh, S, S], [2, bh, S, D])
    cm = check_against_ort(m, {"q": [bh, S, D], "kt": [bh, D, S], "v": [bh, S, D], "m": [2, bh, S, S]})
    assert not [g for g in cm.report["fusion"]["groups"] if g["kind"] == "attention"]
    assert any(
        nf["rule"] == "attention" and "larger shape" in nf["reason"]
        for nf in cm.report["fusion"]["not_fused"]
    )
