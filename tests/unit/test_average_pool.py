"""NHWC average pools as the pool template (opfuse/codegen/pool.py) with their pointwise epilogue
(`pool_epilogue`): every output element against onnxruntime's AveragePool, padded windows counted
with and without the pads (count_include_pad), the ceil_mode overhang past the end pad never
counted."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

import opfuse
from tests.builders import TEST_DEVICE
from tests.unit.test_fusion import NHWC_ALWAYS, make_model, ort_run

RNG = np.random.default_rng(17)

# id -> (input shape, AveragePool attributes, output shape, epilogue). The epilogue: "affine"
# x * 0.5 + a per-channel shift, "sub" poolformer's token mixer pool(x) - x, "relu".
CASES: dict[str, tuple[list[int], dict[str, Any], list[int], str]] = {
    "3x3_s2_pads_excluded": (
        [2, 24, 9, 9],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        [2, 24, 5, 5],
        "affine",
    ),
    "3x3_s2_pads_included_ceil": (  # the last window's third tap is past the padded end
        [1, 16, 8, 8],
        {
            "kernel_shape": [3, 3],
            "strides": [2, 2],
            "pads": [1, 1, 1, 1],
            "ceil_mode": 1,
            "count_include_pad": 1,
        },
        [1, 16, 5, 5],
        "affine",
    ),
    "2x2_s2_ceil_excluded": (  # ResNet-D's downsample: AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
        [1, 20, 7, 7],
        {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
        [1, 20, 4, 4],
        "relu",
    ),
    "2x2_s2_pads_included": (
        [1, 8, 6, 6],
        {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
        [1, 8, 4, 4],
        "affine",
    ),
    "poolformer_mixer": (
        [2, 16, 7, 7],
        {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},
        [2, 16, 7, 7],
        "sub",
    ),
    "inception_branch": (
        [1, 12, 6, 6],
        {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "count_include_pad": 1},
        [1, 12, 6, 6],
        "relu",
    ),
    "global_ish": ([2, 32, 7, 6], {"kernel_shape": [7, 6]}, [2, 32, 1, 1], "affine"),
    "asymmetric_pads_included": (
        [1, 8, 7, 7],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 1, 2, 0], "count_include_pad": 1},
        [1, 8, 4, 3],
        "affine",
    ),
    "same_upper_included": (  # the end pad of 1 counts
        [1, 8, 7, 7],
        {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER", "count_include_pad": 1},
        [1, 8, 4, 4],
        "affine",
    ),
    "dilated_ceil_included": (  # opset 19's dilations; the last window's last tap past the padded end
        [1, 8, 8, 8],
        {
            "kernel_shape": [3, 3],
            "strides": [2, 2],
            "dilations": [2, 2],
            "pads": [1, 1, 1, 1],
            "ceil_mode": 1,
            "count_include_pad": 1,
        },
        [1, 8, 4, 4],
        "affine",
    ),
}
EPILOGUE_NODES = {"affine": ["pool", "scale", "shift"], "sub": ["pool", "mixer"], "relu": ["pool", "act"]}


def _opset(m: onnx.ModelProto, attrs: dict[str, Any]) -> onnx.ModelProto:
    """AveragePool takes dilations from opset 19."""
    if "dilations" in attrs:
        m.opset_import[0].version = 19
    return m


def pool_models(
    shape: list[int], attrs: dict[str, Any], out: list[int], epilogue: str
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """A 1x1 conv (it puts the pool in the channels-last region) -> s, AveragePool(s) and its
    epilogue; and the pool and epilogue alone on input s (onnxruntime's reference for the kernel)."""
    c = shape[1]
    nodes = [helper.make_node("AveragePool", ["s"], ["p"], name="pool", **attrs)]
    inits: dict[str, np.ndarray] = {}
    if epilogue == "affine":
        inits.update(half=np.array(0.5), shift=RNG.standard_normal((c, 1, 1)))
        nodes += [
            helper.make_node("Mul", ["p", "half"], ["h"], name="scale"),
            helper.make_node("Add", ["h", "shift"], ["y"], name="shift"),
        ]
    elif epilogue == "sub":
        nodes.append(helper.make_node("Sub", ["p", "s"], ["y"], name="mixer"))
    else:
        nodes.append(helper.make_node("Relu", ["p"], ["y"], name="act"))
    alone = make_model(nodes, {"s": shape}, {"y": out}, inits)
    stem = helper.make_node("Conv", ["x", "w"], ["s"], name="stem")
    w = np.eye(c).reshape(c, c, 1, 1) + RNG.standard_normal((c, c, 1, 1)) * 0.2
    model = make_model([stem, *nodes], {"x": shape}, {"y": out}, {**inits, "w": w})
    return _opset(model, attrs), _opset(alone, attrs)


def _tolerance(precision: str) -> float:
    return 1e-5 if precision == "fp32" else 2e-3


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_average_pool_runs_as_its_template_with_the_epilogue(precision: str, case: str) -> None:
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.candidates import candidates

    shape, attrs, out, epilogue = CASES[case]
    model, alone = pool_models(shape, attrs, out, epilogue)
    cm = opfuse.compile(
        model, input_shapes={"x": shape}, precision=precision, device=TEST_DEVICE, fusion_disable=NHWC_ALWAYS
    )
    assert cm.report["verification"]["passed"] is True
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "pool"]
    assert g["rule"] == "pool_epilogue" and g["nodes"] == EPILOGUE_NODES[epilogue]
    launched = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert "opfuse.AveragePoolNHWC" not in launched
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "pool"]
    assert "AveragePool pool (anchor)" in k.source

    # The compiled model against onnxruntime, every element.
    x = RNG.standard_normal(shape).astype(np.float32)
    got, want = cm.run({"x": x})["y"], ort_run(model, {"x": x})[0]
    assert got.shape == want.shape
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, rtol=tol, atol=tol)

    # The kernel at every tile the tuner may pick, its input in the model's type, against
    # onnxruntime's pool and epilogue on that same input: every element.
    dtype = torch.float32 if precision == "fp32" else torch.float16
    dev = torch.device(TEST_DEVICE)
    s = torch.from_numpy(RNG.standard_normal(shape).astype(np.float32)).to(dtype)
    want_t = torch.from_numpy(ort_run(alone, {"s": s.float().numpy()})[0]).permute(0, 2, 3, 1)
    sn = s.permute(0, 2, 3, 1).contiguous().to(dev)
    args = [
        sn if name == k.inputs[0] else torch.from_numpy(np.array(cm.plan.constants[name])).to(dev, dtype)
        for name in k.inputs
    ]
    module = load_kernel_module(k.source, interpret=TEST_DEVICE == "cpu")
    tol = _tolerance(precision)
    assert len(candidates(k)) > 1
    for cand in candidates(k):
        config = {**k.config, **cand}
        y = torch.full(want_t.shape, float("nan"), device=dev, dtype=dtype)
        module.launch(*args, y, config=config)
        got_t = y.float().cpu()
        assert torch.allclose(got_t, want_t, rtol=tol, atol=tol), (
            config,
            float((got_t - want_t).abs().max()),
        )


def test_an_average_pool_alone_stays_the_library_pool_unless_measured_faster() -> None:
    shape = [1, 8, 6, 6]
    model, _ = pool_models(shape, {"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 8, 3, 3], "relu")
    del model.graph.node[-1]  # the Relu: the pool's output is the graph's
    model.graph.output[0].name = "p"
    # pool_tail off: with it, the conv's kernel pools its own tile (tests/unit/test_pool_tail.py).
    off = (*NHWC_ALWAYS, "pool_tail")
    cm = opfuse.compile(model, input_shapes={"x": shape}, device=TEST_DEVICE, fusion_disable=off)
    assert cm.report["verification"]["passed"] is True
    assert not any(g["kind"] == "pool" for g in cm.report["fusion"]["groups"])
    assert [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches] == [
        "opfuse.ConvNHWC",
        "opfuse.AveragePoolNHWC",
    ]
    (why,) = [n for n in cm.report["fusion"]["not_fused"] if n["nodes"] == ["pool"]]
    assert why["rule"] == "pool_epilogue" and "unless tuning measures its template faster" in why["reason"]
