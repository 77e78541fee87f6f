"""Per-op torch kernels of the ONNX image-geometry ops: Resize (every mode and coordinate transform),
DepthToSpace, SpaceToDepth and CenterCropPad.

Resize is separable: each resized axis is one gather of a few taps and a weighted sum. The taps and
weights are computed on the host in float64, exactly as the ONNX reference computes them
(onnx/reference/ops/op_resize.py), from the compile-time sizes; only the gathers run on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from opfuse.errors import ModelError
from opfuse.runtime.ops_registry import int_list, normalize_axes, optional, register, required
from opfuse.runtime.tensors import device_table

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]
# (ratio in (0, 1], scale) -> tap weights, for one output position.
Coeffs = Callable[[float, float], np.ndarray]


def _nearest(nearest_mode: str) -> Coeffs:
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        if nearest_mode == "round_prefer_floor":
            return np.array([ratio <= 0.5, ratio > 0.5], dtype=np.float64)
        if nearest_mode == "round_prefer_ceil":
            return np.array([ratio < 0.5, ratio >= 0.5], dtype=np.float64)
        if nearest_mode == "floor":
            return np.array([1.0, 0.0])
        if nearest_mode == "ceil":
            return np.array([0.0, 1.0])
        raise ModelError(f"Resize: nearest_mode {nearest_mode!r} is not one of round_prefer_floor, "
                         "round_prefer_ceil, floor, ceil")  # fmt: skip

    return coeffs


def _linear(antialias: bool) -> Coeffs:
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([1.0 - ratio, ratio])
        # Downsampling with antialias widens the triangle filter by 1/scale.
        scale = min(scale, 1.0)
        start = int(np.floor(-1 / scale) + 1)
        footprint = 2 - 2 * start
        args = (np.arange(start, start + footprint) - ratio) * scale
        c = np.clip(1 - np.abs(args), 0, 1)
        return np.asarray(c / c.sum())

    return coeffs


def _cubic(a: float, antialias: bool) -> Coeffs:
    def kernel(x: float) -> float:
        x = abs(x)
        if x <= 1:
            return (a + 2) * x**3 - (a + 3) * x**2 + 1
        if x < 2:
            return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
        return 0.0

    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([kernel(ratio + 1), kernel(ratio), kernel(1 - ratio), kernel(2 - ratio)])
        scale = min(scale, 1.0)
        i_start = int(np.floor(-2 / scale) + 1)
        c = np.array([kernel(scale * (i - ratio)) for i in range(i_start, 2 - i_start)])
        return np.asarray(c / c.sum())

    return coeffs


def _source_coords(
    mode: str, out_size: int, in_size: int, scale: float, roi: tuple[float, float] | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Input coordinate of every output position, and (tf_crop_and_resize) which lie outside."""
    y = np.arange(out_size, dtype=np.float64)
    out_width = scale * in_size  # the real-valued output length, as the ONNX reference uses it
    if mode == "align_corners":
        # The integer output length, as the operator's definition and onnxruntime have it (the ONNX
        # reference implementation uses the fractional one, scale * in_size, and differs when scales
        # do not give whole lengths).
        return (np.zeros(out_size) if out_size == 1 else y * (in_size - 1) / (out_size - 1)), None
    if mode == "asymmetric":
        return y / scale, None
    if mode == "tf_half_pixel_for_nn":  # Resize-11 only
        return (y + 0.5) / scale, None
    if mode == "pytorch_half_pixel":
        return (np.full(out_size, -0.5) if out_width == 1 else (y + 0.5) / scale - 0.5), None
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if mode == "half_pixel_symmetric":
        offset = in_size / 2 * (1 - out_size / out_width)
        return offset + (y + 0.5) / scale - 0.5, None
    if mode == "tf_crop_and_resize":
        lo, hi = roi if roi is not None else (0.0, 1.0)
        if out_width == 1:
            x = np.full(out_size, (hi - lo) * (in_size - 1) / 2)
        else:
            x = y * (hi - lo) * (in_size - 1) / (out_width - 1)
        x = x + lo * (in_size - 1)
        return x, (x < 0) | (x > in_size - 1)
    raise ModelError(f"Resize: coordinate_transformation_mode {mode!r} is not supported")


