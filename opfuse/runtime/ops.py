"""Per-op torch kernels for ONNX nodes that are not fused: the unfused "before" runtime.

`run_op(op_type, inputs, attrs, num_outputs)` runs one default-domain node with opset-18 semantics,
extended to the newer versions opfuse/frontend/opsets.py lists as reviewed (new attributes and types
whose defaults keep the old meaning; GroupNormalization's per-channel scale is told apart by shape).
Inputs stay on their device and outputs follow them; attributes come decoded to plain Python values
(numpy arrays for TENSOR attributes), with absent ones absent. The kernels live in the `ops_*`
modules beside this one, one family per module, registered in `ops_registry.OP_TABLE`.
"""

from __future__ import annotations

from typing import Any

import torch

from opfuse.errors import ModelError

# Importing the op modules is what fills OP_TABLE.
from opfuse.runtime import (  # noqa: F401
    ops_attention,
    ops_conv,
    ops_elementwise,
    ops_image,
    ops_index,
    ops_math,
    ops_nn,
    ops_norm,
    ops_recurrent,
    ops_reduce,
    ops_shape,
)
from opfuse.runtime.ops_registry import (
    DEVICE_KEY,
    NUM_OUTPUTS_KEY,
    ONNX_TORCH_DTYPES,
    OP_TABLE,
    OpImpl,
    onnx_torch_dtype,
)

__all__ = ["ONNX_TORCH_DTYPES", "SUPPORTED_OPS", "VIEW_OPS", "OpImpl", "onnx_torch_dtype", "run_op"]

# Ops named "opfuse.*" exist only inside compiled plans (the channels-last region); a model
# cannot use them.
INTERNAL_PREFIX = "opfuse."
SUPPORTED_OPS: frozenset[str] = frozenset(op for op in OP_TABLE if not op.startswith(INTERNAL_PREFIX))

# Ops whose torch kernel launches nothing on the device: a view, an alias, or host-side shape
# arithmetic. The "before" kernel count skips them. It is a per-type answer, so it is the usual
# case: Reshape/Flatten of a non-contiguous tensor, and Slice with a negative step, do copy.
VIEW_OPS: frozenset[str] = frozenset(
    {
        "Constant",
        "Dropout",
        "Expand",
        "Flatten",
        "Identity",
        "Reshape",
        "Shape",
        "Size",
        "Slice",
        "Split",
        "Squeeze",
        "Transpose",
        "Unsqueeze",
    }
)


def run_op(
    op_type: str,
    inputs: list[torch.Tensor | None],
    attrs: dict[str, Any],
    num_outputs: int = 1,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Run one ONNX node (default domain) with torch; returns its `num_outputs` outputs. `device`:
    where an op whose outputs follow no input (Range, ConstantOfShape) puts them."""
    entry = OP_TABLE.get(op_type)
    if entry is None:
        raise ModelError(
            f"ONNX op {op_type!r} is not supported by opfuse's runtime. Re-export the model without "
            f"it, or ask for it to be added. Supported ops: {', '.join(sorted(SUPPORTED_OPS))}"
        )
    if entry.wants_num_outputs:
        attrs = {**attrs, NUM_OUTPUTS_KEY: num_outputs}
    if entry.wants_device and device is not None:
        attrs = {**attrs, DEVICE_KEY: device}
    outs = entry.impl(inputs, attrs)
    if len(outs) < num_outputs:
        raise ModelError(
            f"{op_type}: the node has {num_outputs} outputs but opfuse computes only {len(outs)}; "
            "remove the unused outputs from the node"
        )
    return outs if len(outs) == num_outputs else outs[:num_outputs]
