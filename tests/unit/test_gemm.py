"""GEMM template: MatMul/Gemm with its pointwise epilogue in one Triton kernel."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from opfuse.compiler import compile as opfuse_compile
from opfuse.frontend.load import load_and_specialize
from opfuse.fusion.planner import plan_fusion
from opfuse.graph import graph_from_onnx
from opfuse.lowering import build_plan
from opfuse.runtime.executor import Executor
from opfuse.runtime.ops import SUPPORTED_OPS
from tests.builders import TEST_DEVICE
from tests.unit.test_fusion import check_against_ort, make_model, ort_run

RNG = np.random.default_rng(11)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_linear_bias_relu_residual(precision: str) -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="linear"),
        helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
        helper.make_node("Relu", ["hb"], ["a"], name="act"),
        helper.make_node("Add", ["a", "res"], ["y"], name="residual"),
    ]
    m = make_model(
        nodes,
        {"x": [2, 5, 24], "res": [2, 5, 40]},
        {"y": [2, 5, 40]},
        {"w": RNG.standard_normal((24, 40)) * 0.2, "b": RNG.standard_normal(40)},
    )
    tol_precision = "fp16" if precision in ("fp16", "bf16") else "fp32"
    cm = check_against_ort(
        m, {"x": [2, 5, 24], "res": [2, 5, 40]}, tol_precision if precision != "bf16" else "fp16"
    )
    if precision != "fp32":
        cm = opfuse_compile(m, {"x": [2, 5, 24], "res": [2, 5, 40]}, precision=precision, device=TEST_DEVICE)
        assert cm.report["verification"]["passed"] is True
    assert cm.report["kernels"] == {"before": 4, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert k.kind == "gemm" and "tl.dot(" in k.source
    assert k.inputs[:2] == ["x", "w"]


def test_gemm_trans_b_alpha_beta_bias() -> None:
    nodes = [
        helper.make_node("Gemm", ["x", "w", "c"], ["g"], alpha=0.5, beta=2.0, transB=1),
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g", "s"], ["y"]),
    ]
    m = make_model(
        nodes,
        {"x": [7, 33]},
        {"y": [7, 19]},
        {"w": RNG.standard_normal((19, 33)) * 0.3, "c": RNG.standard_normal((1, 19))},
    )
    cm = check_against_ort(m, {"x": [7, 33]})
    assert cm.report["kernels"] == {"before": 3, "after": 1}


def test_a_batched_second_operand_takes_its_epilogue() -> None:
    nodes = [
        helper.make_node("MatMul", ["q", "k"], ["s"], name="scores"),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    m = make_model(nodes, {"q": [2, 4, 8], "k": [2, 8, 4]}, {"y": [2, 4, 4]})
    cm = check_against_ort(m, {"q": [2, 4, 8], "k": [2, 8, 4]})
    assert cm.report["kernels"] == {"before": 2, "after": 1}  # the batched form, with its Relu
    (k,) = cm.plan.kernels.values()
    assert "batched GEMM kernel" in k.source


def test_vendor_variant_computes_the_same() -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["y0"]),
        helper.make_node("Tanh", ["y0"], ["y"]),
    ]
    m = make_model(
        nodes,
        {"x": [6, 16]},
        {"y": [6, 16]},
        {"w": RNG.standard_normal((16, 16)) * 0.3, "b": RNG.standard_normal(16)},
    )
    cm = opfuse_compile(m, {"x": [6, 16]}, device=TEST_DEVICE)
    _, spec = load_and_specialize(m, {"x": [6, 16]}, SUPPORTED_OPS)
    graph = graph_from_onnx(spec)
    fusion = plan_fusion(graph)
    (g,) = fusion.groups
    vendor = build_plan(graph, fusion, "fp32", graph.inputs, graph.outputs, variants={g.id: "vendor"})
    assert [s.kind for s in vendor.steps] == ["op", "kernel"]
    x = RNG.standard_normal((6, 16)).astype(np.float32)
    np.testing.assert_allclose(
        Executor(vendor, TEST_DEVICE).run({"x": x})["y"], cm.run({"x": x})["y"], rtol=1e-5, atol=1e-6
    )


def test_epilogue_may_read_the_anchor_operand() -> None:
    # y = relu(x @ w + x): the residual is the GEMM's own input.
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "x"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    m = make_model(nodes, {"x": [5, 12]}, {"y": [5, 12]}, {"w": RNG.standard_normal((12, 12)) * 0.3})
    cm = check_against_ort(m, {"x": [5, 12]})
    assert cm.report["kernels"] == {"before": 3, "after": 1}


def test_flattened_linear_layer_becomes_matmul_with_fused_epilogue() -> None:
    # GPT-2 style: Reshape [B,S,K]->[B*S,K], Gemm(transB) + bias, Reshape back, then GELU (tanh form).
    from onnx import numpy_helper

    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("Gemm", ["x2", "w", "b"], ["g"], transB=1),
        helper.make_node("Reshape", ["g", "unflat"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Mul", ["h", "t"], ["y"]),
    ]
    m = make_model(
        nodes,
        {"x": [2, 5, 16]},
        {"y": [2, 5, 24]},
        {"w": RNG.standard_normal((24, 16)) * 0.3, "b": RNG.standard_normal(24)},
    )
    m.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([10, 16], dtype=np.int64), "flat"),
            numpy_helper.from_array(np.array([2, 5, 24], dtype=np.int64), "unflat"),
        ]
    )
    cm = check_against_ort(m, {"x": [2, 5, 16]})
    assert cm.report["fusion"]["passes"]["fired"].get("gemm_to_matmul") == 1
    assert cm.report["kernels"] == {"before": 3, "after": 1}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_gemm_reads_a_transposed_operand_through_strides(precision: str) -> None:
    """Heads split off a projection ([B, S, H*D] -> [B, H, S, D]) then multiplied: the GEMM reads
    the projection's buffer with strides instead of a copy made by the Transpose."""
    b, s, h, d = 2, 5, 3, 8
    nodes = [
        helper.make_node("Reshape", ["x", "split"], ["x4"]),
        helper.make_node("Transpose", ["x4"], ["xt"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["xt", "w"], ["p"]),
        helper.make_node("Add", ["p", "bias"], ["y"]),
    ]
    inits = {"w": RNG.standard_normal((d, 6)) * 0.3, "bias": RNG.standard_normal(6)}
    m = make_model(nodes, {"x": [b, s, h * d]}, {"y": [b, h, s, 6]}, inits)
    m.graph.initializer.append(numpy_helper.from_array(np.array([b, s, h, d], dtype=np.int64), "split"))
    for disable in ((), ("layout_views",)):
        cm = opfuse_compile(
            m, {"x": [b, s, h * d]}, precision=precision, device=TEST_DEVICE, fusion_disable=list(disable)
        )
        assert cm.report["verification"]["passed"] is True
        (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "gemm"]
        (k,) = cm.plan.kernels.values()
        if disable:
            assert "layout_folded" not in g and "folded layout op" not in k.source
        else:
            assert len(g["layout_folded"]) == 2  # the Reshape and the Transpose
            assert "folded layout op" in k.source and k.inputs[0] == "x"
        feeds = {"x": RNG.standard_normal((b, s, h * d)).astype(np.float32)}
        (ref,) = ort_run(m, feeds)
        tol = 1e-4 if precision == "fp32" else 2e-2
        np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("residual", [False, True])
def test_gemm_reads_a_operand_transposed_with_k_strided(precision: str, residual: bool) -> None:
    """gMLP's spatial projection: tokens transposed to the last axis ([B, S, C] -> [B, C, S]),
    then a Linear over them. A's K runs along the buffer's rows (stride C), its rows along the
    channels (stride 1): the GEMM reads x with those strides, no copy of the transposed value;
    with `residual` the epilogue reads A again at the output's index (N = K)."""
    b, s, c = 2, 12, 16
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["xt", "w"], ["p"]),
        helper.make_node("Add", ["p", "bias"], ["q"]),
        helper.make_node("Add" if residual else "Tanh", ["q", "xt"] if residual else ["q"], ["y"]),
    ]
    inits = {"w": RNG.standard_normal((s, s)) * 0.3, "bias": RNG.standard_normal(s)}
    m = make_model(nodes, {"x": [b, s, c]}, {"y": [b, c, s]}, inits)
    cm = opfuse_compile(m, {"x": [b, s, c]}, precision=precision, device=TEST_DEVICE, tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True
    (k,) = cm.plan.kernels.values()
    assert k.kind == "gemm" and k.inputs[0] == "x" and "folded layout op" in k.source
    assert f"kk[None, :] * {c}" in k.source
    assert [s.op_type or s.kind for s in cm.plan.steps if s.launches] == ["kernel"]
    feeds = {"x": RNG.standard_normal((b, s, c)).astype(np.float32)}
    (ref,) = ort_run(m, feeds)
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_linear_layer_after_a_head_merge_becomes_matmul(precision: str) -> None:
    """Attention's output projection as exported from nn.MultiheadAttention: heads merged by
    Reshape [B, S, H, D] -> [B*S, H*D], Gemm, Reshape -> [B, S, E]. The input takes the output's
    leading dims and the Gemm becomes a MatMul with its bias in the epilogue."""
    from onnx import numpy_helper

    b, s, h, d, e = 2, 5, 3, 4, 10
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("Gemm", ["x2", "w", "bias"], ["g"], transB=1),
        helper.make_node("Reshape", ["g", "unflat"], ["y"]),
    ]
    m = make_model(
        nodes,
        {"x": [b, s, h, d]},
        {"y": [b, s, e]},
        {"w": RNG.standard_normal((e, h * d)) * 0.3, "bias": RNG.standard_normal(e)},
    )
    m.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([b * s, h * d], dtype=np.int64), "flat"),
            numpy_helper.from_array(np.array([b, s, e], dtype=np.int64), "unflat"),
        ]
    )
    cm = check_against_ort(m, {"x": [b, s, h, d]}, precision=precision)
    assert cm.report["fusion"]["passes"]["fired"].get("gemm_to_matmul") == 1
    assert cm.report["kernels"] == {"before": 1, "after": 1}  # the reshapes are views
    assert [g["kind"] for g in cm.report["fusion"]["groups"]] == ["gemm"]  # bias in the epilogue


