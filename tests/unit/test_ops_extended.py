"""The per-op torch kernels added for issue 3 (exporters' ops beyond the first 94), each against
onnxruntime on a one-node model, as tests/unit/test_ops.py checks the others.

Ops onnxruntime does not run at the needed opset (Swish, CumProd, signed BitShift, float Mod with
fmod=0) are checked against the ONNX reference implementation instead.
"""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
import torch
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from opfuse.errors import ModelError
from opfuse.runtime import ops_recurrent
from opfuse.runtime.ops import run_op
from tests.builders import TEST_DEVICE
from tests.unit.test_ops import (
    Case,
    _assert_same,
    _decode_attrs,
    _one_node_model,
    bools,
    i64,
    ints,
    normal,
    positive,
)

# Cases whose expected outputs come from onnx.reference rather than onnxruntime.
ONNX_REFERENCE = {"Swish", "Swish-alpha", "CumProd", "CumProd-exclusive-reverse", "BitShift-int32-right"}
# onnxruntime refuses even LRN sizes; the ONNX reference loops over the batch dim where it means the
# channels, which is right when the two are equal, as in that case.
ONNX_REFERENCE |= {"Mod-float-fmod0", "LRN-even"}
# onnxruntime resizes uint8 images in fixed point, truncating; the ONNX reference (and opfuse) round.
ONNX_REFERENCE |= {"Resize-uint8", "Range-float16", "SwiGLU"}


def _math_cases() -> list[Case]:
    unit = np.asarray(np.random.default_rng(3).uniform(-0.9, 0.9, (3, 4)), dtype=np.float32)
    cases = [Case(op, op, [unit]) for op in ["Tan", "Acos", "Asin", "Atan", "Sinh", "Cosh", "Asinh", "Atanh"]]
    cases += [Case("Acosh", "Acosh", [positive(3, 4) + 1.0])]
    special = np.array([1.0, np.inf, -np.inf, np.nan, 0.0], dtype=np.float32)
    cases += [
        Case("IsInf", "IsInf", [special]),
        Case("IsInf-negative-only", "IsInf", [special], {"detect_positive": 0}),
        Case("IsInf-positive-only", "IsInf", [special], {"detect_negative": 0}),
        Case("BitwiseNot", "BitwiseNot", [ints(3, 4, lo=-50, hi=50, dtype=np.int32)]),
        Case("BitwiseAnd", "BitwiseAnd", [ints(3, 4, lo=0, hi=200), ints(4, lo=0, hi=200)]),
        Case(
            "BitwiseOr",
            "BitwiseOr",
            [ints(3, 4, lo=0, hi=200, dtype=np.uint8), ints(3, 4, lo=0, hi=200, dtype=np.uint8)],
        ),
        Case(
            "BitwiseXor",
            "BitwiseXor",
            [ints(3, 4, lo=-9, hi=9, dtype=np.int8), ints(3, 4, lo=-9, hi=9, dtype=np.int8)],
        ),
        Case(
            "BitShift-uint8-left",
            "BitShift",
            [ints(3, 4, lo=0, hi=30, dtype=np.uint8), ints(3, 4, lo=0, hi=4, dtype=np.uint8)],
            {"direction": "LEFT"},
        ),
        Case(
            "BitShift-uint8-right",
            "BitShift",
            [ints(3, 4, lo=0, hi=250, dtype=np.uint8), ints(4, lo=0, hi=9, dtype=np.uint8)],
            {"direction": "RIGHT"},
        ),
        Case(
            "BitShift-int32-right",
            "BitShift",
            [ints(3, 4, lo=-900, hi=900, dtype=np.int32), ints(3, 4, lo=-2, hi=40, dtype=np.int32)],
            {"direction": "RIGHT"},
            opset=28,
        ),
        Case("Mod-float-fmod0", "Mod", [normal(3, 4, scale=5.0), normal(3, 4)], opset=28),
        Case("HannWindow", "HannWindow", [np.array(10, dtype=np.int64)], opset=17),
        Case(
            "HammingWindow-symmetric",
            "HammingWindow",
            [np.array(7, dtype=np.int32)],
            {"periodic": 0},
            opset=17,
        ),
        Case(
            "BlackmanWindow-double",
            "BlackmanWindow",
            [np.array(9, dtype=np.int64)],
            {"output_datatype": 11},
            opset=17,
        ),
    ]
    return cases


