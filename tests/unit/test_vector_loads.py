"""The channels-last templates' tile loads compile to vector loads for the H200 (sm_90), checked in
the PTX Triton writes on this machine, without a GPU: a [pixels, channels] tile whose channels run
contiguously is loaded up to 16 bytes at a time (`in_bounds`' run: 8 channels of 96, 4 of 12);
with an odd channel count, one element at a time (a longer run would not be true)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import opfuse
from tests.builders import tiny_model, weights
from tests.ptx import sm90_loads

n = helper.make_node


def depthwise(channels: int) -> onnx.ModelProto:
    return tiny_model(
        [n("Conv", ["x", "w"], ["c"], group=channels, pads=[1, 1, 1, 1]), n("Relu", ["c"], ["y"])],
        {"x": [2, channels, 6, 6]},
        {"y": [2, channels, 6, 6]},
        {"w": weights(channels, 1, 3, 3)},
    )


def dense(channels: int) -> onnx.ModelProto:
    return tiny_model(
        [n("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), n("Relu", ["c"], ["y"])],
        {"x": [2, channels, 6, 6]},
        {"y": [2, 32, 6, 6]},
        {"w": weights(32, channels, 3, 3)},
    )


@pytest.mark.parametrize(
    ("build", "channels", "vector"),
    [(depthwise, 96, True), (dense, 64, True), (depthwise, 12, True), (depthwise, 15, False)],
)
def test_channel_tiles_load_sixteen_bytes_at_a_time(
    build, channels: int, vector: bool, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    cm = opfuse.compile(
        build(channels),
        {"x": [2, channels, 6, 6]},
        precision="fp16",
        fusion_disable=("fp32_dense_nchw",),
        tune_budget_s=0,
        verify=False,
    )
    (kernel,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "UPCAST": False, "UNROLL": True, "num_warps": 4}
    loads = sm90_loads(kernel.source, tmp_path, config)
    wide = sum(v for k, v in loads.items() if ".v" in k)
    if not vector:
        assert wide == 0 and loads, loads
    elif build is dense:
        assert wide > 0 and "ld.global.b16" not in loads, loads  # the A tile and the weights
    else:
        assert wide > 0, loads  # the weights, at stride KH*KW, stay single loads
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, channels, 6, 6)).astype(np.float32)
    assert np.all(np.isfinite(cm.run({"x": x})["y"]))


@pytest.mark.parametrize("transposed", [False, True])
def test_batched_gemm_tiles_load_sixteen_bytes_at_a_time(transposed: bool, tmp_path: Path) -> None:
    """A batched GEMM's A and B tiles, B with N contiguous or (read through a Transpose) K."""
    b_in = [4, 48, 64] if transposed else [4, 64, 48]
    nodes = [n("MatMul", ["a", "bt" if transposed else "b"], ["c"]), n("Relu", ["c"], ["y"])]
    if transposed:
        nodes.insert(0, n("Transpose", ["b"], ["bt"], perm=[0, 2, 1]))
    shapes = {"a": [4, 32, 64], "b": b_in}
    cm = opfuse.compile(
        tiny_model(nodes, shapes, {"y": [4, 32, 48]}), shapes, precision="fp16", tune_budget_s=0
    )
    (kernel,) = [k for k in cm.plan.kernels.values() if k.kind == "gemm"]
    assert "batched GEMM" in kernel.source
    loads = sm90_loads(kernel.source, tmp_path, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4})
    assert "ld.global.b16" not in loads and sum(loads.values()) > 0, loads


def test_a_gemm_prologue_loads_its_inputs_along_k(tmp_path: Path) -> None:
    """Pointwise ops computing a GEMM's A (operand_prologue) load their inputs at A's tile
    coordinates: along K, contiguously, in vector loads."""
    nodes = [n("Mul", ["a", "g"], ["p"]), n("Sigmoid", ["p"], ["s"]), n("MatMul", ["s", "w"], ["y"])]
    shapes = {"a": [32, 64], "g": [32, 64]}
    model = tiny_model(nodes, shapes, {"y": [32, 48]}, {"w": weights(64, 48)})
    cm = opfuse.compile(model, shapes, precision="fp16", tune_budget_s=0, verify=False)
    (kernel,) = [k for k in cm.plan.kernels.values() if k.kind == "gemm"]
    assert "prologue" in kernel.source
    loads = sm90_loads(kernel.source, tmp_path, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4})
    assert "ld.global.b16" not in loads and sum(loads.values()) > 0, loads
