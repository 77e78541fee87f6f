"""Per-op torch kernels of the ONNX indexing ops: scatters, GatherND, TopK, NonZero, OneHot, running
sums and products, EyeLike, ReverseSequence and Compress.

Indices may be negative (counting from the end) wherever ONNX allows it: [-n, n-1] on an axis of
size n. Anything outside is an error, as in onnxruntime: on the CPU `checked_index` raises
`InputError`; on a GPU, where the check would cost a host sync on every run (and break CUDA graph
capture), an out-of-range index is clamped to the nearest valid one, so that no kernel ever reads
or writes outside a tensor (the result is then unspecified: check such inputs on the CPU).
Constant indices are checked once, at compile time (`passes/indices.py`).
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from opfuse.errors import InputError, ModelError
from opfuse.runtime.ops_registry import (
    int_list,
    normalize_axis,
    onnx_torch_dtype,
    optional,
    register,
    required,
)

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]

# ONNX scatter reductions -> torch's index_reduce/scatter_reduce names (each includes the old value).
_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _reduction(attrs: Attrs, op_type: str) -> str:
    reduction = attrs.get("reduction", "none")
    if reduction != "none" and reduction not in _REDUCE:
        raise ModelError(f"{op_type}: reduction {reduction!r} is not none, add, mul, max or min")
    return str(reduction)


# Whether indices are checked on the host (None: on the CPU, not on a GPU). runtime/capture.py's
# audit runs the CPU as a GPU would, so it turns the check off.
HOST_INDEX_CHECKS: ContextVar[bool | None] = ContextVar("opfuse_host_index_checks", default=None)


def host_index_checks(device: torch.device) -> bool:
    """Whether indices are checked on the host here (the CPU) rather than clamped (a GPU)."""
    host_check = HOST_INDEX_CHECKS.get()
    return host_check if host_check is not None else device.type == "cpu"


def checked_index(indices: torch.Tensor, size: int, op_type: str, axis: int) -> torch.Tensor:
    """`indices` (any integer type) as int64 in [0, size): ONNX's negative indices count from the
    end. Outside [-size, size-1]: `InputError` on the CPU; clamped into range on a GPU (no sync)."""
    idx = indices.to(torch.int64)
    if size == 0 and idx.numel():  # shapes are static: no sync to know this
        raise InputError(f"{op_type}: indices into axis {axis} of size 0, which has no element to take")
    if host_index_checks(idx.device):
        bad = (idx < -size) | (idx >= size)
        if bool(bad.any()):
            value = int(idx[bad].reshape(-1)[0])
            raise InputError(
                f"{op_type}: index {value} is out of range for axis {axis} of size {size} "
                f"(valid: {-size} to {size - 1}; negative indices count from the end)"
            )
        return torch.where(idx < 0, idx + size, idx)
    return torch.where(idx < 0, idx + size, idx).clamp(0, size - 1)


def _linear_index(indices: torch.Tensor, sizes: list[int], op_type: str, first_axis: int = 0) -> torch.Tensor:
    """Row-major linear index of (..., k) coordinates into a block of the given k sizes (the
    data's axes `first_axis`.. `first_axis + k - 1`), each coordinate checked."""
    lin = torch.zeros(indices.shape[:-1], dtype=torch.int64, device=indices.device)
    for i, size in enumerate(sizes):
        lin = lin * size + checked_index(indices[..., i], size, op_type, first_axis + i)
    return lin


@register("ScatterND")
def scatter_nd(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    data, indices, updates = (required(inputs, i, "ScatterND") for i in range(3))
    reduction = _reduction(attrs, "ScatterND")
    k = indices.shape[-1]
    sizes = list(data.shape[:k])
    lin = _linear_index(indices, sizes, "ScatterND").reshape(-1)
    out = data.clone().reshape(math.prod(sizes), *data.shape[k:])
    upd = updates.reshape(-1, *data.shape[k:]).to(data.dtype)
    if reduction == "none":
        out.index_copy_(0, lin, upd)
    elif reduction == "add":  # index_reduce_ has no sum
        out.index_add_(0, lin, upd)
    else:
        out.index_reduce_(0, lin, upd, _REDUCE[reduction], include_self=True)
    return [out.reshape(data.shape)]


@register("ScatterElements")
def scatter_elements(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    data, indices, updates = (required(inputs, i, "ScatterElements") for i in range(3))
    axis = normalize_axis(int(attrs.get("axis", 0)), data.dim(), "ScatterElements")
    reduction = _reduction(attrs, "ScatterElements")
    index = checked_index(indices, data.shape[axis], "ScatterElements", axis)
    if reduction == "none":
        return [torch.scatter(data, axis, index, updates)]
    return [torch.scatter_reduce(data, axis, index, updates, _REDUCE[reduction], include_self=True)]


@register("GatherND")
def gather_nd(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    data, indices = required(inputs, 0, "GatherND"), required(inputs, 1, "GatherND")
    b = int(attrs.get("batch_dims", 0))
    k = indices.shape[-1]
    batch = math.prod(data.shape[:b])
    sizes = list(data.shape[b : b + k])
    rest = list(data.shape[b + k :])
    flat_data = data.reshape(batch, math.prod(sizes), *rest)
    lin = _linear_index(indices, sizes, "GatherND", b).reshape(batch, -1)
    rows = torch.arange(batch, device=data.device).unsqueeze(1)
    gathered = flat_data[rows, lin]  # (batch, M, *rest)
    return [gathered.reshape(*indices.shape[:-1], *rest)]


@register("TopK", host_inputs=(1,))
def top_k(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, k_t = required(inputs, 0, "TopK"), required(inputs, 1, "TopK")
    k = int_list(k_t)[0]
    axis = normalize_axis(int(attrs.get("axis", -1)), x.dim(), "TopK")
    largest = attrs.get("largest", 1) == 1
    # A stable sort: of equal elements the one with the lower index comes first, as ONNX requires
    # (torch.topk does not promise it).
    values, order = torch.sort(x, dim=axis, descending=largest, stable=True)
    return [values.narrow(axis, 0, k), order.narrow(axis, 0, k)]


@register("NonZero", data_dependent_shape=True)
def non_zero(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    # Only ever run on a compile-time constant (the frontend refuses others): folded away.
    x = required(inputs, 0, "NonZero")
    if x.dim() == 0:
        return [torch.zeros((0, int(bool(x.item()))), dtype=torch.int64, device=x.device)]
    return [torch.nonzero(x).t().contiguous()]


@register("OneHot", host_inputs=(1,))
def one_hot(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    indices, depth_t, values = (required(inputs, i, "OneHot") for i in range(3))
    depth = int(depth_t.reshape(-1)[0].item())
    axis = normalize_axis(int(attrs.get("axis", -1)), indices.dim() + 1, "OneHot")
    idx = indices.to(torch.int64)  # float indices are truncated, as onnxruntime casts them
    idx = torch.where(idx < 0, idx + depth, idx)
    classes = torch.arange(depth, device=idx.device).reshape(-1, *([1] * (indices.dim() - axis)))
    hot = idx.unsqueeze(axis) == classes  # out-of-range indices match no class: all "off"
    off, on = values.reshape(-1)[0], values.reshape(-1)[1]
    return [torch.where(hot, on, off)]


def _running(op_type: str, inputs: Inputs, attrs: Attrs) -> torch.Tensor:
    x, axis_t = required(inputs, 0, op_type), required(inputs, 1, op_type)
    axis = normalize_axis(int_list(axis_t)[0], x.dim(), op_type)
    reverse, exclusive = attrs.get("reverse", 0) == 1, attrs.get("exclusive", 0) == 1
    y = torch.flip(x, [axis]) if reverse else x
    if exclusive:
        # Shift by one along the axis, starting from the identity (0 for sums, 1 for products).
        identity = torch.zeros_like if op_type == "CumSum" else torch.ones_like
        first = identity(y.narrow(axis, 0, 1))
        y = torch.cat([first, y.narrow(axis, 0, y.shape[axis] - 1)], dim=axis)
    y = torch.cumsum(y, dim=axis) if op_type == "CumSum" else torch.cumprod(y, dim=axis)
    y = y.to(x.dtype)  # torch accumulates small integers in int64
    return torch.flip(y, [axis]) if reverse else y


@register("CumSum", host_inputs=(1,))
def cum_sum(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [_running("CumSum", inputs, attrs)]


@register("CumProd", host_inputs=(1,))
def cum_prod(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [_running("CumProd", inputs, attrs)]


@register("EyeLike")
def eye_like(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "EyeLike")
    if x.dim() != 2:
        raise ModelError(f"EyeLike: the input must be 2-D, got rank {x.dim()}")
    dtype = onnx_torch_dtype(int(attrs["dtype"])) if "dtype" in attrs else x.dtype
    k = int(attrs.get("k", 0))
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    cols = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    return [(cols - rows == k).to(dtype)]


@register("ReverseSequence")
def reverse_sequence(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, lens = required(inputs, 0, "ReverseSequence"), required(inputs, 1, "ReverseSequence")
    batch_axis = normalize_axis(int(attrs.get("batch_axis", 1)), x.dim(), "ReverseSequence")
    time_axis = normalize_axis(int(attrs.get("time_axis", 0)), x.dim(), "ReverseSequence")
    steps = x.shape[time_axis]
    t = torch.arange(steps, device=x.device).unsqueeze(1)  # (time, 1)
    # Lengths past the time axis are invalid; clamped so that they cannot index out of range.
    n = lens.to(torch.int64).to(x.device).clamp(0, steps).unsqueeze(0)  # (1, batch)
    # Within each sequence's length, time t reads n - 1 - t; past it, t stays.
    src = torch.where(t < n, n - 1 - t, t)  # (time, batch)
    if time_axis > batch_axis:
        src = src.t()
    shape = [1] * x.dim()
    shape[time_axis], shape[batch_axis] = steps, x.shape[batch_axis]
    return [torch.gather(x, time_axis, src.reshape(shape).expand(x.shape))]


@register("Compress", data_dependent_shape=True)
def compress(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    # Only ever run with a compile-time condition (the frontend refuses others).
    x, condition = required(inputs, 0, "Compress"), required(inputs, 1, "Compress")
    if "axis" not in attrs:
        x, axis = x.reshape(-1), 0
    else:
        axis = normalize_axis(int(attrs["axis"]), x.dim(), "Compress")
    keep = torch.nonzero(condition.reshape(-1).to(torch.bool)).reshape(-1)
    # A condition shorter than the axis selects nothing past its end.
    return [torch.index_select(x, axis, keep[keep < x.shape[axis]])]


@register("TensorScatter")
def tensor_scatter(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    """A KV-cache write: `update` goes into `past` along the sequence axis, at each batch row's
    write index (0 when absent), wrapping around in "circular" mode."""
    past, update = required(inputs, 0, "TensorScatter"), required(inputs, 1, "TensorScatter")
    write = optional(inputs, 2)
    axis = normalize_axis(int(attrs.get("axis", -2)), past.dim(), "TensorScatter")
    if axis == 0:
        raise ModelError("TensorScatter: the sequence axis cannot be the batch axis")
    mode = attrs.get("mode", "linear")
    if mode not in ("linear", "circular"):
        raise ModelError(f"TensorScatter: mode {mode!r} is not linear or circular")
    batch, steps, capacity = past.shape[0], update.shape[axis], past.shape[axis]
    start = (
        write.to(torch.int64)
        if write is not None
        else torch.zeros(batch, dtype=torch.int64, device=past.device)
    )
    index = start.reshape(batch, 1) + torch.arange(steps, device=past.device).reshape(1, steps)
    if mode == "circular":
        index = torch.remainder(index, capacity)
    # A linear write past the end is undefined in ONNX; it lands in `steps` spare cells that are cut
    # off again, rather than raising (random inputs at compile time may ask for one).
    index = index.clamp(0, capacity + steps - 1)
    shape = [1] * past.dim()
    shape[0], shape[axis] = batch, steps
    spare = [0, 0] * (past.dim() - 1 - axis) + [0, steps]
    padded = F.pad(past, spare)
    written = padded.scatter(axis, index.reshape(shape).expand(update.shape), update)
    return [written.narrow(axis, 0, capacity)]


@register("Det")
def det(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Det")
    return [torch.linalg.det(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)]