def _activation_cases() -> list[Case]:
    x = normal(3, 4, 5, scale=3.0)
    return [
        Case("Celu", "Celu", [x]),
        Case("Celu-alpha", "Celu", [x], {"alpha": 0.5}),
        Case("Mish", "Mish", [x], opset=22),
        Case("ThresholdedRelu", "ThresholdedRelu", [x]),
        Case("ThresholdedRelu-alpha", "ThresholdedRelu", [x], {"alpha": 0.3}),
        Case("Shrink", "Shrink", [x], {"bias": 0.5, "lambd": 1.0}),
        Case("SwiGLU", "SwiGLU", [x, normal(3, 4, 5)], {"alpha": 1.5}, opset=28),
        Case("Shrink-int", "Shrink", [ints(3, 4, lo=-5, hi=6, dtype=np.int32)], {"bias": 1.0, "lambd": 2.0}),
        Case("Swish", "Swish", [x], opset=24),
        Case("Swish-alpha", "Swish", [x], {"alpha": 1.702}, opset=24),
        Case("Hardmax", "Hardmax", [normal(2, 3, 5)]),
        Case("Hardmax-axis0", "Hardmax", [np.array([[1, 3], [3, 1], [3, 3]], dtype=np.float32)], {"axis": 0}),
    ]


def _norm_cases() -> list[Case]:
    x = normal(2, 6, 4, 5, scale=2.0)
    return [
        Case("InstanceNormalization", "InstanceNormalization", [x, normal(6), normal(6)], {"epsilon": 1e-3}),
        Case("InstanceNormalization-1d", "InstanceNormalization", [normal(2, 3, 7), normal(3), normal(3)]),
        Case("GroupNormalization-18", "GroupNormalization", [x, normal(3), normal(3)], {"num_groups": 3}),
        Case(
            "GroupNormalization-21",
            "GroupNormalization",
            [x, normal(6), normal(6)],
            {"num_groups": 2, "epsilon": 1e-3},
            opset=21,
        ),
        Case("RMSNormalization", "RMSNormalization", [normal(2, 5, 8), normal(8)], opset=23),
        Case(
            "RMSNormalization-axis",
            "RMSNormalization",
            [normal(2, 5, 8), normal(5, 8)],
            {"axis": 1},
            opset=23,
        ),
        Case("MeanVarianceNormalization", "MeanVarianceNormalization", [x], {"axes": [0, 2, 3]}),
        Case("MeanVarianceNormalization-last", "MeanVarianceNormalization", [x], {"axes": [3]}),
        Case("LpNormalization", "LpNormalization", [normal(3, 4)]),
        Case("LpNormalization-p1-axis0", "LpNormalization", [normal(3, 4)], {"p": 1, "axis": 0}),
        Case("LRN", "LRN", [x], {"size": 3}),
        Case("LRN-even", "LRN", [normal(4, 4, 2, 3)], {"size": 4, "alpha": 0.01, "beta": 0.5, "bias": 2.0}),
    ]