def classifier_head(
    n: int, c: int, size: int, classes: int, flatten: bool = True, epilogue: bool = False
) -> Any:
    """A CNN's head: Relu(x + r) (the last residual), global average pool, Flatten, Gemm (and a
    Sigmoid after it: `epilogue`)."""
    rng = np.random.default_rng(9)
    inits = {
        "w": rng.standard_normal((classes, c)) * 0.2,
        "b": rng.standard_normal(classes) * 0.1,
        "conv_w": rng.standard_normal((c, c, 1, 1)) * 0.3,
    }
    nodes = [
        helper.make_node("Conv", ["x", "conv_w"], ["cx"], name="conv"),
        helper.make_node("Add", ["cx", "r"], ["s"], name="residual"),
        helper.make_node("Relu", ["s"], ["a"], name="relu"),
    ]
    if flatten:
        nodes += [
            helper.make_node("GlobalAveragePool", ["a"], ["p"], name="pool"),
            helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        ]
    else:  # torchvision's ShuffleNet: x.mean([2, 3])
        inits["axes"] = np.array([2, 3])
        nodes.append(helper.make_node("ReduceMean", ["a", "axes"], ["f"], name="pool", keepdims=0))
    nodes.append(helper.make_node("Gemm", ["f", "w", "b"], ["g" if epilogue else "y"], name="fc", transB=1))
    if epilogue:
        nodes.append(helper.make_node("Sigmoid", ["g"], ["y"], name="act"))
    shape = [n, c, size, size]
    m = make_model(nodes, {"x": shape, "r": shape}, {"y": [n, classes]}, inits)
    if not flatten:
        m.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array([2, 3], np.int64), "axes"))
    return m


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("flatten, epilogue", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_the_global_pool_runs_on_the_classifier_gemms_a_tiles(
    precision: str, flatten: bool, epilogue: bool, layout: str
) -> None:
    """The head's pool (with the residual add and Relu before it) is computed on the GEMM's A
    tiles: one kernel for pool and classifier, at every tuning candidate, and its split form (the
    row kernel, then the library's GEMM as without the rule; the GEMM's template where an
    epilogue follows it) computes the same."""
    from bench.kernels import plan_model
    from opfuse.tuning.candidates import candidates
    from tests.unit.test_conv import check_every_candidate

    n, c, size, classes = 2, 24, 5, 40
    m = classifier_head(n, c, size, classes, flatten, epilogue)
    shapes = {"x": [n, c, size, size], "r": [n, c, size, size]}
    off = ("fp32_dense_nchw",) if layout == "nhwc" else ("channels_last",)
    cm = check_against_ort(m, shapes, precision, fusion_disable=off)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "gemm"]
    assert g["rule"] == "gemm_epilogue+pooled_gemm" and g["nodes"][:3] == ["residual", "relu", "pool"]
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "gemm"]
    assert "the pool computed on A's tiles" in k.source and "psum" in k.source
    assert not [s for s in cm.plan.steps if s.op_type in ("ReduceMean", "GlobalAveragePool")]
    rng = np.random.default_rng(3)
    feeds = {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}
    want = ort_run(m, feeds)[0]
    tol = 1e-4 if precision == "fp32" else 2e-2
    assert {c.get("BLOCK_P", k.config["BLOCK_P"]) for c in candidates(k)} >= {16, 32}
    check_every_candidate(cm, k, m, feeds, precision, [{"BLOCK_P": 4}])  # 25 pixels, steps of 4-32
    p = plan_model(m, shapes, precision, off)
    (pg,) = [x for x in p.fusion.groups if x.kind == "gemm"]
    split = build_plan(
        p.graph, p.fusion, precision, p.plan.inputs, p.plan.outputs, variants={pg.id: "vendor"}
    )
    steps = [s for s in split.steps if s.group == pg.id]
    kernels = [split.kernels[s.kernel].kind for s in steps if s.kind == "kernel"]
    ops = [s.op_type for s in steps if s.kind == "op"]
    if epilogue:
        assert kernels == ["rowwise", "gemm"] and ops == []
    else:  # the layout ops between the pool and the GEMM run as the library's, then its GEMM
        assert kernels == ["rowwise"] and ops[-1] == "Gemm"
        assert steps[0].kind == "kernel" and steps[-1].op_type == "Gemm"
    got = np.asarray(Executor(split, TEST_DEVICE).run(feeds)["y"], dtype=np.float32)
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < tol