def _taps(
    coeffs_of: Coeffs, x: np.ndarray, in_size: int, scale: float, exclude_outside: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each (out, taps): the input cells each output position reads, and how much.

    Neighbours are the taps nearest to x (ties to the left), with edge cells repeated past the ends,
    as the ONNX reference takes them.
    """
    floor = np.floor(x)
    ratios = np.where(x == floor, 1.0, x - floor)
    weights = np.stack([coeffs_of(float(r), scale) for r in ratios]) if len(x) else np.zeros((0, 2))
    n = weights.shape[1]
    pad = math.ceil(n / 2)
    xp = x + pad
    p = np.floor(xp).astype(np.int64)
    frac = xp - p
    if n % 2 == 0:
        offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        base = -((n - 1) // 2)
        offset = np.where(frac <= 0.5, base, base + 1)
    index = (p + offset)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        weights = np.where((index < 0) | (index >= in_size), 0.0, weights)
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(index, 0, in_size - 1), weights


def _resize_axis(
    x: torch.Tensor,
    axis: int,
    index: np.ndarray,
    weights: np.ndarray,
    outside: np.ndarray | None,
    fill: float,
) -> torch.Tensor:
    out, n = index.shape
    idx = device_table(index.reshape(-1), x.device)
    gathered = x.index_select(axis, idx)
    gathered = gathered.reshape(*x.shape[:axis], out, n, *x.shape[axis + 1 :])
    w = device_table(weights, x.device, x.dtype)
    y = (gathered * w.reshape(out, n, *([1] * (x.dim() - axis - 1)))).sum(dim=axis + 1)
    if outside is not None and outside.any():
        mask = device_table(outside, x.device).reshape(out, *([1] * (x.dim() - axis - 1)))
        y = torch.where(mask, torch.full_like(y, fill), y)
    return y


def _floats(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None or t.numel() == 0 else [float(v) for v in t.reshape(-1).tolist()]


@register("Resize", host_inputs=(1, 2, 3))
def resize(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Resize")
    roi, scales = _floats(optional(inputs, 1)), _floats(optional(inputs, 2))
    sizes_t = optional(inputs, 3)
    sizes = int_list(sizes_t) if sizes_t is not None and sizes_t.numel() > 0 else None
    rank = x.dim()
    axes = normalize_axes(list(attrs.get("axes", range(rank))), rank, "Resize")
    mode = attrs.get("mode", "nearest")
    antialias = attrs.get("antialias", 0) == 1
    coeffs_of: Coeffs
    if mode == "nearest":
        coeffs_of = _nearest(attrs.get("nearest_mode", "round_prefer_floor"))
    elif mode == "linear":
        coeffs_of = _linear(antialias)
    elif mode == "cubic":
        coeffs_of = _cubic(float(attrs.get("cubic_coeff_a", -0.75)), antialias)
    else:
        raise ModelError(f"Resize: mode {mode!r} is not nearest, linear or cubic")
    full_scales: list[float] = [1.0] * rank
    full_sizes: list[int] = list(x.shape)
    if sizes is not None:
        for a, s in zip(axes, sizes, strict=True):
            full_sizes[a] = s
        full_scales = [full_sizes[i] / x.shape[i] if x.shape[i] else 1.0 for i in range(rank)]
        policy = attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            picked = [full_scales[a] for a in axes]
            scale = min(picked) if policy == "not_larger" else max(picked)
            for a in axes:
                full_scales[a] = scale
                full_sizes[a] = int(scale * x.shape[a] + 0.5)  # round half up
    elif scales is not None:
        for a, factor in zip(axes, scales, strict=True):
            full_scales[a] = factor
        # float64 product, truncated: how the ONNX reference sizes the output.
        full_sizes = [int(np.float64(full_scales[i]) * x.shape[i]) for i in range(rank)]
    else:
        raise ModelError("Resize: neither scales nor sizes is given")
    full_roi: list[tuple[float, float]] | None = None
    if roi is not None:
        full_roi = [(0.0, 1.0)] * rank
        for i, a in enumerate(axes):
            full_roi[a] = (roi[i], roi[len(axes) + i])
    ctm = attrs.get("coordinate_transformation_mode", "half_pixel")
    fill = float(attrs.get("extrapolation_value", 0.0))
    exclude = attrs.get("exclude_outside", 0) == 1
    compute = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    if not x.dtype.is_floating_point:
        compute = torch.float64
    y = x.to(compute)
    for a in axes:
        axis_roi = full_roi[a] if full_roi is not None else None
        if (
            full_sizes[a] == x.shape[a]
            and math.isclose(full_scales[a], 1.0)
            and axis_roi in (None, (0.0, 1.0))
        ):
            continue  # identity along this axis
        coords, outside = _source_coords(ctm, full_sizes[a], x.shape[a], full_scales[a], axis_roi)
        index, weights = _taps(coeffs_of, coords, x.shape[a], full_scales[a], exclude)
        y = _resize_axis(y, a, index, weights, outside if ctm == "tf_crop_and_resize" else None, fill)
    if x.dtype.is_floating_point:
        return [y.to(x.dtype)]
    info = torch.iinfo(x.dtype)  # integer images: round half to even and saturate, as the reference
    return [torch.round(y).clamp(info.min, info.max).to(x.dtype)]


def _blocksize(attrs: Attrs, op_type: str) -> int:
    if "blocksize" not in attrs:
        raise ModelError(f"{op_type}: the 'blocksize' attribute is missing")
    return int(attrs["blocksize"])


@register("DepthToSpace")
def depth_to_space(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "DepthToSpace")
    bs = _blocksize(attrs, "DepthToSpace")
    b, c, h, w = x.shape
    if attrs.get("mode", "DCR") == "CRD":
        t = x.reshape(b, c // bs**2, bs, bs, h, w).permute(0, 1, 4, 2, 5, 3)
    else:
        t = x.reshape(b, bs, bs, c // bs**2, h, w).permute(0, 3, 4, 1, 5, 2)
    return [t.reshape(b, c // bs**2, h * bs, w * bs)]


@register("SpaceToDepth")
def space_to_depth(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "SpaceToDepth")
    bs = _blocksize(attrs, "SpaceToDepth")
    b, c, h, w = x.shape
    t = x.reshape(b, c, h // bs, bs, w // bs, bs)
    t = t.permute(0, 1, 3, 5, 2, 4) if attrs.get("mode", "DCR") == "CRD" else t.permute(0, 3, 5, 1, 2, 4)
    return [t.reshape(b, c * bs * bs, h // bs, w // bs)]


@register("CenterCropPad", host_inputs=(1,))
def center_crop_pad(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, shape = required(inputs, 0, "CenterCropPad"), int_list(required(inputs, 1, "CenterCropPad"))
    axes = normalize_axes(list(attrs.get("axes", range(x.dim()))), x.dim(), "CenterCropPad")
    flat = [0, 0] * x.dim()
    for axis, target in zip(axes, shape, strict=True):
        diff = target - x.shape[axis]
        # Cropping starts rounded down; padding puts the odd cell on the right. Negative pads crop.
        begin = diff // 2 if diff >= 0 else -((-diff) // 2)
        slot = 2 * (x.dim() - 1 - axis)  # F.pad lists the last dim first
        flat[slot], flat[slot + 1] = begin, diff - begin
    return [F.pad(x, flat)]


# GridSample's mode names: opset 16 spelled them as torch does, opset 20 renamed two.
_GRID_MODES = {
    "linear": "bilinear",
    "bilinear": "bilinear",
    "nearest": "nearest",
    "cubic": "bicubic",
    "bicubic": "bicubic",
}


@register("GridSample")
def grid_sample(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, grid = required(inputs, 0, "GridSample"), required(inputs, 1, "GridSample")
    mode = _GRID_MODES.get(attrs.get("mode", "linear" if x.dim() != 4 else "bilinear"))
    padding = attrs.get("padding_mode", "zeros")
    if mode is None or padding not in ("zeros", "border", "reflection"):
        raise ModelError(
            f"GridSample: mode {attrs.get('mode')!r} / padding_mode {padding!r} is not supported"
        )
    if x.dim() not in (4, 5) or (mode == "bicubic" and x.dim() != 4):
        raise ModelError(f"GridSample: {mode} sampling of a rank-{x.dim()} input is not supported")
    align = attrs.get("align_corners", 0) == 1
    compute = torch.promote_types(x.dtype, torch.float32)
    y = F.grid_sample(x.to(compute), grid.to(compute), mode=mode, padding_mode=padding, align_corners=align)
    return [y.to(x.dtype)]


@register("AffineGrid", host_inputs=(1,))
def affine_grid(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    theta, size = required(inputs, 0, "AffineGrid"), int_list(required(inputs, 1, "AffineGrid"))
    align = attrs.get("align_corners", 0) == 1
    compute = torch.promote_types(theta.dtype, torch.float32)
    return [F.affine_grid(theta.to(compute), size, align_corners=align).to(theta.dtype)]


@register("Col2Im", host_inputs=(1, 2))
def col2im(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    """Col2Im, any number of spatial dims: each column's blocks summed into the padded image at
    their window positions (one index_add), then the padding cropped off."""
    x = required(inputs, 0, "Col2Im")
    image = int_list(required(inputs, 1, "Col2Im"))
    block = int_list(required(inputs, 2, "Col2Im"))
    nd = len(image)
    if len(block) != nd or x.dim() != 3:
        raise ModelError(
            f"Col2Im: image_shape {image} and block_shape {block} must have one length, and the input "
            f"rank 3 ([N, C * prod(block_shape), L]); got input shape {list(x.shape)}"
        )
    dil = [int(v) for v in attrs.get("dilations", [1] * nd)]
    strides = [int(v) for v in attrs.get("strides", [1] * nd)]
    pads = [int(v) for v in attrs.get("pads", [0] * 2 * nd)]
    padded = [image[d] + pads[d] + pads[d + nd] for d in range(nd)]
    counts = [(padded[d] - dil[d] * (block[d] - 1) - 1) // strides[d] + 1 for d in range(nd)]
    taps = math.prod(block)
    n, cols, length = x.shape
    if cols % taps or length != math.prod(counts) or min(counts) < 1:
        raise ModelError(
            f"Col2Im: input shape {list(x.shape)} does not match image_shape {image}, block_shape {block}, "
            f"pads {pads}, strides {strides} and dilations {dil} ({math.prod(counts)} blocks of {taps})"
        )
    dev = x.device
    where = torch.zeros((), dtype=torch.int64, device=dev)
    inner = 1
    for d in reversed(range(nd)):  # flat position in the padded image, of [taps..., blocks...]
        k = torch.arange(block[d], device=dev) * dil[d]
        b = torch.arange(counts[d], device=dev) * strides[d]
        pos = k.reshape([-1 if i == d else 1 for i in range(nd)] + [1] * nd) + b.reshape(
            [1] * nd + [-1 if i == d else 1 for i in range(nd)]
        )
        where = where + pos * inner
        inner *= padded[d]
    out = x.new_zeros(n, cols // taps, math.prod(padded))
    out.index_add_(2, where.reshape(-1), x.reshape(n, cols // taps, -1))
    out = out.reshape(n, cols // taps, *padded)
    crop = tuple(slice(pads[d], pads[d] + image[d]) for d in range(nd))
    return [out[(slice(None), slice(None), *crop)].contiguous()]
