"""Per-op torch kernels of the ONNX ops that move, select or make data: reshapes, slicing, gathers,
concatenation, padding and constants.

Where torch can answer with a view (Reshape of a contiguous tensor, Transpose, Squeeze, Slice with
positive steps, Split, Expand) it does, so these ops launch no kernel, as `VIEW_OPS` claims.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from opfuse.errors import ModelError
from opfuse.runtime.ops_index import checked_index
from opfuse.runtime.ops_registry import (
    NUM_OUTPUTS_KEY,
    int_list,
    normalize_axes,
    normalize_axis,
    optional,
    register,
    required,
    target_device,
)
from opfuse.runtime.tensors import device_table

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]


@register("Identity")
def identity(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [required(inputs, 0, "Identity")]


@register("Dropout", wants_num_outputs=True)
def dropout(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    # Inference: dropout is the identity (the training_mode input is ignored: opfuse runs inference).
    x = required(inputs, 0, "Dropout")
    if attrs.get(NUM_OUTPUTS_KEY, 1) == 1:
        return [x]
    return [x, torch.ones_like(x, dtype=torch.bool)]


@register("Reshape", host_inputs=(1,))
def reshape(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, shape = required(inputs, 0, "Reshape"), int_list(required(inputs, 1, "Reshape"))
    if attrs.get("allowzero", 0) == 0:
        # 0 means "keep this input dim" unless allowzero says it is a real 0.
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return [x.reshape(shape)]


@register("Flatten")
def flatten(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Flatten")
    axis = int(attrs.get("axis", 1))
    if not -x.dim() <= axis <= x.dim():
        raise ModelError(f"Flatten: axis {axis} is out of range for a tensor of rank {x.dim()}")
    axis = axis + x.dim() if axis < 0 else axis
    # Both sizes spelled out: -1 is ambiguous when the tensor is empty.
    return [x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))]


@register("Transpose")
def transpose(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Transpose")
    perm = attrs.get("perm")
    return [x.permute(list(perm) if perm is not None else list(reversed(range(x.dim()))))]


@register("Squeeze", host_inputs=(1,))
def squeeze(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, axes_t = required(inputs, 0, "Squeeze"), optional(inputs, 1)
    if axes_t is None:
        dims = [i for i, size in enumerate(x.shape) if size == 1]
    else:
        dims = normalize_axes(int_list(axes_t), x.dim(), "Squeeze")
        bad = [d for d in dims if x.shape[d] != 1]
        if bad:
            raise ModelError(f"Squeeze: axes {bad} of a tensor of shape {list(x.shape)} are not of size 1")
    kept = [size for i, size in enumerate(x.shape) if i not in dims]
    return [x.reshape(kept)]


@register("Unsqueeze", host_inputs=(1,))
def unsqueeze(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, axes = required(inputs, 0, "Unsqueeze"), int_list(required(inputs, 1, "Unsqueeze"))
    # Axes count in the output's rank.
    dims = sorted(normalize_axes(axes, x.dim() + len(axes), "Unsqueeze"))
    shape = list(x.shape)
    for d in dims:
        shape.insert(d, 1)
    return [x.reshape(shape)]


@register("Shape")
def shape(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Shape")
    rank = x.dim()
    start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
    # Negative bounds count from the end; out-of-range bounds are clamped, not errors.
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return [device_table(np.array(x.shape[start:end], dtype=np.int64), x.device)]


@register("Size")
def size(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Size")
    return [device_table(np.array(x.numel(), dtype=np.int64), x.device)]


@register("Gather")
def gather(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    data, indices = required(inputs, 0, "Gather"), required(inputs, 1, "Gather")
    axis = normalize_axis(int(attrs.get("axis", 0)), data.dim(), "Gather")
    out_shape = [*data.shape[:axis], *indices.shape, *data.shape[axis + 1 :]]
    # Negative indices (-1 = last) count from the end; out of range: an error on the CPU, clamped on
    # a GPU (ops_index.checked_index). (Constant consecutive indices never get here:
    # passes/gather_slice.py makes them a Slice.)
    flat = checked_index(indices.reshape(-1), data.shape[axis], "Gather", axis)
    return [torch.index_select(data, axis, flat).reshape(out_shape)]


@register("GatherElements")
def gather_elements(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    data, indices = required(inputs, 0, "GatherElements"), required(inputs, 1, "GatherElements")
    axis = normalize_axis(int(attrs.get("axis", 0)), data.dim(), "GatherElements")
    return [torch.gather(data, axis, checked_index(indices, data.shape[axis], "GatherElements", axis))]


@register("Concat")
def concat(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    xs = [x for x in inputs if x is not None]
    if not xs:
        raise ModelError("Concat needs at least one input")
    if "axis" not in attrs:
        raise ModelError("Concat: the 'axis' attribute is missing")
    return [torch.cat(xs, dim=normalize_axis(int(attrs["axis"]), xs[0].dim(), "Concat"))]


@register("Split", wants_num_outputs=True, host_inputs=(1,))
def split(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, split_t = required(inputs, 0, "Split"), optional(inputs, 1)
    axis = normalize_axis(int(attrs.get("axis", 0)), x.dim(), "Split")
    if split_t is not None and split_t.numel() > 0:
        sizes = int_list(split_t)
        if sum(sizes) != x.shape[axis]:
            raise ModelError(
                f"Split: split sizes {sizes} do not add up to dim {axis} of size {x.shape[axis]}"
            )
        return list(torch.split(x, sizes, dim=axis))
    # Opset 18: equal parts, the last one smaller when the dim does not divide evenly.
    parts = int(attrs["num_outputs"] if "num_outputs" in attrs else attrs.get(NUM_OUTPUTS_KEY, 1))
    return list(torch.split(x, -(-x.shape[axis] // parts), dim=axis))


@register("Slice", host_inputs=(1, 2, 3, 4))
def slice_(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Slice")
    starts, ends = int_list(required(inputs, 1, "Slice")), int_list(required(inputs, 2, "Slice"))
    axes_t, steps_t = optional(inputs, 3), optional(inputs, 4)
    axes = int_list(axes_t) if axes_t is not None else list(range(len(starts)))
    steps = int_list(steps_t) if steps_t is not None else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ModelError("Slice: starts, ends, axes and steps must have the same length")
    index: list[slice] = [slice(None)] * x.dim()
    flipped: list[int] = []
    flipped_index: list[slice] = [slice(None)] * x.dim()
    for start, end, axis, step in zip(
        starts, ends, normalize_axes(axes, x.dim(), "Slice"), steps, strict=True
    ):
        dim = x.shape[axis]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            index[axis] = slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
        elif step < 0:
            # torch has no negative steps: take [end+1, start] forward, flip it, then stride it.
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            index[axis] = slice(end + 1, start + 1) if start > end else slice(0, 0)
            flipped.append(axis)
            flipped_index[axis] = slice(None, None, -step)
        else:
            raise ModelError(f"Slice: step 0 on axis {axis}")
    y = x[tuple(index)]
    if flipped:
        y = torch.flip(y, flipped)[tuple(flipped_index)]
    return [y]


@register("Expand", host_inputs=(1,))
def expand(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, shape = required(inputs, 0, "Expand"), int_list(required(inputs, 1, "Expand"))
    # Bidirectional broadcast: a 1 in `shape` keeps the input's larger dim.
    return [x.expand(torch.broadcast_shapes(x.shape, tuple(shape)))]


@register("Tile", host_inputs=(1,))
def tile(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, repeats = required(inputs, 0, "Tile"), int_list(required(inputs, 1, "Tile"))
    return [x.repeat(repeats)]


@register("Trilu", host_inputs=(1,))
def trilu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, k_t = required(inputs, 0, "Trilu"), optional(inputs, 1)
    k = int_list(k_t)[0] if k_t is not None else 0
    return [torch.triu(x, k) if attrs.get("upper", 1) == 1 else torch.tril(x, k)]


def _pad_indices(size: int, begin: int, end: int, mode: str) -> torch.Tensor:
    """Source index, along one axis, of every output cell of an edge/reflect/wrap pad."""
    i = torch.arange(-begin, size + end)
    if mode == "edge":
        return i.clamp(0, size - 1)
    if mode == "wrap":
        return i.remainder(size)
    if size < 2 or begin >= size or end >= size:
        raise ModelError(f"Pad: reflect pads ({begin}, {end}) need an axis longer than them, not {size}")
    period = 2 * (size - 1)
    i = i.remainder(period)
    return torch.where(i >= size, period - i, i)


_TORCH_PAD_MODES = {"reflect": "reflect", "edge": "replicate"}


@register("Pad", host_inputs=(1, 2, 3))
def pad(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, pads_t = required(inputs, 0, "Pad"), required(inputs, 1, "Pad")
    value_t, axes_t = optional(inputs, 2), optional(inputs, 3)
    mode = attrs.get("mode", "constant")
    pads = int_list(pads_t)
    axes = normalize_axes(int_list(axes_t), x.dim(), "Pad") if axes_t is not None else list(range(x.dim()))
    if len(pads) != 2 * len(axes):
        raise ModelError(f"Pad: pads has {len(pads)} values; expected {2 * len(axes)} (begins, then ends)")
    per_dim = [(0, 0)] * x.dim()
    for i, axis in enumerate(axes):
        per_dim[axis] = (pads[i], pads[i + len(axes)])
    padded = [d for d, (b, e) in enumerate(per_dim) if b or e]
    if not padded:
        return [x]
    first = padded[0]
    flat: list[int] = []
    for begin, end in reversed(per_dim[first:]):  # F.pad lists the last dim first
        flat += [begin, end]
    if mode == "constant":
        value = value_t.item() if value_t is not None and value_t.numel() > 0 else 0
        # Negative pads crop, in torch as in ONNX.
        return [F.pad(x, flat, value=value)]
    if mode not in ("edge", "reflect", "wrap"):
        raise ModelError(f"Pad: mode {mode!r} is not constant, reflect, edge or wrap")
    spatial = x.dim() - first
    if mode in _TORCH_PAD_MODES and spatial <= 3 and x.dim() - spatial in (1, 2) and min(flat) >= 0:
        # torch's own reflect/replicate kernels cover the usual image case (pad the last 1-3 dims).
        return [F.pad(x, flat, mode=_TORCH_PAD_MODES[mode])]
    for axis in padded:
        begin, end = per_dim[axis]
        x = torch.index_select(
            x, axis, device_table(_pad_indices(x.shape[axis], begin, end, mode).numpy(), x.device)
        )
    return [x]


def _tensor_from_numpy(value: Any) -> torch.Tensor:
    arr = np.asarray(value)
    if arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16, which torch cannot read directly
        return torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16)
    # A copy: attribute arrays may be read-only views into the model's protobuf.
    return torch.from_numpy(np.array(arr, copy=True))


@register("Constant")
def constant(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    # A Constant has no input to take a device from: its output is on the CPU, and whoever
    # places tensors (the runtime, or constant folding) moves it.
    if "value" in attrs:
        return [_tensor_from_numpy(attrs["value"])]
    if "value_float" in attrs:
        return [torch.tensor(float(attrs["value_float"]), dtype=torch.float32)]
    if "value_floats" in attrs:
        return [torch.tensor([float(v) for v in attrs["value_floats"]], dtype=torch.float32)]
    if "value_int" in attrs:
        return [torch.tensor(int(attrs["value_int"]), dtype=torch.int64)]
    if "value_ints" in attrs:
        return [torch.tensor([int(v) for v in attrs["value_ints"]], dtype=torch.int64)]
    raise ModelError(
        "Constant: only value, value_float(s) and value_int(s) are supported "
        f"(got attributes {sorted(attrs)})"
    )


@register("ConstantOfShape", host_inputs=(0,), wants_device=True)
def constant_of_shape(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    shape_t = required(inputs, 0, "ConstantOfShape")
    value = _tensor_from_numpy(attrs["value"]).reshape(-1) if "value" in attrs else torch.zeros(1)
    device = target_device(attrs, shape_t)
    return [torch.full(int_list(shape_t), value[0].item(), dtype=value.dtype, device=device)]


@register("Range", host_inputs=(0, 1, 2), wants_device=True)
def range_(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    start, limit, delta = (required(inputs, i, "Range") for i in range(3))
    if start.dtype.is_floating_point:
        # The count as onnxruntime takes it: the difference in the input type, divided in double.
        n = max(math.ceil(((limit - start).double() / delta.double()).item()), 0)
        # Half types accumulate in float32 (opset 27's stash_type=1, the default), which is also the
        # more exact reading of older opsets.
        compute = start.dtype
        if start.dtype in (torch.float16, torch.bfloat16) and attrs.get("stash_type", 1) == 1:
            compute = torch.float32
        # start + i * delta; onnxruntime accumulates (value += delta) instead, which drifts by a
        # few ulps over long ranges.
        device = target_device(attrs, start)
        steps = torch.arange(n, dtype=compute, device=device)
        begin, step = start.to(device=device, dtype=compute), delta.to(device=device, dtype=compute)
        return [(begin + steps * step).to(start.dtype)]
    lo, hi, step = int(start.item()), int(limit.item()), int(delta.item())
    if step == 0:
        raise ModelError("Range: delta is 0")
    # torch.arange refuses a limit on the wrong side of start; ONNX gives an empty range.
    n = max(-((lo - hi) // step), 0)
    return [torch.arange(lo, lo + n * step, step, dtype=start.dtype, device=target_device(attrs, start))]