def _conv_cases() -> list[Case]:
    x = normal(2, 4, 5, 6)
    w = normal(4, 3, 3, 3)
    return [
        Case("ConvTranspose", "ConvTranspose", [x, w, normal(3)]),
        Case("ConvTranspose-strided", "ConvTranspose", [x, w], {"strides": [2, 2]}),
        Case("ConvTranspose-pads", "ConvTranspose", [x, w], {"strides": [2, 2], "pads": [1, 0, 2, 1]}),
        Case(
            "ConvTranspose-output-padding",
            "ConvTranspose",
            [x, w],
            {"strides": [2, 3], "output_padding": [1, 2]},
        ),
        Case(
            "ConvTranspose-output-shape",
            "ConvTranspose",
            [x, w],
            {"strides": [2, 2], "output_shape": [12, 14]},
        ),
        Case(
            "ConvTranspose-same-upper", "ConvTranspose", [x, w], {"strides": [2, 2], "auto_pad": "SAME_UPPER"}
        ),
        Case("ConvTranspose-dilated", "ConvTranspose", [x, w], {"dilations": [2, 1]}),
        Case("ConvTranspose-group", "ConvTranspose", [x, normal(4, 2, 3, 3)], {"group": 2}),
        Case("ConvTranspose-1d", "ConvTranspose", [normal(1, 3, 7), normal(3, 2, 4)], {"strides": [3]}),
        Case("LpPool", "LpPool", [x], {"kernel_shape": [2, 2]}),
        Case(
            "LpPool-p1-pads",
            "LpPool",
            [x],
            {"kernel_shape": [3, 3], "p": 1, "pads": [1, 1, 1, 1], "strides": [2, 2]},
        ),
        Case("GlobalLpPool", "GlobalLpPool", [x]),
        Case("GlobalLpPool-p3", "GlobalLpPool", [x], {"p": 3}),
        Case("MaxPool-indices", "MaxPool", [x], {"kernel_shape": [2, 2], "strides": [2, 2]}, num_outputs=2),
        Case(
            "MaxPool-indices-pads-col-major",
            "MaxPool",
            [x],
            {"kernel_shape": [3, 3], "pads": [1, 0, 1, 1], "storage_order": 1},
            num_outputs=2,
        ),
    ]


