"""Per-op torch kernels of the ONNX transposed convolution and Lp pooling (the plain Conv and pooling
ops live in ops_nn, whose padding geometry these share)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from opfuse.errors import ModelError
from opfuse.runtime.ops_nn import (
    _CONV,
    _crop,
    _extend_to_windows,
    _pad_spatial,
    _pool_geometry,
)
from opfuse.runtime.ops_registry import optional, register, required

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]

_CONV_T: dict[int, Callable[..., torch.Tensor]] = {
    1: F.conv_transpose1d,
    2: F.conv_transpose2d,
    3: F.conv_transpose3d,
}


def _transpose_pads(
    attrs: Attrs,
    in_sizes: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    output_padding: Sequence[int],
) -> list[tuple[int, int]]:
    """(begin, end) cropping of the full transposed-conv output per spatial dim (negative: grow)."""
    n = len(kernel)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    output_shape = attrs.get("output_shape")
    if output_shape is None and auto_pad in ("NOTSET", "VALID"):
        pads = list(attrs.get("pads", [0] * (2 * n))) if auto_pad == "NOTSET" else [0] * (2 * n)
        if len(pads) != 2 * n:
            raise ModelError(f"ConvTranspose: pads has {len(pads)} values; expected {2 * n}")
        return [(pads[i], pads[i + n]) for i in range(n)]
    if output_shape is None:  # SAME_*: the output is the input times the stride
        output_shape = [size * s for size, s in zip(in_sizes, strides, strict=True)]
    output_shape = list(output_shape)[-n:]
    result = []
    for size, k, s, d, op, out in zip(
        in_sizes, kernel, strides, dilations, output_padding, output_shape, strict=True
    ):
        total = s * (size - 1) + op + (k - 1) * d + 1 - out
        # As onnxruntime splits it: the odd cell at the end for SAME_UPPER, else at the beginning.
        small, big = total // 2, total - total // 2
        result.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    return result


@register("ConvTranspose")
def conv_transpose(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, w, b = required(inputs, 0, "ConvTranspose"), required(inputs, 1, "ConvTranspose"), optional(inputs, 2)
    n = x.dim() - 2
    if n not in _CONV_T:
        raise ModelError(f"ConvTranspose: {n}-D is not supported (1-D, 2-D and 3-D are)")
    kernel = list(attrs.get("kernel_shape", w.shape[2:]))
    strides = list(attrs.get("strides", [1] * n))
    dilations = list(attrs.get("dilations", [1] * n))
    output_padding = list(attrs.get("output_padding", [0] * n))[:n]
    group = int(attrs.get("group", 1))
    pads = _transpose_pads(attrs, x.shape[2:], kernel, strides, dilations, output_padding)
    # The full output, then ONNX's geometry by hand: output_padding adds cells at the end, pads crop
    # (F.pad with negative amounts crops, positive ones add zeros).
    y = _CONV_T[n](x, w, None, strides, 0, 0, group, dilations)
    flat: list[int] = []
    for (begin, end), extra in reversed(list(zip(pads, output_padding, strict=True))):
        flat += [-begin, extra - end]
    if any(flat):
        y = F.pad(y, flat)
    if b is not None:
        y = y + b.reshape(-1, *([1] * n))
    return [y]


def _lp(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.abs(x) if p == 1 else torch.abs(x) ** p


@register("LpPool")
def lp_pool(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "LpPool")
    p = float(attrs.get("p", 2))
    kernel, strides, dilations, pads, _ceil, outs = _pool_geometry(x, attrs, "LpPool")
    # Sum |x|^p over each window with a depthwise all-ones conv (padding cells are zeros, which add
    # nothing), then take the p-th root.
    grown = _extend_to_windows(pads, x.shape[2:], kernel, strides, dilations, outs)
    channels = x.shape[1]
    n = x.dim() - 2
    ones = torch.ones([channels, 1, *kernel], dtype=x.dtype, device=x.device)
    sums = _CONV[n](_pad_spatial(_lp(x, p), grown, 0.0), ones, None, strides, 0, dilations, channels)
    return [_crop(sums, outs) ** (1.0 / p)]


@register("GlobalLpPool")
def global_lp_pool(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "GlobalLpPool")
    p = float(attrs.get("p", 2))
    return [torch.sum(_lp(x, p), dim=list(range(2, x.dim())), keepdim=True) ** (1.0 / p)]
