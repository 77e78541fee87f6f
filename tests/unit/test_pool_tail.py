"""`pool_tail`: a pool whose windows tile the map, computed on the output tile of the conv before
it (fusion/rules/anchor_epilogue.py, codegen/conv.py): the conv's rows run window by window, and
only the pooled tile is stored."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper

from tests.builders import TEST_DEVICE
from tests.unit.test_conv import check_every_candidate
from tests.unit.test_fusion import NHWC_ALWAYS, check_against_ort, make_model, ort_run

RNG = np.random.default_rng(17)
POOLS = ("opfuse.MaxPoolNHWC", "opfuse.AveragePoolNHWC")


def conv_pool_net(
    shape: list[int], first_pool: dict[str, Any], second: str = "AveragePool", pre_pool_output: bool = False
) -> tuple[Any, list[int]]:
    """VGG's block, then a DenseNet-like transition: Conv 3x3 -> Relu -> MaxPool (`first_pool`'s
    attributes), Conv 3x3 -> Sigmoid -> `second` 2x2 at stride 2. `pre_pool_output`: the first
    block's Relu is an output of the model too."""
    n, c, h, w = shape
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", **first_pool),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Sigmoid", ["c2"], ["s2"], name="act2"),
        helper.make_node(second, ["s2"], ["y"], name="pool2", kernel_shape=[2, 2], strides=[2, 2]),
    ]
    inits = {
        "w1": RNG.standard_normal((16, c, 3, 3)) * 0.3,
        "b1": RNG.standard_normal(16) * 0.1,
        "w2": RNG.standard_normal((24, 16, 3, 3)) * 0.2,
        "b2": RNG.standard_normal(24) * 0.1,
    }
    kh, sh = first_pool["kernel_shape"][0], first_pool["strides"][0]
    pad = sum(first_pool.get("pads", [0, 0, 0, 0])[::2])
    ph, pw = (h + pad - kh) // sh + 1, (w + pad - kh) // sh + 1
    out = [n, 24, ph // 2, pw // 2]
    outputs = {"y": out, **({"r1": [n, 16, h, w]} if pre_pool_output else {})}
    return make_model(nodes, {"x": shape}, outputs, inits), out


def _pool_steps(cm: Any) -> list[str]:
    """The pools the plan runs outside any conv kernel: library ops or pool kernels of their own."""
    ops = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.op_type in POOLS]
    kernels = [k.kind for k in cm.plan.kernels.values() if k.kind == "pool"]
    return ops + kernels


def _exact(cm: Any, model: Any, shape: list[int], precision: str) -> None:
    """Every output element against onnxruntime on fresh inputs."""
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    got = cm.run(feeds)
    for o, want in zip(model.graph.output, ort_run(model, feeds), strict=True):
        tol = 1e-5 if precision == "fp32" else 2e-3
        np.testing.assert_allclose(np.asarray(got[o.name], np.float32), want, rtol=tol * 10, atol=tol)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    "shape", [[2, 8, 8, 8], [1, 3, 9, 11]]
)  # 9 x 11: the last row and column pooled by none
def test_a_pool_tiling_the_map_runs_on_the_conv_output_tile(precision: str, shape: list[int]) -> None:
    """Both pools join their convs' kernels: no pool is launched, the pre-pool maps are never
    stored, and every output element matches onnxruntime at every tuning candidate of each conv
    kernel. With the rule off, the pools run on their own, and the result is the same."""
    model, out = conv_pool_net(shape, {"kernel_shape": [2, 2], "strides": [2, 2]})
    cm = check_against_ort(model, {"x": shape}, precision, fusion_disable=NHWC_ALWAYS, tune_budget_s=0)
    assert _pool_steps(cm) == []
    tails = [g for g in cm.report["fusion"]["groups"] if "pool_tail" in g["rule"]]
    assert sorted(g["nodes"][-1] for g in tails) == ["pool1", "pool2"]
    convs = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    assert len(convs) == 2 and all("tl.reshape(" in k.source for k in convs)
    stored = {o for k in cm.plan.kernels.values() for o in k.outputs}
    assert not stored & {"r1", "s2", "r1__nhwc", "s2__nhwc"} and all(
        "r1" not in o and "s2" not in o for o in stored
    )
    _exact(cm, model, shape, precision)
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    for k in convs:
        check_every_candidate(cm, k, model, feeds, precision)
    off = check_against_ort(
        model, {"x": shape}, precision, fusion_disable=(*NHWC_ALWAYS, "pool_tail"), tune_budget_s=0
    )
    # Off, the max pool is read by the next conv's loads (pool_prologue), the average pool launched.
    assert _pool_steps(off) and off.plan.launches == cm.plan.launches + len(_pool_steps(off))
    assert list(cm.plan.outputs[0].shape) == out