def _image_cases() -> list[Case]:
    x = normal(1, 2, 4, 5)
    f32 = np.float32
    empty = np.array([], dtype=f32)
    up = np.array([1, 1, 2.0, 1.5], dtype=f32)
    down = np.array([1, 1, 0.6, 0.5], dtype=f32)
    cases = []
    for mode in ["nearest", "linear", "cubic"]:
        for ctm in ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"]:
            cases.append(
                Case(
                    f"Resize-{mode}-{ctm}",
                    "Resize",
                    [x, empty, up],
                    {"mode": mode, "coordinate_transformation_mode": ctm},
                )
            )
        cases.append(Case(f"Resize-{mode}-down", "Resize", [x, empty, down], {"mode": mode}))
    for nearest in ["round_prefer_ceil", "floor", "ceil"]:
        cases.append(Case(f"Resize-nearest-{nearest}", "Resize", [x, empty, up], {"nearest_mode": nearest}))
    cases += [
        Case("Resize-sizes", "Resize", [x, empty, None, i64(1, 2, 7, 3)], {"mode": "linear"}),
        Case("Resize-linear-antialias", "Resize", [x, empty, down], {"mode": "linear", "antialias": 1}),
        Case("Resize-cubic-antialias", "Resize", [x, empty, down], {"mode": "cubic", "antialias": 1}),
        Case(
            "Resize-cubic-exclude",
            "Resize",
            [x, empty, up],
            {"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5},
        ),
        Case(
            "Resize-crop-and-resize",
            "Resize",
            [x, np.array([0, 0, 0.2, 0.1, 1, 1, 0.9, 1.2], dtype=f32), None, i64(1, 2, 3, 4)],
            {
                "mode": "linear",
                "coordinate_transformation_mode": "tf_crop_and_resize",
                "extrapolation_value": 9.0,
            },
        ),
        Case(
            "Resize-axes",
            "Resize",
            [x, empty, np.array([3.0, 0.5], dtype=f32)],
            {"axes": [2, 3], "mode": "linear"},
        ),
        Case(
            "Resize-not-larger",
            "Resize",
            [x, empty, None, i64(7, 7)],
            {"axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"},
        ),
        Case(
            "Resize-uint8",
            "Resize",
            [ints(1, 1, 4, 4, lo=0, hi=255, dtype=np.uint8), empty, up],
            {"mode": "linear"},
        ),
        Case("DepthToSpace", "DepthToSpace", [normal(2, 8, 3, 2)], {"blocksize": 2}),
        Case("DepthToSpace-CRD", "DepthToSpace", [normal(2, 8, 3, 2)], {"blocksize": 2, "mode": "CRD"}),
        Case("SpaceToDepth", "SpaceToDepth", [normal(2, 3, 4, 6)], {"blocksize": 2}),
        Case("CenterCropPad", "CenterCropPad", [normal(5, 4, 3), i64(3, 7)], {"axes": [0, 1]}),
        Case("CenterCropPad-all", "CenterCropPad", [normal(5, 4), i64(2, 7)]),
        Case("GridSample-16-bilinear", "GridSample", [x, normal(1, 3, 4, 2)], {"mode": "bilinear"}, opset=16),
        Case(
            "GridSample-nearest-border",
            "GridSample",
            [x, normal(1, 3, 4, 2, scale=1.5)],
            {"mode": "nearest", "padding_mode": "border"},
            opset=20,
        ),
        Case(
            "GridSample-cubic-reflection-aligned",
            "GridSample",
            [x, normal(1, 3, 4, 2, scale=1.5)],
            {"mode": "cubic", "padding_mode": "reflection", "align_corners": 1},
            opset=20,
        ),
        Case("GridSample-3d", "GridSample", [normal(1, 2, 3, 4, 5), normal(1, 2, 3, 4, 3)], opset=20),
        Case("AffineGrid", "AffineGrid", [normal(2, 2, 3), i64(2, 3, 4, 5)], opset=20),
        Case(
            "AffineGrid-3d-aligned",
            "AffineGrid",
            [normal(1, 3, 4), i64(1, 2, 3, 4, 2)],
            {"align_corners": 1},
            opset=20,
        ),
    ]
    return cases


def _index_cases() -> list[Case]:
    data = normal(4, 3, 5)
    cases = [
        Case("ScatterND", "ScatterND", [data, i64(2, 0).reshape(2, 1), normal(2, 3, 5)]),
        Case("ScatterND-elements", "ScatterND", [data, i64(0, 1, 2, 3, 2, 4).reshape(2, 3), normal(2)]),
        Case(
            "ScatterND-add",
            "ScatterND",
            [data, i64(1, 1).reshape(2, 1), normal(2, 3, 5)],
            {"reduction": "add"},
            opset=16,
        ),
        Case(
            "ScatterND-max",
            "ScatterND",
            [data, i64(3, 0).reshape(2, 1), normal(2, 3, 5)],
            {"reduction": "max"},
        ),
        Case(
            "ScatterElements",
            "ScatterElements",
            [data, ints(4, 3, 2, lo=0, hi=5), normal(4, 3, 2)],
            {"axis": 2},
        ),
        Case(
            "ScatterElements-negative",
            "ScatterElements",
            [data, ints(1, 3, 5, lo=-4, hi=0), normal(1, 3, 5)],
            {"axis": 0},
        ),
        Case(
            "ScatterElements-mul",
            "ScatterElements",
            [data, i64(0, 0, 1).reshape(1, 3, 1), normal(1, 3, 1)],
            {"axis": 0, "reduction": "mul"},
        ),
        Case("GatherND", "GatherND", [data, i64(1, 2, 3, 0).reshape(2, 2)]),
        Case("GatherND-full", "GatherND", [data, i64(1, 2, 3, 0, 0, -1).reshape(2, 3)]),
        Case(
            "GatherND-batch",
            "GatherND",
            [data, i64(1, 2, 0, 2, 2, 2, 1, 1).reshape(4, 2, 1)],
            {"batch_dims": 1},
        ),
        Case("TopK", "TopK", [normal(3, 6), i64(3)], num_outputs=2),
        Case("TopK-smallest-axis0", "TopK", [normal(4, 5), i64(2)], {"axis": 0, "largest": 0}, num_outputs=2),
        Case(
            "TopK-ties",
            "TopK",
            [np.array([[1, 3, 3, 2, 3, 1]], dtype=np.float32), i64(4)],
            num_outputs=2,
        ),
        Case("NonZero", "NonZero", [ints(3, 4, lo=0, hi=2)]),
        Case("OneHot", "OneHot", [i64(0, 2, -1, 5), i64(4), np.array([0.0, 1.0], dtype=np.float32)]),
        Case(
            "OneHot-axis0-float-indices",
            "OneHot",
            [np.array([[1.0, 2.0], [0.0, -1.0]], dtype=np.float32), i64(3), i64(-1, 7)],
            {"axis": 0},
        ),
        Case("CumSum", "CumSum", [normal(3, 4), i64(1)]),
        Case("CumSum-exclusive-reverse", "CumSum", [ints(3, 4), i64(0)], {"exclusive": 1, "reverse": 1}),
        Case("CumSum-int32", "CumSum", [ints(5, dtype=np.int32), np.array(0, dtype=np.int32)]),
        Case("CumProd", "CumProd", [normal(3, 4), np.array(1)], opset=26),
        Case(
            "CumProd-exclusive-reverse",
            "CumProd",
            [ints(3, 4), np.array(0)],
            {"exclusive": 1, "reverse": 1},
            opset=26,
        ),
        Case("EyeLike", "EyeLike", [normal(3, 5)]),
        Case("EyeLike-k-dtype", "EyeLike", [normal(4, 3)], {"k": -1, "dtype": TensorProto.INT32}),
        Case(
            "ReverseSequence",
            "ReverseSequence",
            [normal(4, 3, 2), i64(4, 1, 2)],
            {"batch_axis": 1, "time_axis": 0},
        ),
        Case(
            "ReverseSequence-batch-first",
            "ReverseSequence",
            [normal(3, 4, 2), i64(2, 4, 0)],
            {"batch_axis": 0, "time_axis": 1},
        ),
        Case("Compress", "Compress", [normal(3, 4), bools(4)], {"axis": 1}),
        Case("Compress-flat-short", "Compress", [normal(3, 4), np.array([True, False, True])]),
        Case("TensorScatter", "TensorScatter", [normal(2, 3, 6, 4), normal(2, 3, 2, 4), i64(1, 3)], opset=24),
        Case(
            "TensorScatter-circular",
            "TensorScatter",
            [normal(2, 6, 4), normal(2, 3, 4), i64(5, 2)],
            {"axis": 1, "mode": "circular"},
            opset=24,
        ),
        Case("Det", "Det", [normal(3, 3)]),
        Case("Det-batched", "Det", [normal(2, 4, 4)]),
    ]
    return cases


def _transformer_cases() -> list[Case]:
    cos = np.cos(np.arange(16 * 4).reshape(16, 4) * 0.1).astype(np.float32)
    sin = np.sin(np.arange(16 * 4).reshape(16, 4) * 0.1).astype(np.float32)
    pos = i64(3, 4, 5, 0, 1, 2).reshape(2, 3)
    return [
        Case("RotaryEmbedding-4d", "RotaryEmbedding", [normal(2, 2, 3, 8), cos, sin, pos], opset=23),
        Case(
            "RotaryEmbedding-3d-interleaved",
            "RotaryEmbedding",
            [normal(2, 3, 16), cos, sin, pos],
            {"num_heads": 2, "interleaved": 1},
            opset=23,
        ),
        Case(
            "RotaryEmbedding-partial",
            "RotaryEmbedding",
            [normal(2, 2, 3, 12), cos, sin, pos],
            {"rotary_embedding_dim": 8},
            opset=23,
        ),
    ]


def _attention_cases() -> list[Case]:
    q, k, v = normal(2, 4, 3, 8), normal(2, 2, 5, 8), normal(2, 2, 5, 8)
    causal_mask = np.tril(np.ones((3, 5), dtype=bool), 2)
    return [
        Case("Attention-gqa", "Attention", [q, k, v], opset=23),
        Case("Attention-causal-scale", "Attention", [q, k, v], {"is_causal": 1, "scale": 0.2}, opset=23),
        Case("Attention-bool-mask", "Attention", [q, k, v, causal_mask], opset=23),
        Case(
            "Attention-float-mask-softcap", "Attention", [q, k, v, normal(3, 5)], {"softcap": 2.0}, opset=23
        ),
        Case(
            "Attention-3d-past",
            "Attention",
            [
                normal(2, 3, 16),
                normal(2, 3, 4),
                normal(2, 3, 4),
                None,
                normal(2, 1, 4, 4),
                normal(2, 1, 4, 4),
            ],
            {"q_num_heads": 4, "kv_num_heads": 1, "is_causal": 1},
            num_outputs=3,
            opset=23,
        ),
    ]


def _semantics_cases() -> list[Case]:
    """Changes to ops that existed before: newer semantics, and edge cases the conformance suite had."""
    return [
        Case("ReduceMax-bool", "ReduceMax", [bools(3, 4), i64(1)], opset=20),
        Case("ReduceMin-empty", "ReduceMin", [np.zeros((2, 0, 3), dtype=np.float32), i64(1)], opset=18),
        Case(
            "Range-float16",
            "Range",
            [np.array(1, np.float16), np.array(9, np.float16), np.array(0.5, np.float16)],
        ),
        Case("Size-scalar-shape", "Size", [normal(2, 3)]),
        Case(
            "Div-int8",
            "Div",
            [ints(3, 4, lo=-100, hi=100, dtype=np.int8), ints(3, 4, lo=1, hi=9, dtype=np.int8)],
        ),
    ]


def _recurrent_cases() -> list[Case]:
    """RNN, GRU and LSTM with what the conformance cases leave out: sequence_lens with both
    directions, clip, input_forget, linear_before_reset, activations with alpha and beta; and
    Col2Im with uneven pads, strides and dilations; DFT zero-padded to dft_length."""
    seq, batch, inp, hid = 4, 3, 3, 5
    x = normal(seq, batch, inp)
    lens = np.array([4, 2, 3], dtype=np.int32)

    def weights(gates: int, dirs: int) -> list[np.ndarray]:
        return [
            normal(dirs, gates * hid, inp, scale=0.5),
            normal(dirs, gates * hid, hid, scale=0.5),
            normal(dirs, 2 * gates * hid, scale=0.2),
        ]

    def state(dirs: int) -> np.ndarray:
        return normal(dirs, batch, hid, scale=0.5)

    both = {"hidden_size": hid, "direction": "bidirectional"}
    return [
        Case(
            "LSTM-bidirectional-lengths-peepholes",
            "LSTM",
            [x, *weights(4, 2), lens, state(2), state(2), normal(2, 3 * hid, scale=0.2)],
            both,
            num_outputs=3,
        ),
        Case(
            "LSTM-clip-input-forget",
            "LSTM",
            [x, *weights(4, 1), None, state(1), state(1)],
            {"hidden_size": hid, "clip": 0.7, "input_forget": 1},
            num_outputs=3,
        ),
        Case(
            "LSTM-hardsigmoid-gates",
            "LSTM",
            [x, *weights(4, 1)],
            {
                "hidden_size": hid,
                "activations": ["HardSigmoid", "Tanh", "Tanh"],
                "activation_alpha": [0.3],
                "activation_beta": [0.4],
            },
            num_outputs=3,
        ),
        Case(
            "GRU-reverse-lengths-linear-before-reset",
            "GRU",
            [x, *weights(3, 1), np.array([1, 4, 2], dtype=np.int32), state(1)],
            {"hidden_size": hid, "direction": "reverse", "linear_before_reset": 1},
            num_outputs=2,
        ),
        Case("GRU-bidirectional-lengths", "GRU", [x, *weights(3, 2), lens, state(2)], both, num_outputs=2),
        Case(
            "RNN-bidirectional-lengths-relu",
            "RNN",
            [x, *weights(1, 2), lens, state(2)],
            {**both, "activations": ["Relu", "Tanh"]},
            num_outputs=2,
        ),
        Case(
            "Col2Im-pads-strides-dilations",
            "Col2Im",
            [normal(2, 2 * 2 * 3, 12), i64(5, 6), i64(2, 3)],
            {"pads": [1, 0, 0, 2], "strides": [2, 1], "dilations": [1, 2]},
        ),
        Case("DFT-17-dft-length", "DFT", [normal(2, 6, 1), i64(8)], {"axis": 1}, opset=17),
    ]


EXTENDED_CASES: list[Case] = [
    *_math_cases(),
    *_activation_cases(),
    *_norm_cases(),
    *_conv_cases(),
    *_image_cases(),
    *_index_cases(),
    *_transformer_cases(),
    *_attention_cases(),
    *_semantics_cases(),
    *_recurrent_cases(),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in EXTENDED_CASES])
