"""Precision modes: float32 weights and activations become the compute dtype at compile time."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from opfuse.graph import Graph, TensorSpec

COMPUTE_DTYPES = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}
PRECISIONS = tuple(COMPUTE_DTYPES)

# (op_type, input index) pairs that must stay float32 whatever the precision.
_KEEP_FLOAT32 = {("Resize", 1), ("Resize", 2)}


def round_to_bfloat16(arr: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ml_dtypes: ties to even, as torch and onnx
    round), kept as float32: numpy has no bfloat16. A bf16 constant holds the same value wherever
    it is read: uploaded as a tensor, in a kernel's source as a literal, and in the bundle's
    model.onnx (a BFLOAT16 initializer), so a bundle's kernels render again from it to the byte."""
    return np.asarray(arr, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


FP16_TINY = float(np.finfo(np.float16).smallest_subnormal)  # 2**-24
FP16_MAX = float(np.finfo(np.float16).max)  # 65504


def to_float16(arr: np.ndarray) -> np.ndarray:
    """float32 values as float16, except that a finite value never becomes infinite (±65504), and
    a nonzero scalar (one element: an epsilon, a clamp bound) never becomes zero (±2**-24). An
    epsilon of 1e-12 (F.normalize's clamp, a LayerNorm written out) is zero in float16, and
    x / max(|x|, eps) is 0/0 where a row of x is zero (torchvision's swin_v2_t: the zero padding of
    its shifted windows gives NaN in PyTorch's own float16). A weight or bias below float16's
    range rounds to zero, as `.half()` rounds it: clamped, a folded BatchNorm's bias of 1e-12 would
    be 2**-24, an error of millions of times its value (transformers' MobileViT)."""
    arr = np.asarray(arr, dtype=np.float32)
    out = arr.astype(np.float16)  # a new array: fixed in place
    under = (out == 0) & (arr != 0) & (arr.size == 1)
    over = np.isinf(out) & np.isfinite(arr)
    out[under] = np.copysign(FP16_TINY, arr[under]).astype(np.float16)
    out[over] = np.copysign(FP16_MAX, arr[over]).astype(np.float16)
    return out


def apply_precision(
    graph: Graph, precision: str, cast: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
) -> None:
    """`cast`: weights already cast for another graph that shares this one's arrays (Graph.copy),
    by id of the float32 array; filled as this graph's weights are cast, so each is cast once."""
    target = COMPUTE_DTYPES[precision]
    if target == "float32":
        return
    keep = {
        n.inputs[i] for n in graph.nodes for (op, i) in _KEEP_FLOAT32 if n.op_type == op and len(n.inputs) > i
    }
    for name, arr in list(graph.constants.items()):
        if arr.dtype == np.float32 and name not in keep:
            seen = cast.get(id(arr)) if cast is not None else None
            if seen is not None and seen[0] is arr:
                graph.constants[name] = seen[1]
                continue
            graph.constants[name] = to_float16(arr) if target == "float16" else round_to_bfloat16(arr)
            if cast is not None:  # the float32 array is kept alive with it: ids stay unique
                cast[id(arr)] = (arr, graph.constants[name])
    for name, spec in list(graph.values.items()):
        if spec.dtype == "float32" and name not in keep:
            graph.values[name] = TensorSpec(spec.name, target, spec.shape)
    for n in graph.nodes:
        if n.op_type == "Cast" and int(n.attrs.get("to", 0)) == 1:
            n.attrs["to"] = 10 if target == "float16" else 16
