"""`gemm_epilogue` on a batched MatMul ([..., M, K] @ [..., K, N]): the batched form of the GEMM
template (codegen/gemm.py, generate_batched_gemm) with its epilogue, both operands read through
the Transposes and Reshapes before them. Attention-like products that are not attention: talking
heads (cait), cross-covariance (xcit), factorized attention (coat), relative-position logits."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import opfuse
from opfuse.frontend import rule_registry as names
from tests.builders import TEST_DEVICE, claimed, planned, refusals, tiny_model, weights

n = helper.make_node
RULE = names.GEMM_EPILOGUE


def _check(model: onnx.ModelProto, precision: str = "fp32") -> opfuse.CompiledModel:
    """Compiled and verified with nothing rolled back, and every output element against
    onnxruntime on two random input sets."""
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    cm = opfuse.compile(model, input_shapes=shapes, precision=precision, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    assert not cm.report["verification"]["rolled_back"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    tol = 1e-4 if precision == "fp32" else 2e-2
    for seed in range(2):
        rng = np.random.default_rng(seed)
        feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
        outs = cm.run(feeds)
        for o, want in zip(model.graph.output, sess.run(None, feeds), strict=True):
            assert outs[o.name].shape == want.shape
            np.testing.assert_allclose(outs[o.name], want, rtol=tol, atol=tol)
    return cm


def scores(b: int = 2, h: int = 3, s: int = 10, d: int = 12, bias_rank: int = 4) -> onnx.ModelProto:
    """q, k [B, S, H*D] split into heads; (q @ kᵀ) * scale + a relative-position bias [1, H, S, S]
    (or, `bias_rank` 3, [H, S, S]); the result is the output (a Softmax would make it attention)."""
    hd = [b, s, h, d]
    nodes = [
        n("Reshape", ["q", "hd"], ["q4"], name="q_heads"),
        n("Transpose", ["q4"], ["qh"], name="q_rot", perm=[0, 2, 1, 3]),
        n("Reshape", ["k", "hd"], ["k4"], name="k_heads"),
        n("Transpose", ["k4"], ["kt"], name="k_rot", perm=[0, 2, 3, 1]),
        n("MatMul", ["qh", "kt"], ["qk"], name="mm"),
        n("Mul", ["qk", "scale"], ["qks"], name="scale"),
        n("Add", ["qks", "bias"], ["y"], name="bias"),
    ]
    bias = weights(1, h, s, s, seed=5) if bias_rank == 4 else weights(h, s, s, seed=5)
    return tiny_model(
        nodes,
        {"q": [b, s, h * d], "k": [b, s, h * d]},
        {"y": [b, h, s, s]},
        {"hd": np.array(hd), "scale": np.array(d**-0.5, dtype=np.float32), "bias": bias},
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("bias_rank", [4, 3])
def test_a_batched_product_takes_its_epilogue_and_reads_through_the_heads(
    precision: str, bias_rank: int
) -> None:
    model = scores(bias_rank=bias_rank)
    _, plan = planned(model)
    assert claimed(plan) == [("gemm", RULE, ["mm", "scale", "bias"])]
    (g,) = plan.groups
    assert sorted(g.views) == ["kt", "qh"]  # both operands read in place: no Transpose is copied
    assert {x.name for x in g.absorbed} == {"q_heads", "q_rot", "k_heads", "k_rot"}
    cm = _check(model, precision)
    assert cm.report["kernels"]["after"] == 1
    (k,) = cm.plan.kernels.values()
    assert "batched GEMM kernel" in k.source


def test_batch_dims_broadcast_from_the_right() -> None:
    """A [H, M, K] weight times a [B, H, K, N] tensor, and a [M, K] A times a [B, K, N] B: the
    operand without (or with a unit) batch dim is read at stride 0 across the batch."""
    model = tiny_model(
        [
            n("MatMul", ["w", "x"], ["h"], name="mm"),
            n("Relu", ["h"], ["y"], name="relu"),
            n("MatMul", ["v", "x2"], ["h2"], name="mm2"),
            n("Sigmoid", ["h2"], ["y2"], name="gate"),
        ],
        {"x": [2, 3, 8, 5], "v": [6, 8], "x2": [2, 8, 7]},
        {"y": [2, 3, 6, 5], "y2": [2, 6, 7]},
        {"w": weights(3, 6, 8, seed=2)},
    )
    _, plan = planned(model)
    assert claimed(plan) == [("gemm", RULE, ["mm", "relu"]), ("gemm", RULE, ["mm2", "gate"])]
    cm = _check(model)
    assert cm.report["kernels"]["after"] == 2


def test_the_epilogue_reads_a_tensor_the_size_of_the_output_and_rows_past_m_are_masked() -> None:
    """M = 1 (a class token's query: cait's class attention) and N not a power of two; the epilogue
    adds a tensor of the output's own shape (a residual), loaded at each element's batch entry."""
    model = tiny_model(
        [
            n("Transpose", ["k"], ["kt"], name="k_rot", perm=[0, 1, 3, 2]),
            n("MatMul", ["q", "kt"], ["qk"], name="mm"),
            n("Add", ["qk", "r"], ["y"], name="residual"),
        ],
        {"q": [2, 4, 1, 16], "k": [2, 4, 37, 16], "r": [2, 4, 1, 37]},
        {"y": [2, 4, 1, 37]},
    )
    _, plan = planned(model)
    assert claimed(plan) == [("gemm", RULE, ["mm", "residual"])]
    cm = _check(model)
    assert cm.report["kernels"]["after"] == 1


def test_a_batched_product_alone_runs_as_the_librarys() -> None:
    """Nothing to fuse: the library's batched matmul reads the strided operands itself."""
    model = tiny_model(
        [
            n("Transpose", ["k"], ["kt"], name="k_rot", perm=[0, 2, 1]),
            n("MatMul", ["q", "kt"], ["y"], name="mm"),
        ],
        {"q": [3, 4, 8], "k": [3, 5, 8]},
        {"y": [3, 4, 5]},
    )
    _, plan = planned(model)
    assert claimed(plan) == []
    assert refusals(plan, RULE) == []


def test_batch_dims_that_do_not_broadcast_are_refused() -> None:
    from opfuse.ir.support import batch_reason

    assert batch_reason((2, 3), (3,)) is None
    assert batch_reason((2, 1), (4,)) is None
    assert batch_reason((2,), (3,)) == "batch dims (2,) and (3,) do not broadcast"