def test_op_matches_reference(case: Case) -> None:
    model = _one_node_model(case)
    feeds = {f"in{i}": x for i, x in enumerate(case.inputs) if x is not None}
    if case.id in ONNX_REFERENCE:
        expected = ReferenceEvaluator(model).run(None, feeds)
    else:
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        expected = session.run(None, feeds)
    inputs = [torch.from_numpy(x.copy()) if x is not None else None for x in case.inputs]
    actual = run_op(case.op, inputs, _decode_attrs(model.graph.node[0]), num_outputs=case.num_outputs)
    assert len(actual) == len(expected)
    for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
        _assert_same(np.asarray(want), got, f"{case.id} output {i}")


def test_extended_case_ids_are_unique() -> None:
    ids = [c.id for c in EXTENDED_CASES]
    assert len(ids) == len(set(ids))


def test_integer_division_by_zero_gives_zero_instead_of_raising() -> None:
    # Undefined in ONNX (onnxruntime's C++ traps); random inputs at compile time must not crash opfuse.
    a, b = torch.tensor([7, -7, 3], dtype=torch.int32), torch.tensor([2, 0, 0], dtype=torch.int32)
    assert run_op("Div", [a, b], {})[0].tolist() == [3, 0, 0]
    assert run_op("Mod", [a, b], {})[0].tolist() == [1, 0, 0]
    assert run_op("Mod", [a, b], {"fmod": 1})[0].tolist() == [1, 0, 0]


