"""Squeeze-excitation after a dense conv, its pool computed on the tiles of the GEMVs that read it
(opfuse/fusion/rules/pooled_gemm.py): the MLP of two 1x1 convs (a chain, SE-ResNet's and
RegNetY's) or one (ESE, VoVNet's and RDNet's), the pool's activation handed back to the conv's
epilogue where the scale reads it too. Compiled (Triton's interpreter on the CPU) and checked
against onnxruntime, every output element; the pooled kernel at every tuning candidate, and the
split form tuning times it against."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.lowering import build_plan
from opfuse.runtime.executor import Executor
from tests.builders import TEST_DEVICE, claimed, excitation_block, planned, refusals, tiny_model, weights
from tests.unit.test_conv import check_every_candidate
from tests.unit.test_fusion import check_against_ort, ort_run

C, SIZE = 24, 5


@pytest.mark.parametrize("pool", ["ReduceMean", "GlobalAveragePool"])
def test_the_se_mlp_pools_its_input_and_the_conv_stores_the_activation(pool: str) -> None:
    _, plan = planned(excitation_block(2, "two", pool))
    assert sorted(claimed(plan)) == [
        ("chain", f"{names.GEMV_CHAIN}+{names.POOLED_GEMM}", ["pool", "fc1", "fc1_act", "fc2", "gate"]),
        ("conv", names.CONV_EPILOGUE, ["conv", "act"]),  # handed back by the row kernel
        ("pointwise", names.POINTWISE, ["scale", "residual", "out"]),
    ]
    # Without the rule, the row kernel computes the conv on its tiles (gemm_reduction), the
    # activation and the mean, storing the activation the Mul reads; with neither, the conv alone.
    _, off = planned(excitation_block(2, "two", pool), (names.POOLED_GEMM,))
    rule = f"{names.ROW_REDUCTION}+{names.GEMM_REDUCTION}"
    assert ("rowwise", rule, ["conv", "act", "pool"]) in claimed(off)
    _, off = planned(excitation_block(2, "two", pool), (names.POOLED_GEMM, names.GEMM_REDUCTION))
    assert ("rowwise", names.ROW_REDUCTION, ["act", "pool"]) in claimed(off)
    assert ("conv", names.CONV_EPILOGUE, ["conv"]) in claimed(off)


def test_a_single_gemv_is_computed_by_the_gemm_template_on_the_pooled_tiles() -> None:
    _, plan = planned(excitation_block(1, "one"))
    assert ("gemm", f"{names.CONV_EPILOGUE}+{names.POOLED_GEMM}", ["pool", "fc", "gate"]) in claimed(plan)
    assert not [g for g in plan.groups if g.kind == "rowwise"]


def test_more_images_than_the_gemv_rows_keep_the_row_kernel() -> None:
    _, plan = planned(excitation_block(6, "two"))
    assert refusals(plan, names.POOLED_GEMM) == [
        (["pool", "fc1"], "6 images (over 4): each of the GEMM's column tiles would pool them all again")
    ]
    # Nothing was handed back: the row kernel still stores the activation beside the mean.
    assert ("rowwise", names.ROW_REDUCTION, ["act", "pool"]) in claimed(plan)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("mlp", ["two", "one"])
def test_the_pooled_excitation_computes_the_model(mlp: str, precision: str) -> None:
    from bench.kernels import plan_model

    images = 2
    m = excitation_block(images, mlp)
    shapes = {"x": [images, C, SIZE, SIZE]}
    cm = check_against_ort(m, shapes, precision)
    kind = "chain" if mlp == "two" else "gemm"
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == kind]
    assert "psum" in k.source and "BLOCK_P" in k.config
    # The conv with its activation, the pooled MLP, the scale with the residual.
    assert cm.report["kernels"]["after"] == 3
    assert not [s for s in cm.plan.steps if s.op_type == "ReduceMean"]
    feeds = {"x": np.random.default_rng(7).standard_normal(shapes["x"]).astype(np.float32)}
    check_every_candidate(cm, k, m, feeds, precision, [{"BLOCK_P": 4}])  # 25 pixels, steps of 4-32
    # The split form tuning times it against: the pool's row kernel, then the MLP's kernel.
    p = plan_model(m, shapes, precision)
    (g,) = [x for x in p.fusion.groups if x.kind == kind]
    split = build_plan(p.graph, p.fusion, precision, p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    assert [split.kernels[s.kernel].kind for s in split.steps if s.group == g.id] == ["rowwise", kind]
    got = np.asarray(Executor(split, TEST_DEVICE).run(feeds)["y"], dtype=np.float32)
    want = ort_run(m, feeds)[0]
    tol = 1e-4 if precision == "fp32" else 2e-2
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < tol


def test_the_chain_pools_a_channels_first_input() -> None:
    """With the channels-last pass off the pool is over the last two axes of [N, C, H, W]; the
    chain reads its channels at stride H*W."""
    m = excitation_block(2, "two")
    cm = check_against_ort(m, {"x": [2, C, SIZE, SIZE]}, fusion_disable=("channels_last",))
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "chain"]
    assert g["nodes"][0] == "pool"


def split_attention(images: int = 2, c: int = 16, size: int = 5) -> onnx.ModelProto:
    """ResNeSt's split attention, its radix sum over a 5-D view (which stays channels-first):
    the mean over the pixels of that sum feeds the MLP through the [N, 1, 1, C] twin the
    channels-last convs read, a Transpose of axes of 1."""
    n = helper.make_node
    inits = {
        "w": weights(2 * c, c, 3, 3),
        "radix": np.array([images, 2, c, size, size]),
        "axis": np.array([1]),
        "axes": np.array([2, 3]),
        "w1": weights(8, c, 1, 1, seed=2),
        "b1": weights(8, seed=3),
        "w2": weights(2 * c, 8, 1, 1, seed=4),
        "b2": weights(2 * c, seed=5),
    }
    nodes = [
        n("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        n("Relu", ["c"], ["a"], name="act"),
        n("Reshape", ["a", "radix"], ["parts"], name="parts"),
        n("ReduceSum", ["parts", "axis"], ["s"], name="sum", keepdims=0),
        n("ReduceMean", ["s", "axes"], ["p"], name="pool", keepdims=1),
        n("Conv", ["p", "w1", "b1"], ["h"], name="fc1"),
        n("Relu", ["h"], ["hr"], name="fc1_act"),
        n("Conv", ["hr", "w2", "b2"], ["y"], name="fc2"),
    ]
    return tiny_model(nodes, {"x": [images, c, size, size]}, {"y": [images, 2 * c, 1, 1]}, inits)


def test_the_pool_reaches_the_chain_through_its_channels_last_twin() -> None:
    from bench.kernels import plan_model

    m, shapes = split_attention(), {"x": [2, 16, 5, 5]}
    _, plan = planned(m)
    (chain,) = [g for g in plan.groups if g.kind == "chain"]
    assert [n.name for n in chain.prologue] == ["pool"] and names.POOLED_GEMM in chain.rule
    assert [n.op_type for n in chain.absorbed] == ["Transpose"]  # the twin is never written
    cm = check_against_ort(m, shapes)
    # Neither the mean nor its twin is a step (the model's own edge transposes are).
    assert not [s for s in cm.plan.steps if s.op_type == "ReduceMean" or "p" in s.inputs]
    p = plan_model(m, shapes, "fp32")
    (g,) = [x for x in p.fusion.groups if x.kind == "chain"]
    split = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    assert [
        (s.kernel and split.kernels[s.kernel].kind) or s.op_type for s in split.steps if s.group == g.id
    ] == [
        "rowwise",
        "Transpose",
        "chain",
    ]
    feeds = {"x": np.random.default_rng(7).standard_normal(shapes["x"]).astype(np.float32)}
    got = np.asarray(Executor(split, TEST_DEVICE).run(feeds)["y"], dtype=np.float32)
    want = ort_run(m, feeds)[0]
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-4
