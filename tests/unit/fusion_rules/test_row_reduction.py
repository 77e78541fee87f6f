"""`row_reduction` (opfuse/fusion/rules/row_reduction.py) on a tiny graph: bias, Softmax, scale;
a Softmax of a broadcast row joining the rows that read it (contiguous and strided rows)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import opfuse
from opfuse.frontend import rule_registry as names
from tests.builders import TEST_DEVICE, assert_every_config, claimed, planned, refusals, tiny_model, weights


def softmax_row(length: int) -> object:
    n = helper.make_node
    return tiny_model(
        [
            n("Add", ["x", "b"], ["h"], name="bias"),
            n("Softmax", ["h"], ["p"], name="softmax", axis=-1),
            n("Mul", ["p", "c"], ["y"], name="scale"),
        ],
        {"x": [4, length]},
        {"y": [4, length]},
        {"b": weights(length), "c": weights(length, seed=1)},
    )


def test_the_reduction_takes_its_prologue_and_epilogue() -> None:
    _, plan = planned(softmax_row(16))
    assert claimed(plan) == [("rowwise", names.ROW_REDUCTION, ["bias", "softmax", "scale"])]
    assert plan.groups[0].full == (4, 16) and plan.groups[0].split == 1


def test_a_row_too_long_for_one_program_is_refused() -> None:
    _, plan = planned(softmax_row(20000))
    assert refusals(plan, names.ROW_REDUCTION) == [
        (["softmax"], "a row of 20000 elements does not fit one program (limit 16384)")
    ]
    assert all(kind != "rowwise" for kind, _, _ in claimed(plan))


# A row group over a broadcast of another's rows joins it: MobileViT V2's separable attention,
# a Softmax of the query per patch [B, 1, P, N] that every channel's row [B, C, P, N] reads.


def separable_attention(also_out: bool = False, q_axis: int = 3) -> object:
    """ctx = sum_n(k * softmax(q, axis n)); y = relu(v) * ctx: q [2, 1, 3, 10], k and v [2, 6, 3,
    10]. `also_out`: the scores are an output too; `q_axis`: the Softmax's axis (2: not the
    rows' axis of the sum)."""
    nodes = [
        helper.make_node("Softmax", ["q"], ["s"], name="softmax", axis=q_axis),
        helper.make_node("Mul", ["k", "s"], ["ks"], name="weigh"),
        helper.make_node("ReduceSum", ["ks", "axes"], ["ctx"], name="sum", keepdims=1),
        helper.make_node("Relu", ["v"], ["rv"], name="relu"),
        helper.make_node("Mul", ["rv", "ctx"], ["y"], name="apply"),
    ]
    outputs = {"y": [2, 6, 3, 10]}
    if also_out:
        outputs["s"] = [2, 1, 3, 10]
    inputs = {"q": [2, 1, 3, 10], "k": [2, 6, 3, 10], "v": [2, 6, 3, 10]}
    return tiny_model(nodes, inputs, outputs, {"axes": np.array([3])}, opset=18)


def test_a_softmax_of_a_broadcast_row_joins_the_rows_that_read_it() -> None:
    _, plan = planned(separable_attention())
    assert claimed(plan) == [("rowwise", names.ROW_REDUCTION, ["softmax", "weigh", "sum", "relu", "apply"])]