def test_bad_attributes_are_model_errors() -> None:
    with pytest.raises(ModelError, match="BitShift"):
        run_op("BitShift", [torch.ones(2, dtype=torch.uint8)] * 2, {"direction": "UP"})
    with pytest.raises(ModelError, match="groups"):
        run_op("GroupNormalization", [torch.ones(1, 6, 2), torch.ones(6), torch.ones(6)], {"num_groups": 4})
    with pytest.raises(ModelError, match="mode"):
        run_op("Resize", [torch.ones(1, 1, 2, 2), None, torch.ones(4)], {"mode": "area"})


def _recurrent_node(
    op: str, gates: int, direction: str, layout: int = 0
) -> tuple[list[torch.Tensor | None], dict[str, object]]:
    """A random LSTM, GRU (linear_before_reset=1) or RNN ("RNN-relu": Relu) node's inputs, on the
    test device, and attributes: seq 5, batch 3, input 4, hidden 6, initial states given."""
    op, relu = op.removesuffix("-relu"), op.endswith("-relu")
    dirs = 2 if direction == "bidirectional" else 1
    seq, batch, inp, hid = 5, 3, 4, 6
    x, h0, c0 = (
        normal(seq, batch, inp),
        normal(dirs, batch, hid, scale=0.5),
        normal(dirs, batch, hid, scale=0.5),
    )
    if layout:
        x, h0, c0 = x.transpose(1, 0, 2), h0.transpose(1, 0, 2), c0.transpose(1, 0, 2)
    tensors = [
        x,
        normal(dirs, gates * hid, inp, scale=0.5),
        normal(dirs, gates * hid, hid, scale=0.5),
        normal(dirs, 2 * gates * hid, scale=0.2),
        None,
        h0,
    ]
    if op == "LSTM":
        tensors.append(c0)
    attrs: dict[str, object] = {"hidden_size": hid, "direction": direction, "layout": layout}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    if relu:
        attrs["activations"] = ["Relu"] * dirs
    inputs = [
        torch.from_numpy(np.ascontiguousarray(t)).to(TEST_DEVICE) if t is not None else None for t in tensors
    ]
    return inputs, attrs


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("op, gates", [("LSTM", 4), ("GRU", 3), ("RNN", 1), ("RNN-relu", 1)])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_recurrent_layers_in_torchs_form_match_the_step_by_step_ones(
    op: str, gates: int, direction: str, layout: int
) -> None:
    """An LSTM, a GRU with linear_before_reset=1, or a Tanh or Relu RNN runs as torch's own layer
    (one cuDNN call on the GPU, both directions in it); the same node with a clip no value reaches
    runs step by step: every output agrees, in either layout."""
    inputs, attrs = _recurrent_node(op, gates, direction, layout)
    op = op.removesuffix("-relu")
    assert ops_recurrent._library_form(op, inputs, attrs)
    assert not ops_recurrent._library_form(op, inputs, {**attrs, "clip": 1e30})
    outs = len(inputs) - 4
    library = run_op(op, inputs, attrs, num_outputs=outs)
    steps = run_op(op, inputs, {**attrs, "clip": 1e30}, num_outputs=outs)
    tol = 1e-5 if TEST_DEVICE == "cpu" else 3e-3  # cuDNN's recurrences may use TF32
    for a, b in zip(library, steps, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_the_library_forms_weights_are_put_in_torchs_order_once_and_again_after_a_write() -> None:
    """A plan's weights are the same tensors every run: the reordered (on the GPU, cuDNN-packed)
    weights are made at the first run and reused; a write to W, R or B makes them again."""
    inputs, attrs = _recurrent_node("LSTM", 4, "bidirectional")
    w, r = inputs[1], inputs[2]
    assert w is not None and r is not None
    first = run_op("LSTM", inputs, attrs, num_outputs=3)
    prepared = ops_recurrent._PREPARED[w][3]
    second = run_op("LSTM", inputs, attrs, num_outputs=3)
    assert ops_recurrent._PREPARED[w][3] is prepared
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    r.mul_(0.5)
    fresh = [t.clone() if t is not None else None for t in inputs]
    after = run_op("LSTM", inputs, attrs, num_outputs=3)
    assert ops_recurrent._PREPARED[w][3] is not prepared
    for a, b in zip(after, run_op("LSTM", fresh, attrs, num_outputs=3), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(after[0], first[0])


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need the GPU (OPFUSE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("warm", [True, False])
def test_a_library_form_node_captured_in_a_cuda_graph_replays_the_eager_result(warm: bool) -> None:
    """Captured after a run (its weights packed, kept) or as its first run (made in the graph and
    not kept: their contents exist only in replays): a replay on new inputs is the eager result."""
    inputs, attrs = _recurrent_node("LSTM", 4, "bidirectional")
    x = inputs[0]
    assert x is not None
    if warm:
        run_op("LSTM", inputs, attrs, num_outputs=3)
    else:
        run_op(
            "LSTM", [inputs[0], inputs[1].clone(), *inputs[2:]], attrs, num_outputs=3
        )  # cuDNN's own set-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_op("LSTM", inputs, attrs, num_outputs=3)
    assert (inputs[1] in ops_recurrent._PREPARED) == warm
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, run_op("LSTM", inputs, {**attrs, "clip": 1e30}, num_outputs=3), strict=True):
        torch.testing.assert_close(a, b, rtol=3e-3, atol=3e-3)


def test_sequence_lengths_outside_the_sequence_are_clamped_into_it() -> None:
    """sequence_lens is a run-time input: a length past the sequence reads as all of it and a
    negative one as none (Y zeros, the initial state), never an index outside the input."""
    seq, batch, inp, hid = 4, 3, 2, 3
    x = torch.from_numpy(normal(seq, batch, inp))
    w, r = torch.from_numpy(normal(1, hid, inp)), torch.from_numpy(normal(1, hid, hid))
    h0 = torch.from_numpy(normal(1, batch, hid))
    attrs = {"hidden_size": hid, "direction": "reverse"}
    bad = torch.tensor([9, -2, 4], dtype=torch.int32)
    good = torch.tensor([4, 0, 4], dtype=torch.int32)
    y, h = run_op("RNN", [x, w, r, None, bad, h0], attrs, num_outputs=2)
    want_y, want_h = run_op("RNN", [x, w, r, None, good, h0], attrs, num_outputs=2)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(h, want_h)
    assert torch.count_nonzero(y[:, :, 1]) == 0 and torch.equal(h[0, 1], h0[0, 1])