@pytest.mark.parametrize("precision, epilogue", [("fp32", False), ("fp16", True)])
def test_a_gemv_shaped_gemm_splits_its_k_loop_and_is_right_at_every_split(
    precision: str, epilogue: bool
) -> None:
    """A classifier head at batch 1 (one row, K 1024 after the pool, 100 classes): its few column
    tiles try split-K, tiles of 16 rows by 32 or 64 columns, and at every candidate and at a split
    of 3 (uneven) the plan computes what onnxruntime does, and every tile's counter is back at 0
    after each run; the pool stays on the GEMM's A tiles."""
    from opfuse.tuning.candidates import candidates, split_k_candidates
    from tests.unit.test_conv import check_every_candidate

    n, c, size, classes = 1, 1024, 2, 100
    m = classifier_head(n, c, size, classes, True, epilogue)
    shapes = {"x": [n, c, size, size], "r": [n, c, size, size]}
    # tune_budget_s=0: the planned template at its starting config (on the GPU, tuning picks a split).
    cm = check_against_ort(m, shapes, precision, fusion_disable=("fp32_dense_nchw",), tune_budget_s=0)
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "gemm"]
    assert k.config["SPLIT_K"] == 1 and "tl.atomic_add(lock" in k.source and "psum" in k.source
    splits = split_k_candidates(k)
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in splits} == {(16, 32), (16, 64)}
    assert {c["SPLIT_K"] for c in splits} == {2, 4} and all(c in candidates(k) for c in splits)
    rng = np.random.default_rng(4)
    feeds = {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}
    odd = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3}
    check_every_candidate(cm, k, m, feeds, precision, [odd])
    ex = Executor(cm.plan, TEST_DEVICE)
    for config in [*splits, odd]:
        ex.configs[k.id] = {**k.config, **config}
        ex.run(feeds)
        assert all(int(lock.abs().sum()) == 0 for _, lock in ex.scratch.values()), config


