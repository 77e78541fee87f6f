"""Row kernels: reductions over the last axis with their prologue and epilogue, in one kernel."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.unit.test_fusion import check_against_ort, make_model

RNG = np.random.default_rng(7)


def _axes(name: str = "axes") -> dict[str, np.ndarray]:
    return {name: np.array([-1], dtype=np.int64)}


def _int_init_model(nodes, inputs, outputs, inits):  # type: ignore[no-untyped-def]
    from onnx import numpy_helper

    ints = {k: v for k, v in inits.items() if v.dtype == np.int64}
    floats = {k: v for k, v in inits.items() if v.dtype != np.int64}
    m = make_model(nodes, inputs, outputs, floats)
    m.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in ints.items())
    return m


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_attention_softmax_with_scale_and_mask(precision: str) -> None:
    nodes = [
        helper.make_node("Mul", ["s", "scale"], ["t0"]),
        helper.make_node("Add", ["t0", "mask"], ["t1"]),
        helper.make_node("Softmax", ["t1"], ["y"], axis=-1),
    ]
    shape = [2, 3, 5, 37]
    m = make_model(nodes, {"s": shape, "mask": [1, 1, 5, 37]}, {"y": shape}, {"scale": np.array(0.125)})
    cm = check_against_ort(m, {"s": shape, "mask": [1, 1, 5, 37]}, precision)
    assert cm.report["kernels"] == {"before": 3, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert k.kind == "rowwise" and "tl.exp(" in k.source and '"BLOCK_R": 64' in k.source


def test_log_softmax_and_reductions_share_rows() -> None:
    nodes = [
        helper.make_node("LogSoftmax", ["x"], ["ls"], axis=1),
        helper.make_node("ReduceMax", ["x", "axes"], ["mx"], keepdims=1),
        helper.make_node("ReduceSum", ["ls", "axes"], ["sm"], keepdims=0),
        helper.make_node("ReduceMin", ["x", "axes"], ["mn"], keepdims=1),
        helper.make_node("Sub", ["mx", "mn"], ["rng"]),
    ]
    m = _int_init_model(nodes, {"x": [6, 20]}, {"ls": [6, 20], "sm": [6], "rng": [6, 1]}, _axes())
    cm = check_against_ort(m, {"x": [6, 20]})
    assert cm.report["kernels"] == {"before": 5, "after": 1}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_skip_layernorm_op_with_epilogue(precision: str) -> None:
    nodes = [
        helper.make_node("Add", ["x", "res"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("Relu", ["n"], ["y"]),
    ]
    m = make_model(
        nodes,
        {"x": [4, 3, 48], "res": [4, 3, 48]},
        {"y": [4, 3, 48], "s": [4, 3, 48]},
        {"g": 1 + RNG.standard_normal(48) * 0.1, "b": RNG.standard_normal(48) * 0.1},
    )
    cm = check_against_ort(m, {"x": [4, 3, 48], "res": [4, 3, 48]}, precision)
    assert cm.report["kernels"] == {"before": 3, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert k.outputs == ["s", "y"]  # the residual sum is also a graph output


def test_rmsnorm_written_out() -> None:
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["xn"]),
        helper.make_node("Mul", ["xn", "w"], ["y"]),
    ]
    inits = {"two": np.array(2.0), "eps": np.array(1e-6), "w": 1 + RNG.standard_normal(64) * 0.1, **_axes()}
    m = _int_init_model(nodes, {"x": [2, 8, 64]}, {"y": [2, 8, 64]}, inits)
    cm = check_against_ort(m, {"x": [2, 8, 64]})
    assert cm.report["kernels"] == {"before": 7, "after": 1}


def test_reduction_over_another_axis_says_why() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=1),
    ]
    m = _int_init_model(nodes, {"x": [4, 6, 5]}, {"y": [4, 1, 5]}, {"axes": np.array([1], dtype=np.int64)})
    cm = check_against_ort(m, {"x": [4, 6, 5]})
    reasons = [nf["reason"] for nf in cm.report["fusion"]["not_fused"] if nf["rule"] == "row_reduction"]
    assert any("trailing axes only" in r for r in reasons)
    assert cm.report["kernels"]["after"] == 2


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_squeeze_excite_global_pool_and_instance_norm(precision: str) -> None:
    c = 6
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["gap"]),
        helper.make_node("Sigmoid", ["gap"], ["gate"]),
        helper.make_node("InstanceNormalization", ["r", "s", "b"], ["inorm"], epsilon=1e-5),
        helper.make_node("Mul", ["inorm", "gate"], ["y"]),
    ]
    m = make_model(
        nodes,
        {"x": [2, c, 5, 7]},
        {"y": [2, c, 5, 7], "gap": [2, c, 1, 1]},
        {"s": 1 + RNG.standard_normal(c) * 0.1, "b": RNG.standard_normal(c) * 0.1},
    )
    cm = check_against_ort(m, {"x": [2, c, 5, 7]}, precision)
    assert cm.report["kernels"] == {"before": 5, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert "ROWS = 12" in k.source and '"BLOCK_R": 64' in k.source


def test_reduce_mean_over_trailing_axes_with_layernorm_over_two_axes() -> None:
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-2, epsilon=1e-5),
        helper.make_node("ReduceMean", ["ln", "axes"], ["y"], keepdims=1),
    ]
    m = _int_init_model(
        nodes,
        {"x": [3, 4, 5]},
        {"y": [3, 1, 1]},
        {
            "g": 1 + RNG.standard_normal((4, 5)) * 0.1,
            "b": RNG.standard_normal((4, 5)) * 0.1,
            "axes": np.array([1, 2], dtype=np.int64),
        },
    )
    cm = check_against_ort(m, {"x": [3, 4, 5]})
    assert cm.report["kernels"] == {"before": 2, "after": 1}