@pytest.mark.parametrize(
    "first_pool, why",
    [
        ({"kernel_shape": [3, 3], "strides": [2, 2]}, "overlap"),
        ({"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}, "pads the map"),
        ({"kernel_shape": [3, 3], "strides": [3, 3]}, "9 taps"),
    ],
)
def test_a_pool_whose_windows_do_not_tile_the_map_runs_on_its_own(
    first_pool: dict[str, Any], why: str
) -> None:
    """Overlapping windows, a padded pool, a window of 9 taps: the first pool is not joined, and
    the report says why under `pool_tail`; the second still is."""
    shape = [1, 4, 12, 12]
    model, _ = conv_pool_net(shape, first_pool)
    cm = check_against_ort(model, {"x": shape}, fusion_disable=NHWC_ALWAYS, tune_budget_s=0)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "pool_tail"]
    assert why in nf["reason"] and "pool1" in nf["nodes"]
    tails = [g["nodes"][-1] for g in cm.report["fusion"]["groups"] if "pool_tail" in g["rule"]]
    assert tails == ["pool2"]
    _exact(cm, model, shape, "fp32")


def test_a_pre_pool_map_read_elsewhere_keeps_its_pool_apart() -> None:
    """The first Relu's map is an output of the model too: its conv stores it, and its pool does
    not join that conv (the second one does)."""
    shape = [1, 4, 8, 8]
    model, _ = conv_pool_net(shape, {"kernel_shape": [2, 2], "strides": [2, 2]}, pre_pool_output=True)
    cm = check_against_ort(model, {"x": shape}, fusion_disable=NHWC_ALWAYS, tune_budget_s=0)
    tails = [g["nodes"][-1] for g in cm.report["fusion"]["groups"] if "pool_tail" in g["rule"]]
    assert tails == ["pool2"]  # the first pool goes to the next conv's loads (pool_prologue)
    _exact(cm, model, shape, "fp32")


@pytest.mark.parametrize("net", ["vgg", "densenet"])
def test_the_library_form_of_a_conv_with_its_pool_runs_the_pool_after_the_epilogue(net: str) -> None:
    """What tuning measures the one kernel against (variant "vendor"): the library's conv, the
    epilogue's kernel, then the library's pool; for the transition conv reading a Concat, the
    prologue's kernel, the library's conv (nothing after it), then the pool. Both plans compute
    what onnxruntime does."""
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor

    shape = [2, 4, 8, 8]
    if net == "vgg":
        model, _ = conv_pool_net(shape, {"kernel_shape": [2, 2], "strides": [2, 2]})
        expected = [("op", "opfuse.ConvNHWC"), ("kernel", "")]
    else:
        model, expected = dense_transition(shape), [("kernel", ""), ("op", "opfuse.ConvNHWC")]
    p = plan_model(model, {"x": shape}, "fp32", NHWC_ALWAYS)
    tails = [g for g in p.fusion.groups if g.rule.endswith("+pool_tail")]
    assert len(tails) == (2 if net == "vgg" else 1)
    vendor = build_plan(
        p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor" for g in tails}
    )
    for g in tails:
        mine = [(s.kind, s.op_type) for s in vendor.steps if s.group == g.id and s.launches]
        assert mine == [*expected, ("op", g.nodes[-1].op_type)]
    x = RNG.standard_normal(shape).astype(np.float32)
    want = ort_run(model, {"x": x})[0]
    for plan in (p.plan, vendor):
        got = Executor(plan, TEST_DEVICE).run({"x": x})["y"]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def dense_transition(shape: list[int]) -> Any:
    """DenseNet's dense layer then transition: a = Relu(conv(x)), b = Relu(conv(a)), the Concat
    of both through a per-channel affine and a Relu (the transition's BatchNorm), a 1x1 conv with
    nothing after it, then the 2x2 average pool at stride 2."""
    n, c, h, w = shape
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1], name="conv0"),
        helper.make_node("Relu", ["c0"], ["a"], name="relu0"),
        helper.make_node("Conv", ["a", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["b"], name="relu1"),
        helper.make_node("Concat", ["a", "b"], ["cat"], name="cat", axis=1),
        helper.make_node("Mul", ["cat", "s"], ["cs"], name="bn_scale"),
        helper.make_node("Add", ["cs", "t"], ["ct"], name="bn_shift"),
        helper.make_node("Relu", ["ct"], ["r"], name="relu2"),
        helper.make_node("Conv", ["r", "wt"], ["tc"], name="transition"),
        helper.make_node("AveragePool", ["tc"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
    ]
    inits = {
        "w0": RNG.standard_normal((16, c, 3, 3)) * 0.3,
        "b0": RNG.standard_normal(16) * 0.1,
        "w1": RNG.standard_normal((8, 16, 3, 3)) * 0.2,
        "b1": RNG.standard_normal(8) * 0.1,
        "s": RNG.uniform(0.5, 1.5, (24, 1, 1)),
        "t": RNG.standard_normal((24, 1, 1)) * 0.1,
        "wt": RNG.standard_normal((12, 24, 1, 1)) * 0.3,
    }
    return make_model(nodes, {"x": shape}, {"y": [n, 12, h // 2, w // 2]}, inits)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_transition_conv_reading_a_concat_pools_its_own_tile(precision: str) -> None:
    """The transition's 1x1 conv has no epilogue but its pool: the conv reads the Concat's inputs
    in its K loop (concat_prologue), each row at its own pixel though the rows run window by
    window, and stores only the pooled map. Every element against onnxruntime, at every tuning
    candidate."""
    shape = [2, 4, 6, 10]
    model = dense_transition(shape)
    cm = check_against_ort(model, {"x": shape}, precision, fusion_disable=NHWC_ALWAYS, tune_budget_s=0)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["nodes"][-1] == "pool"]
    assert "concat_prologue" in g["rule"] and g["rule"].endswith("+pool_tail") and "transition" in g["nodes"]
    assert _pool_steps(cm) == []
    (k,) = [k for k in cm.plan.kernels.values() if "pix[:, None]" in k.source]
    _exact(cm, model, shape, precision)
    check_every_candidate(cm, k, model, {"x": RNG.standard_normal(shape).astype(np.float32)}, precision)