def test_pooled_gemm_says_why_not() -> None:
    m = classifier_head(1, 8, 4, 6)
    shapes = {"x": [1, 8, 4, 4], "r": [1, 8, 4, 4]}
    cm = check_against_ort(m, shapes, fusion_disable=("pooled_gemm",))
    assert any(g["kind"] == "rowwise" for g in cm.report["fusion"]["groups"])
    # The pooled value also a graph output: the pool is written, and stays its own kernel.
    m.graph.output.append(helper.make_tensor_value_info("f", onnx.TensorProto.FLOAT, [1, 8]))
    cm = check_against_ort(m, shapes)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "pooled_gemm"]
    assert "read outside the GEMM" in nf["reason"]
    # Past 4 images each column tile of the GEMM would pool too much again.
    m = classifier_head(6, 8, 4, 6)
    cm = check_against_ort(m, {"x": [6, 8, 4, 4], "r": [6, 8, 4, 4]})
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "pooled_gemm"]
    assert "6 images (over 4)" in nf["reason"]


def _crossed_epilogues() -> onnx.ModelProto:
    """Two GEMMs whose epilogues read each other's intermediate through a third and fourth GEMM:
    ya = (x@wa + ba) + (x@wb + bb)@wd, yb = (x@wb + bb) + (x@wa + ba)@wc. Each epilogue group
    (MatMul, bias, sum) is convex alone; together each waits on the other (HRNet's fuse layers)."""
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["ma"]),
        helper.make_node("Add", ["ma", "ba"], ["a1"]),
        helper.make_node("MatMul", ["x", "wb"], ["mb"]),
        helper.make_node("Add", ["mb", "bb"], ["b1"]),
        helper.make_node("MatMul", ["a1", "wc"], ["ta"]),
        helper.make_node("MatMul", ["b1", "wd"], ["tb"]),
        helper.make_node("Add", ["a1", "tb"], ["ya"]),
        helper.make_node("Add", ["b1", "ta"], ["yb"]),
    ]
    consts = {k: RNG.standard_normal((16, 16)) * 0.3 for k in ("wa", "wb", "wc", "wd")}
    consts |= {"ba": RNG.standard_normal(16), "bb": RNG.standard_normal(16)}
    return make_model(nodes, {"x": [8, 16]}, {"ya": [8, 16], "yb": [8, 16]}, consts)


