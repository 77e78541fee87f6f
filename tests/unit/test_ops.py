"""Every per-op torch kernel (opfuse.runtime.ops) against onnxruntime on a one-node opset-18 model.

Each case builds the node with onnx.helper, runs it in onnxruntime's CPU provider and through
`run_op` with the node's attributes decoded the way the frontend decodes them, then compares every
output: dtype, shape, and values (1e-5 for floats, exact otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from opfuse.errors import ModelError
from opfuse.runtime.ops import SUPPORTED_OPS, VIEW_OPS, run_op
from opfuse.runtime.ops_nn import integer_matmul

OPSET = 18
INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
_rng = np.random.default_rng(20240518)


@dataclass
class Case:
    id: str
    op: str
    inputs: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)  # as onnx.helper.make_node takes them
    num_outputs: int = 1
    opset: int = OPSET


def normal(*shape: int, scale: float = 1.0) -> np.ndarray:
    x = np.asarray(_rng.standard_normal(shape) * scale, dtype=np.float32)
    x[x == 0] = 0.5  # never exact zeros: they hide sign and division bugs
    return x


def positive(*shape: int) -> np.ndarray:
    return np.asarray(_rng.uniform(0.5, 2.0, shape), dtype=np.float32)


def ints(*shape: int, lo: int = -5, hi: int = 6, dtype: type = np.int64) -> np.ndarray:
    return _rng.integers(lo, hi, shape).astype(dtype)


def nonzero_ints(*shape: int, dtype: type = np.int64) -> np.ndarray:
    x = np.asarray(ints(*shape, dtype=dtype))
    x[x == 0] = 3
    return x


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def bools(*shape: int) -> np.ndarray:
    return _rng.integers(0, 2, shape).astype(bool)


UNARY_OPS = ["Relu", "Sigmoid", "Tanh", "Erf", "Neg", "Abs", "Exp", "Floor", "Ceil", "Sign", "Sin", "Cos"]
UNARY_OPS += ["Softsign", "Softplus", "HardSwish", "Elu", "Selu", "LeakyRelu", "HardSigmoid", "Identity"]


def _unary_cases() -> list[Case]:
    cases = [Case(op, op, [normal(3, 4, 5)]) for op in UNARY_OPS]
    cases += [Case(op, op, [positive(3, 4, 5)]) for op in ["Sqrt", "Log", "Reciprocal"]]
    halves = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.3, -2.7, 0.49], dtype=np.float32)
    cases += [
        Case("Round-halves-to-even", "Round", [halves]),
        Case("Neg-int", "Neg", [ints(4, 5)]),
        Case("Abs-int32", "Abs", [ints(4, 5, dtype=np.int32)]),
        Case("Relu-large", "Relu", [normal(2, 3, 4, 5, scale=100.0)]),
        Case("Softplus-large", "Softplus", [normal(4, 5, scale=30.0)]),
        Case("HardSwish-wide", "HardSwish", [normal(4, 25, scale=4.0)]),
        Case("LeakyRelu-alpha", "LeakyRelu", [normal(3, 4)], {"alpha": 0.2}),
        Case("Elu-alpha", "Elu", [normal(3, 4)], {"alpha": 0.5}),
        Case("Selu-attrs", "Selu", [normal(3, 4)], {"alpha": 1.5, "gamma": 1.1}),
        Case("HardSigmoid-attrs", "HardSigmoid", [normal(3, 4, scale=4.0)], {"alpha": 0.3, "beta": 0.4}),
        Case("Gelu", "Gelu", [normal(3, 4, 5)], opset=20),
        Case("Gelu-tanh", "Gelu", [normal(3, 4, 5)], {"approximate": "tanh"}, opset=20),
        Case("Not", "Not", [bools(3, 4)]),
        Case("IsNaN", "IsNaN", [np.array([1.0, np.nan, -2.0, np.inf], dtype=np.float32)]),
    ]
    return cases


def _binary_cases() -> list[Case]:
    cases: list[Case] = []
    for op in ["Add", "Sub", "Mul", "Div"]:
        cases += [
            Case(f"{op}-same", op, [normal(3, 4), normal(3, 4)]),
            Case(f"{op}-broadcast", op, [normal(2, 3, 4), normal(3, 1)]),
            Case(f"{op}-scalar", op, [normal(3, 4), normal()]),
            Case(f"{op}-int64", op, [ints(3, 4), nonzero_ints(3, 4)]),
        ]
    cases += [
        Case(
            "Div-int32-negative",
            "Div",
            [i64(-7, 7, -7, 7, -1, 9).astype(np.int32), i64(2, 2, -2, -2, 3, -4).astype(np.int32)],
        ),
        Case("Div-int64-negative", "Div", [i64(-7, 7, -7, 7, -1, 9), i64(2, 2, -2, -2, 3, -4)]),
        Case("Pow-float", "Pow", [positive(3, 4), normal(3, 4)]),
        Case("Pow-square", "Pow", [normal(3, 4), np.array(2.0, dtype=np.float32)]),
        Case(
            "Pow-int-base-float-exp",
            "Pow",
            [i64(2, 3, -2, 5), np.array([0.5, 1.7, 2.0, 1.0], dtype=np.float32)],
        ),
        Case("Pow-float-base-int-exp", "Pow", [normal(3, 4), ints(3, 4, lo=0, hi=4)]),
        Case("Mod-fmod-float", "Mod", [normal(3, 4, scale=5.0), positive(3, 4)], {"fmod": 1}),
        Case("Mod-int", "Mod", [ints(3, 4, lo=-9, hi=10), nonzero_ints(3, 4)]),
        Case("Mod-int-fmod", "Mod", [ints(3, 4, lo=-9, hi=10), nonzero_ints(3, 4)], {"fmod": 1}),
    ]
    for op in ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]:
        # Small integers as floats, so that some elements compare equal.
        cases += [
            Case(f"{op}-float", op, [ints(3, 4).astype(np.float32), ints(3, 4).astype(np.float32)]),
            Case(f"{op}-int-broadcast", op, [ints(2, 3, 4), ints(4)]),
        ]
    cases += [Case("Equal-bool", "Equal", [bools(3, 4), bools(3, 4)])]
    cases += [Case(op, op, [bools(3, 4), bools(4)]) for op in ["And", "Or", "Xor"]]
    return cases


def _variadic_cases() -> list[Case]:
    cases: list[Case] = []
    for op in ["Max", "Min", "Sum", "Mean"]:
        cases += [
            Case(f"{op}-one", op, [normal(3, 4)]),
            Case(f"{op}-two", op, [normal(3, 4), normal(3, 4)]),
            Case(f"{op}-three-broadcast", op, [normal(2, 3, 4), normal(3, 1), normal(4)]),
        ]
    cases += [Case("Max-int", "Max", [ints(3, 4), ints(3, 4)]), Case("Min-int", "Min", [ints(3, 4), ints(4)])]
    cond = bools(3, 4)
    cases += [
        Case("Where", "Where", [cond, normal(3, 4), normal(3, 4)]),
        Case("Where-broadcast", "Where", [bools(4), normal(3, 1), normal(2, 3, 4)]),
        Case("Where-int", "Where", [cond, ints(3, 4), ints(1)]),
    ]
    x = normal(3, 4, 5, scale=2.0)
    lo, hi = np.array(-0.5, dtype=np.float32), np.array(0.7, dtype=np.float32)
    cases += [
        Case("Clip-both", "Clip", [x, lo, hi]),
        Case("Clip-min-only", "Clip", [x, lo]),
        Case("Clip-max-only", "Clip", [x, None, hi]),
        Case("Clip-none", "Clip", [x]),
        Case("Clip-min-above-max", "Clip", [x, hi, lo]),
        Case("Clip-int", "Clip", [ints(3, 4), i64(-2).reshape(()), i64(3).reshape(())]),
        Case("PRelu-channel", "PRelu", [normal(2, 4, 3, 3), normal(4, 1, 1)]),
        Case("PRelu-full", "PRelu", [normal(3, 4), normal(3, 4)]),
        Case("PRelu-scalar", "PRelu", [normal(3, 4), normal(1)]),
    ]
    return cases


def _cast_cases() -> list[Case]:
    scaled = normal(3, 4, scale=10.0)
    return [
        Case("Cast-float-int32", "Cast", [scaled], {"to": TensorProto.INT32}),
        Case("Cast-float-int64", "Cast", [scaled], {"to": TensorProto.INT64}),
        Case("Cast-float-int8", "Cast", [scaled], {"to": TensorProto.INT8}),
        Case("Cast-float-uint8", "Cast", [np.abs(scaled)], {"to": TensorProto.UINT8}),
        Case("Cast-float-float16", "Cast", [normal(3, 4)], {"to": TensorProto.FLOAT16}),
        Case("Cast-float-double", "Cast", [normal(3, 4)], {"to": TensorProto.DOUBLE}),
        Case("Cast-float-float", "Cast", [normal(3, 4)], {"to": TensorProto.FLOAT}),
        Case("Cast-float16-float", "Cast", [normal(3, 4).astype(np.float16)], {"to": TensorProto.FLOAT}),
        Case("Cast-int-float", "Cast", [ints(3, 4)], {"to": TensorProto.FLOAT}),
        Case("Cast-int-bool", "Cast", [ints(3, 4, lo=-1, hi=2)], {"to": TensorProto.BOOL}),
        Case("Cast-bool-float", "Cast", [bools(3, 4)], {"to": TensorProto.FLOAT}),
        Case("Cast-int64-int16", "Cast", [ints(3, 4, lo=-300, hi=300)], {"to": TensorProto.INT16}),
        Case("CastLike-float-int", "CastLike", [scaled, i64(1)]),
        Case("CastLike-int-float16", "CastLike", [ints(3, 4), np.ones(1, dtype=np.float16)]),
    ]


REDUCE_OPS = ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2"]
REDUCE_OPS += ["ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]


def _reduce_cases() -> list[Case]:
    cases: list[Case] = []
    for op in REDUCE_OPS:
        # Positive data: ReduceLogSum takes the log of the sum; ReduceProd stays well scaled.
        x = positive(3, 4, 5) if op in ("ReduceLogSum", "ReduceProd") else normal(3, 4, 5)
        cases += [
            Case(f"{op}-axis1", op, [x, i64(1)]),
            Case(f"{op}-axes02-nokeep", op, [x, i64(0, 2)], {"keepdims": 0}),
            Case(f"{op}-axis-neg", op, [x, i64(-1)]),
            Case(f"{op}-all-keep", op, [x]),
            Case(f"{op}-all-nokeep", op, [x], {"keepdims": 0}),
            Case(f"{op}-empty-axes", op, [x, i64()]),
        ]
    for op in ["ReduceMean", "ReduceSum", "ReduceMax"]:
        cases += [
            Case(f"{op}-noop", op, [normal(3, 4)], {"noop_with_empty_axes": 1}),
            Case(f"{op}-noop-empty-axes", op, [normal(3, 4), i64()], {"noop_with_empty_axes": 1}),
        ]
    cases += [
        Case("ReduceSumSquare-noop", "ReduceSumSquare", [normal(3, 4)], {"noop_with_empty_axes": 1}),
        Case("ReduceMax-int", "ReduceMax", [ints(3, 4), i64(1)]),
        Case("ReduceMin-int", "ReduceMin", [ints(3, 4)], {"keepdims": 0}),
        Case("ReduceSum-int", "ReduceSum", [ints(3, 4), i64(0)]),
        Case("ReduceMean-int", "ReduceMean", [ints(3, 4, lo=-50, hi=50), i64(1)]),
        Case("ReduceProd-int", "ReduceProd", [ints(3, 4, lo=1, hi=4), i64(0, 1)]),
    ]
    for op in ["ArgMax", "ArgMin"]:
        tied = ints(3, 4, 5, lo=0, hi=3).astype(np.float32)  # many ties
        cases += [
            Case(f"{op}-default", op, [normal(3, 4, 5)]),
            Case(f"{op}-axis-neg-nokeep", op, [normal(3, 4, 5)], {"axis": -1, "keepdims": 0}),
            Case(f"{op}-ties-first", op, [tied], {"axis": 1}),
            Case(f"{op}-ties-last", op, [tied], {"axis": 1, "select_last_index": 1}),
            Case(f"{op}-int", op, [ints(4, 5)], {"axis": 1}),
        ]
    for op in ["Softmax", "LogSoftmax"]:
        cases += [
            Case(f"{op}-default", op, [normal(3, 4, 5, scale=3.0)]),
            Case(f"{op}-axis1", op, [normal(3, 4, 5, scale=3.0)], {"axis": 1}),
            Case(f"{op}-axis0", op, [normal(3, 4, 5, scale=3.0)], {"axis": 0}),
            Case(f"{op}-1d", op, [normal(7, scale=3.0)]),
        ]
    return cases


def _matmul_cases() -> list[Case]:
    return [
        Case("MatMul-2d", "MatMul", [normal(3, 4), normal(4, 5)]),
        Case("MatMul-batched", "MatMul", [normal(2, 3, 4, 5), normal(2, 3, 5, 6)]),
        Case("MatMul-broadcast-batch", "MatMul", [normal(2, 1, 4, 5), normal(3, 5, 2)]),
        Case("MatMul-3d-2d", "MatMul", [normal(2, 3, 8), normal(8, 4)]),
        Case("MatMul-1d-2d", "MatMul", [normal(4), normal(4, 5)]),
        Case("MatMul-2d-1d", "MatMul", [normal(3, 4), normal(4)]),
        Case("MatMul-1d-1d", "MatMul", [normal(6), normal(6)]),
        Case("MatMul-1d-batched", "MatMul", [normal(4), normal(2, 4, 3)]),
        Case("MatMul-larger", "MatMul", [normal(16, 64), normal(64, 32)]),
        Case("MatMul-int", "MatMul", [ints(3, 4), ints(4, 2)]),
        Case("Gemm-default", "Gemm", [normal(3, 4), normal(4, 5), normal(5)]),
        Case("Gemm-no-c", "Gemm", [normal(3, 4), normal(4, 5)]),
        Case("Gemm-transA", "Gemm", [normal(4, 3), normal(4, 5), normal(3, 5)], {"transA": 1}),
        Case("Gemm-transB", "Gemm", [normal(3, 4), normal(5, 4), normal(5)], {"transB": 1}),
        Case("Gemm-transAB", "Gemm", [normal(4, 3), normal(5, 4), normal(3, 1)], {"transA": 1, "transB": 1}),
        Case(
            "Gemm-alpha-beta", "Gemm", [normal(3, 4), normal(4, 5), normal(3, 5)], {"alpha": 0.5, "beta": 2.0}
        ),
        Case("Gemm-alpha-no-c", "Gemm", [normal(3, 4), normal(4, 5)], {"alpha": 3.0}),
        Case("Gemm-beta-zero", "Gemm", [normal(3, 4), normal(4, 5), normal(5)], {"beta": 0.0}),
        Case("Gemm-scalar-c", "Gemm", [normal(3, 4), normal(4, 5), normal()]),
        Case("Gemm-c-1x1", "Gemm", [normal(3, 4), normal(4, 5), normal(1, 1)], {"beta": 0.5}),
        Case("Einsum-matmul", "Einsum", [normal(3, 4), normal(4, 5)], {"equation": "ij,jk->ik"}),
        Case("Einsum-batched", "Einsum", [normal(2, 3, 4), normal(2, 4, 5)], {"equation": "bij,bjk->bik"}),
        Case(
            "Einsum-attention",
            "Einsum",
            [normal(2, 2, 3, 4), normal(2, 2, 5, 4)],
            {"equation": "bhqd,bhkd->bhqk"},
        ),
        Case("Einsum-outer", "Einsum", [normal(3), normal(4)], {"equation": "i,j->ij"}),
        Case("Einsum-ellipsis", "Einsum", [normal(2, 3, 4)], {"equation": "...ij->...ji"}),
        Case("Einsum-trace", "Einsum", [normal(4, 4)], {"equation": "ii"}),
        Case("Einsum-implicit", "Einsum", [normal(3, 4), normal(4, 5)], {"equation": "ij,jk"}),
    ]


def _conv_cases() -> list[Case]:
    x = normal(2, 4, 7, 8)
    w = normal(6, 4, 3, 3)
    b = normal(6)
    return [
        Case("Conv-2d", "Conv", [x, w, b]),
        Case("Conv-2d-no-bias", "Conv", [x, w]),
        Case("Conv-2d-kernel-shape", "Conv", [x, w, b], {"kernel_shape": [3, 3]}),
        Case("Conv-2d-pads", "Conv", [x, w, b], {"pads": [1, 1, 1, 1]}),
        Case("Conv-2d-asym-pads", "Conv", [x, w, b], {"pads": [0, 1, 2, 1]}),
        Case("Conv-2d-strides", "Conv", [x, w, b], {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
        Case("Conv-2d-strides-uneven", "Conv", [x, w, b], {"strides": [2, 3]}),
        Case("Conv-2d-dilations", "Conv", [x, w, b], {"dilations": [2, 2], "pads": [2, 2, 2, 2]}),
        Case("Conv-2d-group2", "Conv", [x, normal(6, 2, 3, 3), b], {"group": 2, "pads": [1, 1, 1, 1]}),
        Case("Conv-2d-depthwise", "Conv", [x, normal(4, 1, 3, 3), normal(4)], {"group": 4}),
        Case("Conv-2d-1x1", "Conv", [x, normal(6, 4, 1, 1), b]),
        Case("Conv-2d-rect-kernel", "Conv", [x, normal(6, 4, 2, 3), b], {"pads": [1, 0, 0, 1]}),
        Case("Conv-2d-same-upper", "Conv", [x, w, b], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
        Case("Conv-2d-same-lower", "Conv", [x, w, b], {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
        Case(
            "Conv-2d-same-upper-even-kernel", "Conv", [x, normal(6, 4, 2, 2), b], {"auto_pad": "SAME_UPPER"}
        ),
        Case(
            "Conv-2d-same-lower-even-kernel", "Conv", [x, normal(6, 4, 2, 2), b], {"auto_pad": "SAME_LOWER"}
        ),
        Case("Conv-2d-valid", "Conv", [x, w, b], {"auto_pad": "VALID", "strides": [2, 2]}),
        Case(
            "Conv-1d",
            "Conv",
            [normal(2, 3, 10), normal(5, 3, 3), normal(5)],
            {"pads": [1, 2], "strides": [2]},
        ),
        Case("Conv-1d-dilated", "Conv", [normal(2, 3, 10), normal(5, 3, 3)], {"dilations": [3]}),
        Case("Conv-3d", "Conv", [normal(1, 2, 5, 6, 4), normal(3, 2, 3, 3, 3), normal(3)], {"pads": [1] * 6}),
        Case(
            "Conv-3d-strided",
            "Conv",
            [normal(1, 2, 5, 6, 4), normal(4, 1, 2, 2, 2)],
            {"strides": [2, 1, 2], "group": 2},
        ),
    ]


def _pool_cases() -> list[Case]:
    x = normal(2, 3, 7, 8)
    cases: list[Case] = []
    for op in ["MaxPool", "AveragePool"]:
        cases += [
            Case(f"{op}-k3", op, [x], {"kernel_shape": [3, 3]}),
            Case(f"{op}-k2s2", op, [x], {"kernel_shape": [2, 2], "strides": [2, 2]}),
            Case(f"{op}-pads", op, [x], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
            Case(f"{op}-asym-pads", op, [x], {"kernel_shape": [3, 3], "pads": [0, 1, 1, 2]}),
            Case(
                f"{op}-wide-pads", op, [x], {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2], "strides": [2, 2]}
            ),
            Case(f"{op}-ceil", op, [x], {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
            Case(f"{op}-ceil-k3s2", op, [x], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
            Case(
                f"{op}-ceil-pads",
                op,
                [x],
                {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
            ),
            Case(
                f"{op}-ceil-asym-pads",
                op,
                [x],
                {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1},
            ),
            Case(
                f"{op}-ceil-wide-pads",
                op,
                [x],
                {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [2, 2, 2, 2], "ceil_mode": 1},
            ),
            Case(
                f"{op}-same-upper-1d",
                op,
                [normal(2, 3, 10)],
                {"kernel_shape": [4], "strides": [3], "auto_pad": "SAME_UPPER"},
            ),
            Case(
                f"{op}-ceil-end-pads",
                op,
                [normal(1, 2, 6, 6)],
                {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 1, 1], "ceil_mode": 1},
            ),
            Case(
                f"{op}-same-upper",
                op,
                [x],
                {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
            ),
            Case(f"{op}-same-lower", op, [x], {"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"}),
            Case(f"{op}-valid", op, [x], {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "VALID"}),
            Case(f"{op}-1d", op, [normal(2, 3, 11)], {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
            Case(f"{op}-3d", op, [normal(1, 2, 5, 6, 4)], {"kernel_shape": [2, 2, 2], "strides": [1, 2, 2]}),
        ]
    cases += [
        Case("MaxPool-dilations", "MaxPool", [x], {"kernel_shape": [2, 2], "dilations": [2, 2]}),
        Case(
            "MaxPool-dilations-pads",
            "MaxPool",
            [x],
            {"kernel_shape": [3, 3], "dilations": [2, 1], "pads": [2, 1, 2, 1]},
        ),
        Case(
            "AveragePool-dilations",
            "AveragePool",
            [x],
            {"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]},
            opset=19,
        ),
        Case(
            "AveragePool-dilations-count-pad",
            "AveragePool",
            [x],
            {"kernel_shape": [2, 2], "dilations": [2, 1], "pads": [1, 0, 1, 1], "count_include_pad": 1},
            opset=19,
        ),
        Case(
            "MaxPool-dilations-ceil",
            "MaxPool",
            [x],
            {"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [2, 2], "ceil_mode": 1},
        ),
    ]
    count_pad_geometries: dict[str, dict[str, Any]] = {
        "pads": {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
        "asym-pads": {"kernel_shape": [3, 3], "pads": [0, 1, 1, 2]},
        "ceil-pads": {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
        "ceil-end-pads": {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 1, 1], "ceil_mode": 1},
        "ceil-asym-pads": {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1},
        "ceil": {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
        "same-upper": {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
        "1d-pads": {"kernel_shape": [3], "pads": [1, 1]},
    }
    for name, attrs in count_pad_geometries.items():
        data = normal(2, 3, 11) if name.startswith("1d") else x
        cases.append(
            Case(f"AveragePool-count-pad-{name}", "AveragePool", [data], {**attrs, "count_include_pad": 1})
        )
    cases += [
        Case("GlobalAveragePool-2d", "GlobalAveragePool", [x]),
        Case("GlobalAveragePool-1d", "GlobalAveragePool", [normal(2, 3, 9)]),
        Case("GlobalMaxPool-2d", "GlobalMaxPool", [x]),
    ]
    return cases


def _norm_cases() -> list[Case]:
    def bn_params(c: int) -> list[np.ndarray]:
        return [normal(c), normal(c), normal(c), positive(c)]

    x = normal(2, 4, 5)
    return [
        Case("BatchNormalization-4d", "BatchNormalization", [normal(2, 3, 4, 5), *bn_params(3)]),
        Case("BatchNormalization-2d", "BatchNormalization", [normal(6, 3), *bn_params(3)]),
        Case(
            "BatchNormalization-3d-eps",
            "BatchNormalization",
            [normal(2, 3, 7), *bn_params(3)],
            {"epsilon": 0.1},
        ),
        Case("LayerNormalization-last", "LayerNormalization", [x, normal(5), normal(5)]),
        Case("LayerNormalization-no-bias", "LayerNormalization", [x, normal(5)]),
        Case("LayerNormalization-axis1", "LayerNormalization", [x, normal(4, 5), normal(4, 5)], {"axis": 1}),
        Case("LayerNormalization-eps", "LayerNormalization", [x, normal(5), normal(5)], {"epsilon": 0.5}),
        Case("LayerNormalization-stats", "LayerNormalization", [x, normal(5), normal(5)], num_outputs=3),
        Case(
            "LayerNormalization-stats-axis-neg2",
            "LayerNormalization",
            [x, normal(4, 5)],
            {"axis": -2},
            num_outputs=3,
        ),
        Case(
            "LayerNormalization-broadcast-scale",
            "LayerNormalization",
            [x, normal(1, 5), normal(4, 1)],
            {"axis": 1},
        ),
    ]


def _shape_cases() -> list[Case]:
    x = normal(2, 3, 4)
    cases = [
        Case("Reshape", "Reshape", [x, i64(6, 4)]),
        Case("Reshape-minus-one", "Reshape", [x, i64(-1, 2)]),
        Case("Reshape-zero-copies", "Reshape", [x, i64(0, -1)]),
        Case("Reshape-zero-middle", "Reshape", [x, i64(2, 0, 2, 2)]),
        Case("Reshape-allowzero", "Reshape", [x, i64(4, -1)], {"allowzero": 1}),
        Case(
            "Reshape-empty-allowzero",
            "Reshape",
            [np.zeros((0, 3), dtype=np.float32), i64(3, 0)],
            {"allowzero": 1},
        ),
        Case("Flatten-default", "Flatten", [normal(2, 3, 4, 5)]),
        Case("Flatten-axis0", "Flatten", [x], {"axis": 0}),
        Case("Flatten-axis2", "Flatten", [x], {"axis": 2}),
        Case("Flatten-axis-rank", "Flatten", [x], {"axis": 3}),
        Case("Flatten-axis-neg", "Flatten", [normal(2, 3, 4, 5)], {"axis": -1}),
        Case("Flatten-int", "Flatten", [ints(2, 3, 2)], {"axis": -2}),
        Case("Transpose-default", "Transpose", [x]),
        Case("Transpose-perm", "Transpose", [x], {"perm": [1, 0, 2]}),
        Case("Transpose-perm-4d", "Transpose", [normal(2, 3, 4, 5)], {"perm": [0, 2, 3, 1]}),
        Case("Squeeze-all", "Squeeze", [normal(1, 3, 1, 4)]),
        Case("Squeeze-axes", "Squeeze", [normal(1, 3, 1, 4), i64(2)]),
        Case("Squeeze-neg-axes", "Squeeze", [normal(1, 3, 1, 4), i64(0, -2)]),
        Case("Unsqueeze", "Unsqueeze", [x, i64(0)]),
        Case("Unsqueeze-several", "Unsqueeze", [x, i64(4, 1)]),
        Case("Unsqueeze-neg", "Unsqueeze", [x, i64(-1)]),
        Case("Unsqueeze-scalar", "Unsqueeze", [normal(), i64(0)]),
        Case("Identity-int", "Identity", [ints(3)]),
        Case("Dropout", "Dropout", [x]),
        Case("Dropout-ratio", "Dropout", [x, np.array(0.3, dtype=np.float32)]),
        Case("Dropout-mask", "Dropout", [x], num_outputs=2),
        Case("Shape", "Shape", [x]),
        Case("Shape-start", "Shape", [x], {"start": 1}),
        Case("Shape-neg-end", "Shape", [x], {"end": -1}),
        Case("Shape-neg-start", "Shape", [x], {"start": -2}),
        Case("Shape-clamped", "Shape", [x], {"start": -10, "end": 10}),
        Case("Shape-empty", "Shape", [x], {"start": 2, "end": 1}),
        Case("Shape-scalar", "Shape", [normal()]),
        Case("Size", "Size", [x]),
        Case("Size-scalar", "Size", [normal()]),
        Case("Gather-axis0", "Gather", [normal(5, 3), i64(0, 4, -1, 2)]),
        Case(
            "Gather-axis1-2d-indices",
            "Gather",
            [normal(2, 5, 3), i64(0, -2, 4, 1).reshape(2, 2)],
            {"axis": 1},
        ),
        Case("Gather-scalar-index", "Gather", [normal(5, 3), i64(-1).reshape(())]),
        Case("Gather-axis-neg", "Gather", [normal(2, 5, 3), i64(2, 0)], {"axis": -1}),
        Case("Gather-int32-indices", "Gather", [ints(5, 3), i64(1, -3).astype(np.int32)]),
        Case("Gather-shape-vector", "Gather", [i64(2, 3, 4), i64(1).reshape(())]),
        Case("GatherElements", "GatherElements", [normal(3, 4), ints(3, 2, lo=-4, hi=4)], {"axis": 1}),
        Case("GatherElements-axis0", "GatherElements", [normal(3, 4), ints(2, 4, lo=-3, hi=3)]),
        Case("Concat-axis0", "Concat", [normal(2, 3), normal(4, 3)], {"axis": 0}),
        Case("Concat-axis-neg", "Concat", [normal(2, 3), normal(2, 1), normal(2, 4)], {"axis": -1}),
        Case("Concat-int", "Concat", [i64(1, 2), i64(3)], {"axis": 0}),
        Case("Concat-one", "Concat", [x], {"axis": 1}),
        Case("Split-sizes", "Split", [normal(6, 4), i64(2, 4)], num_outputs=2),
        Case("Split-sizes-axis1", "Split", [normal(3, 7), i64(1, 2, 4)], {"axis": 1}, num_outputs=3),
        Case("Split-num-outputs", "Split", [normal(6, 4)], {"num_outputs": 3}, num_outputs=3),
        Case(
            "Split-num-outputs-uneven", "Split", [normal(3, 7)], {"axis": -1, "num_outputs": 3}, num_outputs=3
        ),
        Case("Expand", "Expand", [normal(3, 1), i64(2, 3, 4)]),
        Case("Expand-keeps-larger-dim", "Expand", [normal(3, 4), i64(1, 4)]),
        Case("Expand-ones", "Expand", [normal(3, 1), i64(1, 1, 5)]),
        Case("Expand-int", "Expand", [ints(1, 3), i64(2, 1)]),
        Case("Tile", "Tile", [x, i64(1, 2, 3)]),
        Case("Tile-int", "Tile", [ints(2, 3), i64(3, 1)]),
        Case("Trilu-upper", "Trilu", [normal(4, 5)]),
        Case("Trilu-lower", "Trilu", [normal(4, 5)], {"upper": 0}),
        Case("Trilu-upper-k", "Trilu", [normal(2, 4, 5), i64(1).reshape(())]),
        Case("Trilu-lower-neg-k", "Trilu", [normal(2, 4, 5), i64(-1).reshape(())], {"upper": 0}),
        Case("Trilu-int", "Trilu", [ints(4, 4), i64(2).reshape(())], {"upper": 0}),
    ]
    return cases


def _slice_cases() -> list[Case]:
    x = normal(5, 6, 7)
    return [
        Case("Slice-basic", "Slice", [x, i64(1, 2), i64(4, 5)]),
        Case("Slice-axes", "Slice", [x, i64(1), i64(6), i64(2)]),
        Case("Slice-neg-axes", "Slice", [x, i64(1, 0), i64(-1, 3), i64(-1, 0)]),
        Case("Slice-neg-start-end", "Slice", [x, i64(-4), i64(-1), i64(1)]),
        Case("Slice-clamped", "Slice", [x, i64(-100, 2), i64(INT64_MAX, 100), i64(0, 1)]),
        Case("Slice-steps", "Slice", [x, i64(0, 1), i64(5, 7), i64(0, 2), i64(2, 3)]),
        Case("Slice-reverse", "Slice", [x, i64(-1), i64(INT64_MIN), i64(1), i64(-1)]),
        Case("Slice-neg-step-2", "Slice", [x, i64(6), i64(0), i64(2), i64(-2)]),
        Case("Slice-neg-step-clamped-start", "Slice", [x, i64(100), i64(-100), i64(0), i64(-3)]),
        Case("Slice-mixed-steps", "Slice", [x, i64(4, 0), i64(0, 7), i64(0, 2), i64(-1, 3)]),
        Case("Slice-empty", "Slice", [x, i64(3), i64(3), i64(1)]),
        Case("Slice-empty-neg-step", "Slice", [x, i64(1), i64(4), i64(1), i64(-1)]),
        Case("Slice-int", "Slice", [i64(2, 3, 4, 5), i64(1), i64(3)]),
    ]


def _pad_cases() -> list[Case]:
    x = normal(2, 3, 4, 5)
    v = np.array(1.5, dtype=np.float32)
    cases = [
        Case("Pad-constant", "Pad", [x, i64(0, 0, 1, 2, 0, 0, 2, 1)]),
        Case("Pad-constant-value", "Pad", [x, i64(0, 1, 1, 0, 1, 0, 0, 2), v]),
        Case("Pad-constant-negative", "Pad", [x, i64(0, 0, -1, 1, 0, 0, 1, -2), v]),
        Case("Pad-constant-axes", "Pad", [x, i64(1, 2, 3, 0), v, i64(1, -1)]),
        Case("Pad-constant-int", "Pad", [ints(3, 4), i64(1, 0, 0, 2), i64(7).reshape(())]),
        Case("Pad-constant-1d", "Pad", [normal(5), i64(2, 3)]),
    ]
    for mode in ["reflect", "edge"]:
        cases += [
            Case(f"Pad-{mode}-hw", "Pad", [x, i64(0, 0, 1, 2, 0, 0, 2, 1)], {"mode": mode}),
            Case(f"Pad-{mode}-last", "Pad", [normal(2, 3, 6), i64(0, 0, 2, 0, 0, 3)], {"mode": mode}),
            Case(f"Pad-{mode}-leading-dim", "Pad", [x, i64(1, 2, 0, 0, 1, 0, 0, 0)], {"mode": mode}),
            Case(f"Pad-{mode}-axes", "Pad", [x, i64(1, 2, 2, 1), None, i64(1, 3)], {"mode": mode}),
            Case(f"Pad-{mode}-2d", "Pad", [normal(4, 5), i64(2, 1, 3, 2)], {"mode": mode}),
            Case(f"Pad-{mode}-negative", "Pad", [x, i64(0, 0, -1, 2, 0, 0, 1, -2)], {"mode": mode}),
        ]
    cases += [Case("Pad-wrap", "Pad", [normal(3, 5), i64(1, 2, 2, 3)], {"mode": "wrap"}, opset=19)]
    return cases


def _constant_cases() -> list[Case]:
    return [
        Case("Constant-value-float", "Constant", [], {"value": numpy_helper.from_array(normal(3, 4))}),
        Case("Constant-value-int", "Constant", [], {"value": numpy_helper.from_array(ints(5))}),
        Case(
            "Constant-value-scalar",
            "Constant",
            [],
            {"value": numpy_helper.from_array(np.array(2.5, np.float32))},
        ),
        Case("Constant-value-float-attr", "Constant", [], {"value_float": 1.25}),
        Case("Constant-value-floats", "Constant", [], {"value_floats": [1.0, -2.5, 3.0]}),
        Case("Constant-value-int-attr", "Constant", [], {"value_int": 7}),
        Case("Constant-value-ints", "Constant", [], {"value_ints": [1, -2, 3]}),
        Case("ConstantOfShape-default", "ConstantOfShape", [i64(2, 3)]),
        Case(
            "ConstantOfShape-float",
            "ConstantOfShape",
            [i64(2, 3)],
            {"value": numpy_helper.from_array(np.array([1.5], np.float32))},
        ),
        Case(
            "ConstantOfShape-int",
            "ConstantOfShape",
            [i64(4)],
            {"value": numpy_helper.from_array(np.array([7], np.int64))},
        ),
        Case(
            "ConstantOfShape-scalar",
            "ConstantOfShape",
            [i64()],
            {"value": numpy_helper.from_array(np.array([3], np.int32))},
        ),
        Case(
            "Range-float",
            "Range",
            [np.array(0.1, np.float32), np.array(3.0, np.float32), np.array(0.3, np.float32)],
        ),
        Case(
            "Range-float-negative",
            "Range",
            [np.array(2.0, np.float32), np.array(-1.0, np.float32), np.array(-0.5, np.float32)],
        ),
        Case("Range-int", "Range", [i64(1).reshape(()), i64(10).reshape(()), i64(3).reshape(())]),
        Case("Range-int-negative", "Range", [i64(5).reshape(()), i64(-5).reshape(()), i64(-2).reshape(())]),
        Case("Range-empty", "Range", [i64(5).reshape(()), i64(1).reshape(()), i64(1).reshape(())]),
        Case("Range-int32", "Range", [np.array(0, np.int32), np.array(7, np.int32), np.array(2, np.int32)]),
    ]


CASES: list[Case] = [
    *_unary_cases(),
    *_binary_cases(),
    *_variadic_cases(),
    *_cast_cases(),
    *_reduce_cases(),
    *_matmul_cases(),
    *_conv_cases(),
    *_pool_cases(),
    *_norm_cases(),
    *_shape_cases(),
    *_slice_cases(),
    *_pad_cases(),
    *_constant_cases(),
]


def _decode_attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """Attributes as plain Python values, the way the frontend hands them to `run_op`."""
    attrs: dict[str, Any] = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, list):
            value = [v.decode() if isinstance(v, bytes) else v for v in value]
        attrs[attr.name] = value
    return attrs


def _one_node_model(case: Case) -> onnx.ModelProto:
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(case.inputs)]
    outputs = [f"out{i}" for i in range(case.num_outputs)]
    node = helper.make_node(case.op, names, outputs, **case.attrs)
    graph_inputs = [
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
        for name, x in zip(names, case.inputs, strict=True)
        if x is not None
    ]
    # Output types are left to onnxruntime's inference: no type here to get wrong.
    graph_outputs = [helper.make_value_info(name, onnx.TypeProto()) for name in outputs]
    graph = helper.make_graph([node], case.id, graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)], ir_version=10)


def _assert_same(expected: np.ndarray, actual: torch.Tensor, what: str) -> None:
    got = actual.detach().cpu().numpy()
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, onnxruntime has {expected.dtype}"
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, onnxruntime has {expected.shape}"
    if np.issubdtype(expected.dtype, np.floating):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_op_matches_onnxruntime(case: Case) -> None:
    model = _one_node_model(case)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {f"in{i}": x for i, x in enumerate(case.inputs) if x is not None}
    expected = session.run(None, feeds)

    inputs = [torch.from_numpy(x.copy()) if x is not None else None for x in case.inputs]
    actual = run_op(case.op, inputs, _decode_attrs(model.graph.node[0]), num_outputs=case.num_outputs)

    assert len(actual) == len(expected)
    for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
        _assert_same(want, got, f"{case.id} output {i}")


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


REQUIRED_OPS = {
    "MatMul", "Gemm", "Conv", "BatchNormalization", "Relu", "Sigmoid", "Tanh", "Erf", "Add", "Sub", "Mul",
    "Div", "Pow", "Sqrt", "Exp", "Log", "Neg", "Abs", "Reciprocal", "Max", "Min", "Clip", "LeakyRelu", "Elu",
    "HardSigmoid", "HardSwish", "Gelu", "Softplus", "Where", "Equal", "Less", "Greater", "Not", "And", "Or",
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "Softmax", "LogSoftmax", "Reshape",
    "Transpose", "Flatten", "Squeeze", "Unsqueeze", "GlobalAveragePool", "AveragePool", "MaxPool", "Dropout",
    "Identity", "Shape", "Size", "Gather", "Concat", "Split", "Slice", "Expand", "Cast", "CastLike", "Constant",
    "ConstantOfShape", "Range", "Tile", "Pad", "Einsum", "LayerNormalization", "Trilu",
}  # fmt: skip


def test_required_ops_are_supported() -> None:
    assert REQUIRED_OPS <= SUPPORTED_OPS, sorted(REQUIRED_OPS - SUPPORTED_OPS)


def test_every_supported_op_is_checked_against_onnxruntime() -> None:
    # The ops added later are checked in test_ops_extended (imported here, not at the top: that
    # module imports this one).
    from tests.unit.test_ops_extended import EXTENDED_CASES

    tested = {c.op for c in [*CASES, *EXTENDED_CASES]}
    assert tested >= SUPPORTED_OPS, f"ops with no onnxruntime case: {sorted(SUPPORTED_OPS - tested)}"


def test_view_ops_are_supported_ops() -> None:
    assert VIEW_OPS <= SUPPORTED_OPS, sorted(VIEW_OPS - SUPPORTED_OPS)


def test_split_without_sizes_splits_into_node_outputs() -> None:
    # Not valid at opset 18 (onnxruntime rejects it), but older exports relied on it: equal parts,
    # as many as the node has outputs.
    x = torch.arange(12.0).reshape(2, 6)
    outs = run_op("Split", [x], {"axis": 1}, num_outputs=3)
    assert [o.tolist() for o in outs] == [o.tolist() for o in torch.chunk(x, 3, dim=1)]


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [
        ((3, 4), (4, 5)),
        ((4,), (4, 5)),
        ((3, 4), (4,)),
        ((4,), (4,)),
        ((2, 1, 3, 4), (5, 4, 2)),
        ((4,), (2, 4, 3)),
    ],
)
def test_integer_matmul_matches_torch(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> None:
    # The CUDA path for integer MatMul, checked on the CPU against torch's own integer matmul.
    a = torch.from_numpy(ints(*a_shape, dtype=np.int32))
    b = torch.from_numpy(ints(*b_shape, dtype=np.int32))
    got = integer_matmul(a, b)
    assert got.dtype == torch.int32
    assert torch.equal(got, torch.matmul(a, b))


def test_unknown_op_raises_model_error_naming_it() -> None:
    with pytest.raises(ModelError, match="NoSuchOp"):
        run_op("NoSuchOp", [torch.ones(2)], {})


def test_missing_output_raises_model_error() -> None:
    with pytest.raises(ModelError, match="Relu"):
        run_op("Relu", [torch.ones(1, 1, 4, 4)], {}, num_outputs=2)


def test_missing_required_input_raises_model_error() -> None:
    with pytest.raises(ModelError, match="Add"):
        run_op("Add", [torch.ones(2), None], {})


def test_unsupported_cast_target_raises_model_error() -> None:
    with pytest.raises(ModelError, match="element type 8"):
        run_op("Cast", [torch.ones(2)], {"to": TensorProto.STRING})


# Single-op calls whose result must share storage with the input: the VIEW_OPS promise that the
# op launches no kernel.
VIEW_CALLS: list[tuple[str, list[torch.Tensor | None], dict[str, Any]]] = [
    ("Identity", [torch.ones(2, 3)], {}),
    ("Dropout", [torch.ones(2, 3)], {}),
    ("Reshape", [torch.ones(2, 3), torch.tensor([3, 2])], {}),
    ("Flatten", [torch.ones(2, 3, 4)], {}),
    ("Squeeze", [torch.ones(2, 1, 3)], {}),
    ("Unsqueeze", [torch.ones(2, 3), torch.tensor([0])], {}),
    ("Transpose", [torch.ones(2, 3)], {}),
    ("Expand", [torch.ones(3, 1), torch.tensor([2, 3, 4])], {}),
    ("Slice", [torch.ones(4, 5), torch.tensor([1]), torch.tensor([3]), torch.tensor([1])], {}),
    ("Split", [torch.ones(4, 6), torch.tensor([2, 4])], {"axis": 1}),
]


@pytest.mark.parametrize(("op", "inputs", "attrs"), VIEW_CALLS, ids=[c[0] for c in VIEW_CALLS])
def test_view_ops_return_views(op: str, inputs: list[torch.Tensor | None], attrs: dict[str, Any]) -> None:
    assert op in VIEW_OPS
    x = inputs[0]
    assert x is not None
    outs = run_op(op, inputs, attrs, num_outputs=2 if op == "Split" else 1)
    for out in outs:
        assert out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
