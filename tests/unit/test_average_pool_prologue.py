"""NHWC average pools computed on the input tiles of the conv that reads them (`pool_prologue`,
codegen/conv_fragments.py's `PoolTaps`): Inception's 3x3 stride-1 pool before its branch's 1x1
conv, with and without the pads counted, ResNet-D's 2x2 stride-2 ceil_mode pool before the
shortcut's 1x1 conv on an odd map (the last window's overhang never counted), and a pool before a
wider or strided conv (the template's own loops). Every output element against onnxruntime, the
kernel at every tuning config, and the split form tuning measures it against."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.builders import TEST_DEVICE
from tests.unit.test_conv import check_every_candidate, launch_at_every_config, prologue_alternative
from tests.unit.test_fusion import NHWC_ALWAYS, check_against_ort, make_model, ort_run

RNG = np.random.default_rng(23)
CO = 12

# id -> (input shape, AveragePool attributes, the conv's attributes, its window)
CASES: dict[str, tuple[list[int], dict[str, Any], dict[str, Any], list[int]]] = {
    "inception_pads_included": (
        [2, 24, 7, 7],
        {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "count_include_pad": 1},
        {},
        [1, 1],
    ),
    "inception_pads_excluded": (  # the corner windows divide by 4, the edges by 6
        [2, 24, 7, 7],
        {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},
        {},
        [1, 1],
    ),
    "resnet_d_downsample": (  # AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False): 7 -> 4
        [1, 20, 7, 7],
        {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
        {},
        [1, 1],
    ),
    "resnet_d_then_3x3": (  # a wider conv: the pool at each of its window positions
        [1, 20, 7, 7],
        {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
        {"pads": [1, 1, 1, 1]},
        [3, 3],
    ),
    "included_ceil_then_strided_1x1": (  # the windows past the padded end count only the pad
        [1, 16, 8, 8],
        {
            "kernel_shape": [3, 3],
            "strides": [2, 2],
            "pads": [1, 1, 1, 1],
            "ceil_mode": 1,
            "count_include_pad": 1,
        },
        {"strides": [2, 2]},
        [1, 1],
    ),
}


def _out(size: int, k: int, s: int, pad: tuple[int, int], ceil: bool) -> int:
    span = size + pad[0] + pad[1] - k
    out = (-(-span // s) if ceil else span // s) + 1
    return out - 1 if ceil and (out - 1) * s >= size + pad[0] else out


def _shapes(case: str) -> tuple[list[int], list[int]]:
    """The pool's output shape and the conv's (onnxruntime's ceil_mode rule for the pool)."""
    shape, attrs, conv, window = CASES[case]
    pads = attrs.get("pads", [0, 0, 0, 0])
    ceil = bool(attrs.get("ceil_mode"))
    ph, pw = (
        _out(shape[d + 2], attrs["kernel_shape"][d], attrs["strides"][d], (pads[d], pads[d + 2]), ceil)
        for d in (0, 1)
    )
    cpads, cs = conv.get("pads", [0, 0, 0, 0]), conv.get("strides", [1, 1])
    oh, ow = ((size + cpads[d] + cpads[d + 2] - window[d]) // cs[d] + 1 for d, size in ((0, ph), (1, pw)))
    return [shape[0], shape[1], ph, pw], [shape[0], CO, oh, ow]


def pool_conv(case: str, pool_op: str = "AveragePool") -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A 1x1 stem conv (it puts the pool in the channels-last region) -> s, the pool (the case's
    AveragePool, or a MaxPool of its window), then the case's conv with a bias and a Relu."""
    shape, attrs, conv, window = CASES[case]
    if pool_op == "MaxPool":
        attrs = {k: v for k, v in attrs.items() if k != "count_include_pad"}
    c = shape[1]
    inits = {
        "w0": np.eye(c).reshape(c, c, 1, 1) + RNG.standard_normal((c, c, 1, 1)) * 0.2,
        "w": RNG.standard_normal((CO, c, *window)) * 0.3,
        "b": RNG.standard_normal(CO) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["s"], name="stem"),
        helper.make_node(pool_op, ["s"], ["p"], name="pool", **attrs),
        helper.make_node("Conv", ["p", "w", "b"], ["q"], name="conv", **conv),
        helper.make_node("Relu", ["q"], ["y"], name="relu"),
    ]
    return make_model(nodes, {"x": shape}, {"y": _shapes(case)[1]}, inits), inits


def reference(case: str, inits: dict[str, np.ndarray], dtype: str) -> onnx.ModelProto:
    """The pool, conv and Relu alone on input s (onnxruntime's reference for the kernel); in
    fp16 the pooled tensor rounded to fp16 first, as the unfused plan would store it."""
    shape, attrs, conv, _ = CASES[case]
    nodes = [helper.make_node("AveragePool", ["s"], ["p"], name="pool", **attrs)]
    pooled = "p"
    if dtype == "fp16":
        nodes += [
            helper.make_node("Cast", ["p"], ["p16"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", ["p16"], ["pr"], to=TensorProto.FLOAT),
        ]
        pooled = "pr"
    nodes += [
        helper.make_node("Conv", [pooled, "w", "b"], ["q"], name="conv", **conv),
        helper.make_node("Relu", ["q"], ["y"], name="relu"),
    ]
    return make_model(nodes, {"s": shape}, {"y": _shapes(case)[1]}, {"w": inits["w"], "b": inits["b"]})


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_average_pool_runs_inside_the_conv_that_reads_it(precision: str, case: str) -> None:
    import torch

    shape = CASES[case][0]
    model, inits = pool_conv(case)
    cm = check_against_ort(model, {"x": shape}, precision, fusion_disable=NHWC_ALWAYS)
    (g,) = [g for g in cm.report["fusion"]["groups"] if "pool_prologue" in g["rule"]]
    assert g["rule"] == "conv_epilogue+pool_prologue" and g["nodes"] == ["pool", "conv", "relu"]
    assert cm.report["kernels"] == {"before": 4, "after": 2}  # the stem, then the pooled conv
    assert "opfuse.AveragePoolNHWC" not in [s.op_type for s in cm.plan.steps if s.kind == "op"]
    (k,) = [k for k in cm.plan.kernels.values() if "prologue: average pool on the input tiles" in k.source]
    assert not [k for k in cm.plan.kernels.values() if k.kind == "pool"]

    # The compiled model against onnxruntime, every element.
    x = RNG.standard_normal(shape).astype(np.float32)
    got, want = cm.run({"x": x})["y"], ort_run(model, {"x": x})[0]
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, rtol=tol, atol=tol)

    # The kernel at every tile the tuner may pick (and a K tile smaller than the channels),
    # its input in the model's type, against onnxruntime's pool, conv and Relu on that input.
    dtype = torch.float32 if precision == "fp32" else torch.float16
    s = torch.from_numpy(RNG.standard_normal(shape).astype(np.float32)).to(dtype)
    want_t = torch.from_numpy(ort_run(reference(case, inits, precision), {"s": s.float().numpy()})[0])
    dev = torch.device(TEST_DEVICE)
    sn = s.permute(0, 2, 3, 1).contiguous().to(dev)
    args = [
        sn if name == k.inputs[0] else torch.from_numpy(np.array(cm.plan.constants[name])).to(dev, dtype)
        for name in k.inputs
    ]
    launch_at_every_config(k, args, [want_t.permute(0, 2, 3, 1)], precision, [{"BLOCK_K": 16}])


@pytest.mark.parametrize("case", list(CASES))
def test_the_split_form_of_an_average_pool_prologue_computes_the_same(case: str) -> None:
    """What tuning measures the one kernel against: the pool's own kernel (the pool template),
    then the conv's template, each plan checked against onnxruntime, every element."""
    model, _ = pool_conv(case)
    _, alt, launched = prologue_alternative(model, CASES[case][0])
    assert launched == ["pool", "conv"]
    (k,) = [alt.kernels[s.kernel] for s in alt.steps if s.kernel and alt.kernels[s.kernel].kind == "pool"]
    assert "AveragePool pool (anchor)" in k.source


def test_an_average_pool_others_read_is_stored_by_the_conv_that_computes_it() -> None:
    """Read by a stride-1 3x3 conv and by the block's residual Add after a second conv (a ResNet
    stem's pool and first block, the pool an average one): the first conv stores the pooled tile
    it loads at its centre window position for the Add, and the pool's kernel is gone."""
    c, size = 16, 9
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}
    inits = {
        "w0": np.eye(c).reshape(c, c, 1, 1) + RNG.standard_normal((c, c, 1, 1)) * 0.2,
        "w": RNG.standard_normal((c, c, 3, 3)) * 0.2,
        "b": RNG.standard_normal(c) * 0.1,
        "w2": RNG.standard_normal((c, c, 3, 3)) * 0.2,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["s"], name="stem"),
        helper.make_node("AveragePool", ["s"], ["p"], name="pool", **attrs),
        helper.make_node("Conv", ["p", "w", "b"], ["q"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["q"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["t"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["t", "p"], ["y"], name="add"),
    ]
    shape = [2, c, size, size]
    m = make_model(nodes, {"x": shape}, {"y": shape}, inits)
    cm = check_against_ort(m, {"x": shape}, fusion_disable=NHWC_ALWAYS)
    (g,) = [g for g in cm.report["fusion"]["groups"] if "pool_prologue" in g["rule"]]
    assert g["nodes"] == ["pool", "conv", "relu"]
    assert cm.report["kernels"] == {"before": 6, "after": 3}
    (k,) = [k for k in cm.plan.kernels.values() if "prologue: average pool on the input tiles" in k.source]
    assert len(k.outputs) == 2 and "if t == 4:" in k.source  # the Relu and the pooled tensor
    x = RNG.standard_normal(shape).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(cm.run({"x": x})["y"]), ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-4
    )
    check_every_candidate(cm, k, m, {"x": x}, "fp32", [{"BLOCK_K": 16}])
    assert prologue_alternative(m, shape)[2] == ["pool", "conv"]


def test_an_average_pool_before_a_conv_too_wide_stays_its_own_kernel_and_says_why() -> None:
    shape, attrs, _, _ = CASES["resnet_d_downsample"]
    c = shape[1]
    inits = {"w0": np.eye(c).reshape(c, c, 1, 1), "w": RNG.standard_normal((200, c, 1, 1)) * 0.3}
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["s"], name="stem"),
        helper.make_node("AveragePool", ["s"], ["p"], name="pool", **attrs),
        helper.make_node("Conv", ["p", "w"], ["y"], name="conv"),
    ]
    m = make_model(nodes, {"x": shape}, {"y": [1, 200, 4, 4]}, inits)
    cm = check_against_ort(m, {"x": shape}, fusion_disable=NHWC_ALWAYS)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "pool_prologue"]
    assert nf["nodes"] == ["pool", "conv"]
    assert nf["reason"] == (
        "the 1x1 conv has 200 output channels (over 128): each of its column tiles would compute the pool again"
    )
    assert "opfuse.AveragePoolNHWC" in [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_max_pool_before_a_strided_1x1_conv_is_pooled_at_the_convs_input_pixels(precision: str) -> None:
    """A 1x1 conv of stride 2 reads every other pooled pixel: the pool is computed at the conv's
    input pixels (the template's own loops), not at its output pixels as before a plain 1x1
    conv. (Before the average pool prologue, the max pool took the plain 1x1 form here.)"""
    case = "included_ceil_then_strided_1x1"
    model, _ = pool_conv(case, pool_op="MaxPool")
    shape = CASES[case][0]
    cm = check_against_ort(model, {"x": shape}, precision, fusion_disable=NHWC_ALWAYS)
    (k,) = [k for k in cm.plan.kernels.values() if "prologue: max pool on the input tiles" in k.source]
    assert "pv = tl.maximum(pv, tl.load(x + " in k.source
    x = RNG.standard_normal(shape).astype(np.float32)
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(
        np.asarray(cm.run({"x": x})["y"], dtype=np.float32), ort_run(model, {"x": x})[0], rtol=tol, atol=tol
    )
    check_every_candidate(cm, k, model, {"x": x}, precision, [{"BLOCK_K": 16}])