def test_groups_that_wait_on_each_other_are_cut_to_heads_that_do_not() -> None:
    """The planner keeps the first group whole and cuts the second to its MatMul and bias: the
    plan has an order, the cut nodes say why they run unfused, and the outputs match onnxruntime.
    Before, building the plan raised ("a cyclic plan") and both groups ran unfused as a codegen
    fault."""
    m = _crossed_epilogues()
    _, spec = load_and_specialize(m, {"x": [8, 16]}, SUPPORTED_OPS)
    fusion = plan_fusion(graph_from_onnx(spec))
    by_anchor = {g.nodes[0].outputs[0]: [n.outputs[0] for n in g.nodes] for g in fusion.groups}
    assert by_anchor["ma"] == ["ma", "a1", "ya"] and by_anchor["mb"] == ["mb", "b1"], by_anchor
    cut = [n for n in fusion.not_fused if "form a cycle" in n.reason]
    assert len(cut) == 1 and len(cut[0].nodes) == 1 and "epilogue run unfused" in cut[0].reason, cut
    cm = check_against_ort(m, {"x": [8, 16]})
    assert not any("raised" in n["reason"] for n in cm.report["fusion"]["not_fused"]), cm.report["fusion"]
    assert cm.report["kernels"]["after"] < cm.report["kernels"]["before"]