@pytest.mark.parametrize(
    "model",
    [separable_attention(also_out=True), separable_attention(q_axis=2)],
    ids=["read_outside", "other_axis"],
)
def test_a_broadcast_row_group_read_elsewhere_or_over_other_axes_stays(model: object) -> None:
    _, plan = planned(model)
    groups = [nodes for _, _, nodes in claimed(plan)]
    assert ["softmax"] in groups and not any("softmax" in g and len(g) > 1 for g in groups)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_joined_softmax_computes_what_onnxruntime_does(precision: str) -> None:
    """Every element of every output against onnxruntime, at the row kernel's config and each
    tuning candidate's: one kernel."""
    model = separable_attention()
    shapes = {"q": [2, 1, 3, 10], "k": [2, 6, 3, 10], "v": [2, 6, 3, 10]}
    cm = opfuse.compile(model, input_shapes=shapes, precision=precision, device=TEST_DEVICE, tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True
    (k,) = cm.plan.kernels.values()
    assert sum(1 for s in cm.plan.steps if s.launches) == 1
    assert_every_config(cm, model, k, shapes, precision, seed=6)


def split_attention(views: bool) -> object:
    """ResNeSt's split attention: x [B, radix, C, H, W] weighed by a Softmax over the radix of a
    per-channel [B, radix, C, 1, 1] and summed over the radix: strided rows (radix apart) on both
    sides. `views`: the Softmax between the exporter's views ([B, 1, radix, C] transposed to
    [B, radix, 1, C], then viewed as [B, radix, C, 1, 1])."""
    n = helper.make_node
    if views:
        nodes = [
            n("Transpose", ["a"], ["at"], name="perm", perm=[0, 2, 1, 3]),
            n("Softmax", ["at"], ["s"], name="softmax", axis=1),
            n("Reshape", ["s", "shape"], ["sr"], name="view"),
        ]
        inputs = {"a": [2, 1, 2, 5], "x": [2, 2, 5, 3, 3]}
        inits = {"shape": np.array([2, 2, 5, 1, 1]), "axes": np.array([1])}
    else:
        nodes = [n("Softmax", ["a"], ["sr"], name="softmax", axis=1)]
        inputs = {"a": [2, 2, 5, 1, 1], "x": [2, 2, 5, 3, 3]}
        inits = {"axes": np.array([1])}
    nodes += [
        n("Mul", ["x", "sr"], ["m"], name="weigh"),
        n("ReduceSum", ["m", "axes"], ["y"], name="sum", keepdims=0),
    ]
    return tiny_model(nodes, inputs, {"y": [2, 5, 3, 3]}, inits, opset=18)


@pytest.mark.parametrize("views", [False, True])
def test_a_softmax_of_broadcast_strided_rows_joins_the_sum_that_reads_it(views: bool) -> None:
    _, plan = planned(split_attention(views))
    assert claimed(plan) == [("rowwise", names.ROW_REDUCTION, ["softmax", "weigh", "sum"])]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_joined_radix_softmax_computes_what_onnxruntime_does(precision: str) -> None:
    model = split_attention(views=True)
    shapes = {"a": [2, 1, 2, 5], "x": [2, 2, 5, 3, 3]}
    cm = opfuse.compile(model, input_shapes=shapes, precision=precision, device=TEST_DEVICE, tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True
    (k,) = cm.plan.kernels.values()
    assert sum(1 for s in cm.plan.steps if s.launches) == 1
    assert_every_config(cm, model, k, shapes, precision, seed=7)


def test_a_row_kernel_whose_output_is_a_concat_part_is_no_broadcast() -> None:
    """PVT's last stage at a small input: one patch, LayerNorm [1, 1, C], then the class token
    concatenated before it ([1, 2, C]) and the next norm. The one-patch rows look like a broadcast
    of the two-token rows, but the Concat places them: the norm stays a kernel of its own, and the
    plan compiles and matches onnxruntime."""
    c = 16
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g1", "b1"], ["n1"], name="ln1", axis=-1),
        helper.make_node("Concat", ["cls", "n1"], ["t"], name="cat", axis=1),
        helper.make_node("Add", ["t", "pos"], ["s"], name="pos_add"),
        helper.make_node("LayerNormalization", ["s", "g2", "b2"], ["y"], name="ln2", axis=-1),
    ]
    inits = {
        "g1": 1.0 + weights(c, seed=1),
        "b1": weights(c, seed=2),
        "g2": 1.0 + weights(c, seed=3),
        "b2": weights(c, seed=4),
        "pos": weights(1, 2, c, seed=5),
    }
    model = tiny_model(nodes, {"x": [1, 1, c], "cls": [1, 1, c]}, {"y": [1, 2, c]}, inits, opset=18)
    _, plan = planned(model)
    assert ["ln1"] in [nodes for _, _, nodes in claimed(plan)]
    cm = opfuse.compile(model, device=TEST_DEVICE, tune_budget_s=0)
    rng = np.random.default_rng(8)
    feeds = {
        "x": rng.standard_normal([1, 1, c]).astype(np.float32),
        "cls": rng.standard_normal([1, 1, c]).astype(np.float32),
    }
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, feeds)
    np.testing.assert_allclose(np.asarray(cm.run(feeds)["y"]), want, rtol=1e-4, atol=1e-4)
