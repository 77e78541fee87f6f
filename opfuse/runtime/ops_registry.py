"""The table of per-op torch kernels and the helpers they share (dtype map, axes, int inputs).

The op modules (`ops_elementwise`, `ops_nn`, `ops_reduce`, `ops_shape`) fill the table through
`register`; `opfuse.runtime.ops` is the public face (`run_op`, `SUPPORTED_OPS`, `VIEW_OPS`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from opfuse.errors import ModelError

# What every implementation looks like: ONNX inputs (None for a missing optional input) and decoded
# attributes in, ONNX outputs out.
OpImpl = Callable[[list[torch.Tensor | None], dict[str, Any]], list[torch.Tensor]]

# Reserved attribute key through which `run_op` tells an op how many outputs the node has. ONNX
# attribute names never start with an underscore, so it cannot clash with a real attribute.
NUM_OUTPUTS_KEY = "_num_outputs"
# Likewise the device a plan runs on, for ops whose outputs follow no input to a device (Range,
# ConstantOfShape, the window functions: their inputs may be host copies, runtime/capture.py).
DEVICE_KEY = "_device"


@dataclass(frozen=True)
class OpEntry:
    impl: OpImpl
    # Split (no `split` input, no `num_outputs` attr), Dropout (mask) and LayerNormalization (mean,
    # inv std) depend on, or can skip work by, knowing how many outputs the node has.
    wants_num_outputs: bool = False
    # Inputs the kernel reads as Python values (shapes, axes, pads, scales, counts), by position.
    # The executor hands it a host copy of such an input where it is a constant of the plan, so the
    # read costs no device-to-host sync and the plan can be captured as a CUDA graph; where it is
    # computed at run time the plan must touch the host mid-run (runtime/capture.py says so).
    host_inputs: tuple[int, ...] = ()
    # The output's shape depends on input values (NonZero, Compress): always a host sync.
    data_dependent_shape: bool = False
    wants_device: bool = False


OP_TABLE: dict[str, OpEntry] = {}


def register(
    *op_types: str,
    wants_num_outputs: bool = False,
    host_inputs: tuple[int, ...] = (),
    data_dependent_shape: bool = False,
    wants_device: bool = False,
) -> Callable[[OpImpl], OpImpl]:
    """Register `impl` as the kernel of each default-domain ONNX op in `op_types` (see OpEntry)."""

    def wrap(impl: OpImpl) -> OpImpl:
        for op_type in op_types:
            if op_type in OP_TABLE:
                raise RuntimeError(f"two torch implementations registered for ONNX op {op_type}")
            OP_TABLE[op_type] = OpEntry(
                impl, wants_num_outputs, host_inputs, data_dependent_shape, wants_device
            )
        return impl

    return wrap


def host_inputs(op_type: str) -> tuple[int, ...]:
    entry = OP_TABLE.get(op_type)
    return entry.host_inputs if entry is not None else ()


def target_device(attrs: dict[str, Any], *inputs: torch.Tensor | None) -> torch.device:
    """Where an op's new tensor goes: the plan's device where the executor passed it, else the
    first input's."""
    device = attrs.get(DEVICE_KEY)
    if device is not None:
        return torch.device(device)
    for t in inputs:
        if t is not None:
            return t.device
    return torch.device("cpu")


# ONNX TensorProto.DataType enum -> torch dtype, for the types opfuse handles.
ONNX_TORCH_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,  # FLOAT
    2: torch.uint8,  # UINT8
    3: torch.int8,  # INT8
    5: torch.int16,  # INT16
    6: torch.int32,  # INT32
    7: torch.int64,  # INT64
    9: torch.bool,  # BOOL
    10: torch.float16,  # FLOAT16
    11: torch.float64,  # DOUBLE
    16: torch.bfloat16,  # BFLOAT16
}


def onnx_torch_dtype(onnx_dtype: int) -> torch.dtype:
    dtype = ONNX_TORCH_DTYPES.get(onnx_dtype)
    if dtype is None:
        raise ModelError(
            f"ONNX element type {onnx_dtype} is not supported by opfuse's torch runtime "
            f"(supported: float, float16, bfloat16, double, int64, int32, int16, int8, uint8, bool)"
        )
    return dtype


def required(inputs: Sequence[torch.Tensor | None], index: int, op_type: str) -> torch.Tensor:
    """Input `index`, which the op cannot do without."""
    x = inputs[index] if index < len(inputs) else None
    if x is None:
        raise ModelError(f"{op_type}: required input {index} is missing")
    return x


def optional(inputs: Sequence[torch.Tensor | None], index: int) -> torch.Tensor | None:
    return inputs[index] if index < len(inputs) else None


def int_list(t: torch.Tensor) -> list[int]:
    """An int64 index tensor (axes, shape, pads, ...) as Python ints, whatever device it is on."""
    return [int(v) for v in t.reshape(-1).tolist()]


def normalize_axis(axis: int, rank: int, op_type: str) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ModelError(f"{op_type}: axis {axis} is out of range for a tensor of rank {rank}")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes: Sequence[int], rank: int, op_type: str) -> list[int]:
    return [normalize_axis(a, rank, op_type) for a in axes]
