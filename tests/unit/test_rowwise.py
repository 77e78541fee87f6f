"""Row kernels: reductions over a run of axes (trailing, strided, channel groups) with their prologue
and epilogue, in one kernel."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import opfuse
from opfuse.profile.costs import H200_DEFAULT, device_peaks, roofline
from tests.builders import TEST_DEVICE
from tests.unit.test_fusion import check_against_ort, make_model, ort_run

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


def test_reduction_over_split_axes_says_why() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=1),
    ]
    m = _int_init_model(nodes, {"x": [4, 6, 5]}, {"y": [1, 6, 1]}, {"axes": np.array([0, 2], dtype=np.int64)})
    cm = check_against_ort(m, {"x": [4, 6, 5]})
    reasons = [nf["reason"] for nf in cm.report["fusion"]["not_fused"] if nf["rule"] == "row_reduction"]
    assert any("one contiguous run of axes" in r for r in reasons)
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


def check_every_element(
    model: onnx.ModelProto, shapes: dict[str, list[int]], precision: str = "fp32"
) -> opfuse.CompiledModel:
    """check_against_ort (relative L2 and opfuse's own verification), then fresh random inputs
    with every element within tolerance of onnxruntime's."""
    cm = check_against_ort(model, shapes, precision)
    feeds = {k: RNG.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    outs = cm.run(feeds)
    rtol = 1e-4 if precision == "fp32" else 1e-2
    for o, ref in zip(model.graph.output, ort_run(model, feeds), strict=True):
        atol = rtol * float(np.abs(ref).max()) + 1e-6
        np.testing.assert_allclose(outs[o.name], ref, rtol=rtol, atol=atol, err_msg=o.name)
    return cm


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_inputs_that_vary_along_part_of_the_row(precision: str) -> None:
    """A row over (H, W, C) reads inputs that vary along some of its dims only: a [W, 1] factor,
    and LayerNormalization's per-channel scale [C] and [W, C] bias (a one-group GroupNorm in
    channels-last), each at its coordinates taken out of `cols`."""
    nodes = [
        helper.make_node("Mul", ["x", "f"], ["t"]),
        helper.make_node("LayerNormalization", ["t", "g", "b"], ["y"], axis=1, epsilon=1e-5),
    ]
    m = make_model(
        nodes,
        {"x": [3, 4, 5, 6]},
        {"y": [3, 4, 5, 6]},
        {
            "f": 1 + RNG.standard_normal((5, 1)) * 0.3,
            "g": 1 + RNG.standard_normal(6) * 0.3,
            "b": RNG.standard_normal((5, 6)) * 0.3,
        },
    )
    cm = check_every_element(m, {"x": [3, 4, 5, 6]}, precision)
    assert cm.report["kernels"] == {"before": 2, "after": 1}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_over_channels_of_nchw_is_one_strided_kernel(op: str, precision: str) -> None:
    shape = [2, 5, 3, 7]
    nodes = [
        helper.make_node("Mul", ["x", "t"], ["s"]),
        helper.make_node(op, ["s"], ["p"], axis=1),
        helper.make_node("Mul", ["p", "w"], ["y"]),  # a per-channel weight on the epilogue
    ]
    m = make_model(nodes, {"x": shape}, {"y": shape}, {"t": np.array(0.7), "w": 1 + RNG.random((5, 1, 1))})
    cm = check_every_element(m, {"x": shape}, precision)
    assert cm.report["kernels"] == {"before": 3, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert k.kind == "rowwise" and "INNER = 21" in k.source and "ROWS = 2" in k.source
    assert "rr * 21 + ii" in k.source and "keep_dims=True" in k.source
    assert '"BLOCK_R": 8, "BLOCK_I": 32' in k.source


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    ("shape", "axes", "keepdims"),
    [([2, 6, 3, 5], [1], (1, 0, 1, 0)), ([2, 3, 5, 6], [1, 2], (0, 1, 0, 1))],
    ids=["nchw-channels", "nhwc-spatial"],
)
def test_reductions_over_middle_axes_share_one_kernel(
    shape: list[int], axes: list[int], keepdims: tuple[int, ...], precision: str
) -> None:
    ops = ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"]
    reduced = {1: [1 if i in axes else d for i, d in enumerate(shape)]}
    reduced[0] = [d for i, d in enumerate(shape) if i not in axes]
    nodes = [helper.make_node("Mul", ["x", "t"], ["r"])]  # a prologue
    nodes += [
        helper.make_node(op, ["r", "axes"], [f"o{i}"], keepdims=kd)
        for i, (op, kd) in enumerate(zip(ops, keepdims, strict=True))
    ]
    nodes.append(helper.make_node("Sigmoid", ["o0"], ["y0"]))  # an epilogue on the reduced values
    outputs = {"y0": reduced[keepdims[0]], **{f"o{i}": reduced[kd] for i, kd in enumerate(keepdims) if i}}
    inits = {"axes": np.array(axes, dtype=np.int64), "t": np.array(1.5)}
    m = _int_init_model(nodes, {"x": shape}, outputs, inits)
    cm = check_every_element(m, {"x": shape}, precision)
    assert cm.report["kernels"] == {"before": 6, "after": 1}
    (k,) = cm.plan.kernels.values()
    inner = int(np.prod(shape[axes[-1] + 1 :]))
    assert f"INNER = {inner}" in k.source and k.source.count("keep_dims=True") == 4
    assert k.source.count("tl.store(out") == 4 and k.source.count(f"+ outer * {inner} + ii") == 4


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_channels_last_squeeze_excite_pool_in_one_kernel(precision: str) -> None:
    """A channels-last net's global average pool is a mean over H and W of [N, H, W, C]."""
    shape = [2, 4, 5, 24]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("ReduceMean", ["r", "axes"], ["gap"], keepdims=1),
        helper.make_node("Sigmoid", ["gap"], ["gate"]),
        helper.make_node("Mul", ["r", "gate"], ["y"]),
    ]
    axes = {"axes": np.array([1, 2], dtype=np.int64)}
    m = _int_init_model(nodes, {"x": shape}, {"y": shape, "gap": [2, 1, 1, 24]}, axes)
    cm = check_every_element(m, {"x": shape}, precision)
    assert cm.report["kernels"] == {"before": 4, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert "x0 = tl.load(in0 + outer * 480 + rr * 24 + ii, mask=mask" in k.source
    assert "/ 20.0" in k.source


@pytest.mark.parametrize("pixels, fused", [(32 * 32, True), (48 * 48, False)])
def test_a_strided_pool_over_many_pixels_is_left_to_the_library(pixels: int, fused: bool) -> None:
    """Channels-last global pooling over H*W pixels: a program holds 4096 // next_pow2(H*W)
    adjacent channels; below 4 its loads are uncoalesced, and the planner says so instead."""
    side = int(pixels**0.5)
    shape = [1, side, side, 8]
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Mul", ["x", "s"], ["r"]),
        helper.make_node("ReduceMean", ["r", "axes"], ["gap"], keepdims=1),
    ]
    axes = {"axes": np.array([1, 2], dtype=np.int64)}
    m = _int_init_model(nodes, {"x": shape}, {"gap": [1, 1, 1, 8]}, axes)
    cm = check_every_element(m, {"x": shape})
    kinds = [g["kind"] for g in cm.report["fusion"]["groups"]]
    reasons = [nf["reason"] for nf in cm.report["fusion"]["not_fused"]]
    if fused:
        assert kinds == ["rowwise"] and cm.report["kernels"]["after"] == 1
    else:
        assert kinds == ["pointwise"]  # the SiLU; the mean runs as the library's reduction
        assert any(f"over {pixels} elements at stride 8" in r and "uncoalesced" in r for r in reasons)


def test_softmax_written_out_over_channels() -> None:
    shape = [2, 4, 3, 3]
    nodes = [
        helper.make_node("ReduceMax", ["x", "axes"], ["mx"], keepdims=1),
        helper.make_node("Sub", ["x", "mx"], ["d"]),
        helper.make_node("Exp", ["d"], ["e"]),
        helper.make_node("ReduceSum", ["e", "axes"], ["sm"], keepdims=1),
        helper.make_node("Div", ["e", "sm"], ["y"]),
    ]
    m = _int_init_model(nodes, {"x": shape}, {"y": shape}, {"axes": np.array([1], dtype=np.int64)})
    cm = check_every_element(m, {"x": shape})
    assert cm.report["kernels"] == {"before": 5, "after": 1}


def test_dropped_reduced_value_broadcast_along_other_axes_stays_out() -> None:
    """[4, 4] summed over axis 1 without keepdims is [4]: ONNX broadcasts it along the rows, so
    the row kernel (one value per row) must not take the Add in."""
    nodes = [
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    m = _int_init_model(nodes, {"x": [4, 4]}, {"y": [4, 4]}, _axes())
    cm = check_every_element(m, {"x": [4, 4]})
    reasons = [nf["reason"] for nf in cm.report["fusion"]["not_fused"] if nf["rule"] == "row_reduction"]
    assert any("broadcasts along axes that were not reduced" in r for r in reasons)
    assert cm.report["kernels"]["after"] == 2


def _group_norm_model(shape: list[int], groups: int) -> onnx.ModelProto:
    """GroupNorm -> SiLU -> + a per-(n, c) embedding, as in a diffusion UNet's ResNet block."""
    c = shape[1]
    nodes = [
        helper.make_node("GroupNormalization", ["x", "s", "b"], ["gn"], num_groups=groups, epsilon=1e-5),
        helper.make_node("Sigmoid", ["gn"], ["sg"]),
        helper.make_node("Mul", ["gn", "sg"], ["silu"]),
        helper.make_node("Add", ["silu", "temb"], ["y"]),
    ]
    inits = {"s": 1 + RNG.standard_normal(c) * 0.2, "b": RNG.standard_normal(c) * 0.2}
    m = make_model(nodes, {"x": shape, "temb": [shape[0], c, 1, 1]}, {"y": shape}, inits)
    # Opset 21: scale and bias per channel. (GroupNormalization-18, per group, is deprecated and
    # the ONNX checker refuses it.)
    m.opset_import[0].version = 21
    m.ir_version = 10
    return m


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_group_norm_with_silu_epilogue_is_one_kernel(precision: str) -> None:
    shape = [2, 8, 3, 5]
    cm = check_every_element(_group_norm_model(shape, 4), {"x": shape, "temb": [2, 8, 1, 1]}, precision)
    assert cm.report["kernels"] == {"before": 4, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert "ROWS = 8" in k.source and "R = 30" in k.source  # N·G rows of C/G·H·W
    assert "x1 = tl.load(in1 + ((row % 4) * 2 + cols // 15), mask=cmask" in k.source  # scale per channel
    assert "(row // 4) * 8 + ((row % 4) * 2 + cols // 15)" in k.source  # the [N, C, 1, 1] embedding
    assert "tl.sigmoid(" in k.source


def test_group_norm_rows_too_long_say_why() -> None:
    shape = [1, 4, 96, 96]  # one group of 4·96·96 elements
    cm = opfuse.compile(_group_norm_model(shape, 1), device=TEST_DEVICE, verify=False, tune_budget_s=0)
    reasons = [nf["reason"] for nf in cm.report["fusion"]["not_fused"] if nf["rule"] == "row_reduction"]
    assert any("does not fit one program" in r for r in reasons)


def test_row_reduction_rule_can_be_disabled_for_strided_kernels() -> None:
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=1), helper.make_node("Relu", ["y"], ["z"])]
    m = make_model(nodes, {"x": [2, 3, 4]}, {"z": [2, 3, 4]})
    cm = opfuse.compile(m, device=TEST_DEVICE, fusion_disable=["row_reduction"])
    assert all(k.kind != "rowwise" for k in cm.plan.kernels.values())
    assert cm.report["kernels"]["after"] == 2


def test_ridge_point_defaults_to_the_h200_table_without_a_gpu() -> None:
    peaks = device_peaks("cpu")
    assert peaks is H200_DEFAULT
    assert round(peaks.ridge("fp16")) == 206 and round(peaks.ridge("tf32")) == 103
    assert round(peaks.ridge("fp32"), 1) == 14.0
    assert roofline("bf16", "cpu")["ridge_flop_per_byte"] == 206.0


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_short_rows_share_a_program_at_every_candidate_config(precision: str) -> None:
    """ConvNeXt's channels-last LayerNorm: rows of 96, many of them. Several rows may run per
    program (BLOCK_M); the row count is no multiple of any candidate's, so the last program's spare
    rows are masked. Every tuning candidate is launched on its own and checked element by element,
    the per-row output (a keepdims mean) included."""
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.candidates import candidates

    nodes = [
        helper.make_node("Add", ["x", "res"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["n"], axis=-1, epsilon=1e-6),
        helper.make_node("Relu", ["n"], ["y"]),
        helper.make_node("ReduceMean", ["s", "axes"], ["m"], keepdims=1),
    ]
    shape = [2, 75, 96]
    g, b = 1 + RNG.standard_normal(96) * 0.1, RNG.standard_normal(96) * 0.1
    m = _int_init_model(
        nodes,
        {"x": shape, "res": shape},
        {"y": shape, "s": shape, "m": [2, 75, 1]},
        {"g": g, "b": b, **_axes()},
    )
    cm = check_every_element(m, {"x": shape, "res": shape}, precision)
    assert cm.report["kernels"] == {"before": 4, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert k.config["BLOCK_M"] == 1 and "tl.arange(0, BLOCK_M)" in k.source
    configs = [{**k.config, **c} for c in candidates(k)]
    assert {c["BLOCK_M"] for c in configs} == {1, 8, 16}  # one row; tiles of 1024 and 2048

    dtype = torch.float32 if precision == "fp32" else torch.float16
    device = torch.device(TEST_DEVICE)
    x, res = (RNG.standard_normal(shape).astype(np.float32) for _ in range(2))
    s = x + res
    mean = s.mean(-1, keepdims=True)
    norm = (s - mean) / np.sqrt(s.var(-1, keepdims=True) + 1e-6) * g + b
    want = {"y": np.maximum(norm, 0), "s": s, "m": mean}
    feeds = {"x": x, "res": res, **{n: cm.plan.constants[n] for n in k.inputs if n in cm.plan.constants}}
    module = load_kernel_module(k.source, interpret=TEST_DEVICE == "cpu")
    tol = 1e-4 if precision == "fp32" else 2e-2
    for config in configs:
        args = [torch.tensor(np.asarray(feeds[n]), dtype=dtype, device=device) for n in k.inputs]
        outs = [torch.full(want[n].shape, float("nan"), dtype=dtype, device=device) for n in k.outputs]
        module.launch(*args, *outs, config=config)
        for name, out in zip(k.outputs, outs, strict=True):
            got = out.float().cpu().numpy()
            np.testing.assert_allclose(got, want[name], rtol=tol, atol=tol, err_msg=f"{name} at {config}")


def test_rows_per_program_never_exceed_the_rows() -> None:
    """Tiles of 1024 and 2048 elements over rows of 128: 8 and 16 rows, or fewer where there are
    fewer (3 rows: 4 per program, the next power of two)."""
    from opfuse.runtime.plan import KernelInfo
    from opfuse.tuning.candidates import CANDIDATES, candidates

    def kernel(rows: int, config: dict[str, int]) -> KernelInfo:
        return KernelInfo("k0", "rowwise", "r0", ["in0"], ["out0"], config, f"ROWS = {rows}\nR = 96\n")

    many = {c["BLOCK_M"] for c in candidates(kernel(1000, {"BLOCK_M": 1, "BLOCK_R": 128}))}
    few = {c["BLOCK_M"] for c in candidates(kernel(3, {"BLOCK_M": 1, "BLOCK_R": 128}))}
    assert (many, few) == ({1, 8, 16}, {1, 4})
    # A strided kernel: narrower column blocks too, never under 4 adjacent columns.
    tiled = kernel(1000, {"BLOCK_R": 128, "BLOCK_I": 8})
    assert candidates(tiled) == CANDIDATES["rowwise"] + [{"BLOCK_I": 4, "num_warps": w} for w in (4, 8)]
    narrow = kernel(1000, {"BLOCK_R": 1024, "BLOCK_I": 4})
    assert candidates(narrow) == CANDIDATES["rowwise"]
