"""`concat_prologue` (opfuse/fusion/rules/concat_prologue.py): DenseNet's pre-activation layer,
relu(bn(cat(features))) -> 1x1 conv, is one kernel whose K loop reads the Concat's inputs in turn
and activates each tile."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals
from tests.unit.test_conv import check_every_candidate
from tests.unit.test_fusion import NHWC_ALWAYS, check_against_ort, make_model, ort_run

RNG = np.random.default_rng(41)
RULE = f"{names.CONV_EPILOGUE}+{names.CONCAT_PROLOGUE}"


def _bn(name: str, x: str, y: str, c: int, inits: dict[str, np.ndarray]) -> Any:
    """An inference BatchNormalization with calibrated statistics (scale ~1, variance ~1)."""
    inits[f"{name}_s"] = RNG.uniform(0.5, 1.5, c)
    inits[f"{name}_b"] = RNG.standard_normal(c) * 0.2
    inits[f"{name}_m"] = RNG.standard_normal(c) * 0.2
    inits[f"{name}_v"] = RNG.uniform(0.5, 1.5, c)
    return helper.make_node(
        "BatchNormalization", [x, f"{name}_s", f"{name}_b", f"{name}_m", f"{name}_v"], [y], name=name
    )


def dense_block(c0: int = 24, growth: int = 16, width: int = 32, size: int = 6, second: str = "1x1") -> Any:
    """Two DenseNet layers on x [2, c0, size, size]: f1 = conv3x3(x); layer 1 reads cat(x, f1)
    through BN + ReLU into a 1x1 conv (+ ReLU), then a 3x3 conv gives f2; layer 2 reads
    cat(x, f1, f2) the same way into `second` (a 1x1 conv, or a 3x3 one: not the rule's)."""
    n = helper.make_node
    c1, c2 = c0 + growth, c0 + 2 * growth
    k = (3, 3) if second == "3x3" else (1, 1)
    inits = {
        "w1": RNG.standard_normal((growth, c0, 3, 3)) / (3 * c0**0.5),
        "wa": RNG.standard_normal((width, c1, 1, 1)) / c1**0.5,
        "ba": RNG.standard_normal(width) * 0.1,
        "w2": RNG.standard_normal((growth, width, 3, 3)) / (3 * width**0.5),
        "wb": RNG.standard_normal((width, c2, *k)) / (k[0] * c2**0.5),
    }
    nodes = [
        n("Conv", ["x", "w1"], ["f1"], pads=[1] * 4, name="conv1"),
        n("Concat", ["x", "f1"], ["c1"], axis=1, name="cat1"),
        _bn("bn1", "c1", "n1", c1, inits),
        n("Relu", ["n1"], ["r1"], name="relu1"),
        n("Conv", ["r1", "wa", "ba"], ["h1"], name="conv_a"),
        n("Relu", ["h1"], ["hr"], name="relu_a"),
        n("Conv", ["hr", "w2"], ["f2"], pads=[1] * 4, name="conv2"),
        n("Concat", ["x", "f1", "f2"], ["c2"], axis=1, name="cat2"),
        _bn("bn2", "c2", "n2", c2, inits),
        n("Relu", ["n2"], ["r2"], name="relu2"),
        n("Conv", ["r2", "wb"], ["y"], name="conv_b", pads=[k[0] // 2] * 4),
    ]
    return make_model(nodes, {"x": [2, c0, size, size]}, {"y": [2, width, size, size]}, inits)


def test_each_layers_1x1_conv_takes_the_concat_and_its_activation() -> None:
    _, plan = planned(dense_block())
    mine = [g for g in claimed(plan) if g[1] == RULE]
    # batchnorm_to_affine made each BN a Mul and an Add (both named after it).
    assert mine == [
        ("conv", RULE, ["cat1", "bn1", "bn1", "relu1", "conv_a", "relu_a"]),
        ("conv", RULE, ["cat2", "bn2", "bn2", "relu2", "conv_b"]),
    ]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_dense_layer_is_its_two_convolutions(precision: str) -> None:
    """Four launches for two layers (each its 1x1 and 3x3 conv), where each Concat and its
    activation ran as a kernel of their own; every output element matches onnxruntime, at every
    tuning candidate of the kernel reading three Concat inputs, and at a K block wider than the
    narrowest input (its lanes past that input's channels masked)."""
    model = dense_block()
    cm = check_against_ort(model, {"x": [2, 24, 6, 6]}, precision, NHWC_ALWAYS, tune_budget_s=0)
    assert cm.report["kernels"]["after"] == 4
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type in ("Concat", "Mul", "Add", "Relu")]
    (k,) = [k for k in cm.plan.kernels.values() if "xp2" in k.source]
    assert k.source.count("for c0 in range(") == 3 and k.config["BLOCK_K"] == 16
    # Each input's channels read at its offset in the Concat: the BN constants and weight rows.
    assert (
        "(c_ok, 24 + ci, 0)" in k.source
        and "(c_ok, 40 + ci, 0)" in k.source
        and "+ 40 + ci[:, None]" in k.source
    )
    x = RNG.standard_normal((2, 24, 6, 6)).astype(np.float32)
    check_every_candidate(cm, k, model, {"x": x}, precision, [{"BLOCK_K": 32}])


def test_the_vendor_variant_runs_the_concat_and_its_activation_before_the_librarys_conv() -> None:
    """Tuning's alternative, as the plan without the rule: the Concat, the BN's Mul and Add and
    the Relu as one pointwise kernel, then the library's 1x1 conv; the same result as the one
    kernel. (Those four ops as library launches each lost to the one kernel on the H200 where the
    plan without the rule won: densenet121 1.29x torch.compile with them, 0.95x without the rule.)"""
    from bench.kernels import plan_model
    from opfuse.codegen.registry import split_form
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor
    from tests.builders import TEST_DEVICE

    model = dense_block()
    p = plan_model(model, {"x": [2, 24, 6, 6]}, "fp32", NHWC_ALWAYS)
    (g,) = [g for g in p.fusion.groups if g.rule == RULE and g.nodes[0].name == "conv_b"]
    vendor = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    mine = [s.op_type or "kernel" for s in vendor.steps if s.group == g.id and s.launches]
    assert mine == ["kernel", "opfuse.ConvNHWC"]
    assert split_form(g) == "split: the prologue's kernel, the library's conv, the epilogue's kernel"
    x = RNG.standard_normal((2, 24, 6, 6)).astype(np.float32)
    want = ort_run(model, {"x": x})[0]
    for plan in (p.plan, vendor):
        got = np.asarray(Executor(plan, TEST_DEVICE).run({"x": x})["y"])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_3x3_conv_after_the_concat_is_refused_with_the_reason() -> None:
    """A padded 3x3 conv's pixels are not the Concat's (the padding would be activated too)."""
    _, plan = planned(dense_block(second="3x3"))
    why = "the conv is not a dense 1x1 conv of stride 1 without padding (its pixels are not the Concat's)"
    assert refusals(plan, names.CONCAT_PROLOGUE) == [(["cat2", "bn2", "bn2", "relu2", "conv_b"], why)]
    assert [g for g in claimed(plan) if g[1] == RULE] == [
        ("conv", RULE, ["cat1", "bn1", "bn1", "relu1", "conv_a", "relu_a"])
    ]


def test_disabling_the_rule_gives_the_plan_without_it() -> None:
    _, plan = planned(dense_block(), (names.CONCAT_PROLOGUE,))
    assert not [g for g in claimed(plan) if names.CONCAT_PROLOGUE in g[1]]
    assert not refusals(plan, names.CONCAT_PROLOGUE)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_scalar_and_per_channel_constants_of_any_affine_op(precision: str) -> None:
    """relu(cat(a, b) * 0.5 - shift): a scalar constant is a literal of the kernel, a per-channel
    one is loaded at each input's channels; every output element against onnxruntime."""
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "wa"], ["a"]),
        n("Conv", ["x", "wb"], ["b"], pads=[1] * 4),
        n("Concat", ["a", "b"], ["c"], axis=1),
        n("Mul", ["c", "half"], ["m"]),
        n("Sub", ["m", "shift"], ["s"]),
        n("Relu", ["s"], ["r"]),
        n("Conv", ["r", "w"], ["y"]),
    ]
    inits = {
        "wa": RNG.standard_normal((12, 4, 1, 1)),
        "wb": RNG.standard_normal((8, 4, 3, 3)) * 0.3,
        "half": np.array(0.5),
        "shift": RNG.standard_normal((20, 1, 1)) * 0.2,
        "w": RNG.standard_normal((7, 20, 1, 1)) * 0.3,
    }
    model = make_model(nodes, {"x": [1, 4, 5, 5]}, {"y": [1, 7, 5, 5]}, inits)
    cm = check_against_ort(model, {"x": [1, 4, 5, 5]}, precision, NHWC_ALWAYS, tune_budget_s=0)
    assert [g["rule"] for g in cm.report["fusion"]["groups"]] == [RULE]
    (k,) = [k for k in cm.plan.kernels.values() if "xp1" in k.source]
    assert "* 0.5)" in k.source and "(c_ok, 12 + ci, 0)" in k.source
