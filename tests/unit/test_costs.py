"""FLOPs and bytes of each step (opfuse.profile.costs) on real CPU compiles: a fused GEMM or conv
kernel counts its anchor's multiply-adds, so the roofline places it where its matmul puts it."""

from __future__ import annotations

from typing import Any

import opfuse
from opfuse.profile.costs import _matmul_flops
from tests.builders import conv_bn_relu, residual_mlp


def _rows(report: dict[str, Any], key: str) -> dict[str, dict[str, Any]]:
    return {r["node"]: r for r in report["profile"][key]}


def test_gemm_epilogue_kernel_counts_its_matmul() -> None:
    batch, hidden, ffn = 3, 16, 40
    cm = opfuse.compile(
        residual_mlp(hidden=hidden, ffn=ffn, seed=5), input_shapes={"x": [batch, hidden]}, device="cpu"
    )
    before, after = _rows(cm.report, "ops"), _rows(cm.report, "after")
    assert before["fc1"]["flops"] == 2 * batch * hidden * ffn
    epilogue = ["fc1_bias", "gelu_scale", "gelu_erf", "gelu_add1", "gelu_mul", "gelu_half"]
    fused = after[", ".join(["fc1", *epilogue])]
    # The matmul's 2·M·N·K plus one FLOP per output element for each epilogue node.
    assert fused["flops"] == 2 * batch * hidden * ffn + len(epilogue) * batch * ffn
    assert fused["flops"] == sum(before[n]["flops"] for n in ["fc1", *epilogue])
    assert fused["intensity"] == round(fused["flops"] / fused["bytes"], 3)
    # The row kernel computes fc2 on its tiles (gemm_reduction): its 2·M·N·K, and one FLOP per
    # output element for each of its other nodes.
    rows = next(r for name, r in after.items() if name.startswith("fc2, fc2_bias"))
    others = len(rows["node"].split(", ")) - 1
    assert rows["flops"] == 2 * batch * ffn * hidden + batch * hidden * others


def test_conv_epilogue_kernel_counts_its_convolution() -> None:
    cm = opfuse.compile(
        conv_bn_relu(channels=3, out_channels=8, size=8), input_shapes={"x": [2, 3, 8, 8]}, device="cpu"
    )
    before, after = _rows(cm.report, "ops"), _rows(cm.report, "after")
    conv = 2 * (2 * 8 * 8 * 8) * (3 * 3 * 3)  # 2 · output elements · (Cin · kh · kw)
    assert before["conv"]["flops"] == conv
    fused = next(r for r in after.values() if r["op_type"] == "FusedKernel")
    assert fused["flops"] == conv + 2 * 8 * 8 * 8  # the conv (BN folded into it) and the Relu


def test_matmul_flops_of_each_operand_form() -> None:
    assert _matmul_flops("MatMul", (4, 5), (5, 6), {}) == 2 * 4 * 6 * 5
    assert _matmul_flops("MatMul", (2, 7, 4, 5), (5, 6), {}) == 2 * 2 * 7 * 4 * 6 * 5
    assert _matmul_flops("MatMul", (3, 1, 4, 5), (1, 2, 5, 6), {}) == 2 * 3 * 2 * 4 * 6 * 5
    assert _matmul_flops("MatMul", (5,), (5, 6), {}) == 2 * 6 * 5
    assert _matmul_flops("MatMul", (4, 5), (5,), {}) == 2 * 4 * 5
    assert _matmul_flops("Gemm", (5, 4), (6, 5), {"transA": 1, "transB": 1}) == 2 * 4 * 6 * 5
    assert _matmul_flops("Gemm", (4, 5), (5, 6), {}) == 2 * 4 * 6 * 5
    assert _matmul_flops("MatMul", (), (5, 6), {}) == 0
