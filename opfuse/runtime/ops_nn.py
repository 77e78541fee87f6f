"""Per-op torch kernels of the ONNX compute-heavy and neural-net ops: MatMul, Gemm, Einsum, Conv,
pooling and normalization.

Precision (TF32 or not) is the caller's choice through torch's global flags; nothing here sets them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from opfuse.errors import ModelError
from opfuse.runtime.ops_registry import (
    NUM_OUTPUTS_KEY,
    normalize_axis,
    onnx_torch_dtype,
    optional,
    register,
    required,
)

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]
Pads = list[tuple[int, int]]  # (begin, end) per spatial dim


def integer_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul for integer tensors on devices whose BLAS has no integer GEMM (CUDA)."""
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    # Multiply-and-sum in the integer type itself, so overflow wraps as in onnxruntime's C++.
    y = (a2.unsqueeze(-1) * b2.unsqueeze(-3)).sum(-2, dtype=a.dtype)
    # y is [..., M, N]: drop the promoted M first, so that N is still last when it goes too.
    if a.dim() == 1:
        y = y.squeeze(-2)
    if b.dim() == 1:
        y = y.squeeze(-1)
    return y


@register("MatMul")
def matmul(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    a, b = required(inputs, 0, "MatMul"), required(inputs, 1, "MatMul")
    if not a.dtype.is_floating_point and a.device.type != "cpu":
        return [integer_matmul(a, b)]
    # torch.matmul has numpy's rules (1-D promotion, broadcast batch dims), as ONNX does.
    return [torch.matmul(a, b)]


@register("Gemm")
def gemm(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    a, b, c = required(inputs, 0, "Gemm"), required(inputs, 1, "Gemm"), optional(inputs, 2)
    if attrs.get("transA", 0) == 1:
        a = a.t()
    if attrs.get("transB", 0) == 1:
        b = b.t()
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if c is not None and beta != 0.0:
        # One BLAS call that scales and adds C, like onnxruntime's, rather than three kernels.
        return [torch.addmm(c, a, b, beta=beta, alpha=alpha)]
    y = torch.mm(a, b)
    return [y if alpha == 1.0 else y * alpha]


@register("Einsum")
def einsum(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    equation = str(attrs.get("equation", "")).replace(" ", "")
    if not equation:
        raise ModelError("Einsum: the 'equation' attribute is missing")
    return [torch.einsum(equation, *[x for x in inputs if x is not None])]


def _spatial_pads(
    attrs: Attrs,
    in_sizes: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    op_type: str,
) -> Pads:
    """Explicit (begin, end) padding per spatial dim, resolving `auto_pad`."""
    n = len(kernel)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = list(attrs.get("pads", [0] * (2 * n)))
        if len(pads) != 2 * n:
            raise ModelError(f"{op_type}: pads has {len(pads)} values; expected {2 * n} (begins, then ends)")
        return [(pads[i], pads[i + n]) for i in range(n)]
    if auto_pad == "VALID":
        return [(0, 0)] * n
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ModelError(f"{op_type}: auto_pad={auto_pad!r} is not NOTSET, SAME_UPPER, SAME_LOWER or VALID")
    result: Pads = []
    for size, k, s, d in zip(in_sizes, kernel, strides, dilations, strict=True):
        out = -(-size // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, big = total // 2, total - total // 2
        # SAME_UPPER puts the odd pixel at the end, SAME_LOWER at the beginning.
        result.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    return result


def _pad_spatial(x: torch.Tensor, pads: Pads, value: float) -> torch.Tensor:
    flat: list[int] = []
    for begin, end in reversed(pads):  # F.pad lists the last dim first
        flat += [begin, end]
    return F.pad(x, flat, value=value)


def _symmetric(pads: Pads) -> list[int] | None:
    """The per-dim padding torch's own `padding=` can express, or None for asymmetric pads."""
    return [b for b, e in pads] if all(b == e for b, e in pads) else None


_CONV: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@register("Conv")
def conv(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, w, b = required(inputs, 0, "Conv"), required(inputs, 1, "Conv"), optional(inputs, 2)
    n = x.dim() - 2
    if n not in _CONV:
        raise ModelError(f"Conv: {n}-D convolution is not supported (1-D, 2-D and 3-D are)")
    kernel = list(attrs.get("kernel_shape", w.shape[2:]))
    strides = list(attrs.get("strides", [1] * n))
    dilations = list(attrs.get("dilations", [1] * n))
    pads = _spatial_pads(attrs, x.shape[2:], kernel, strides, dilations, "Conv")
    padding = _symmetric(pads)
    if padding is None:
        x, padding = _pad_spatial(x, pads, 0.0), [0] * n
    return [_CONV[n](x, w, b, strides, padding, dilations, int(attrs.get("group", 1)))]


def _pool_out_size(size: int, k: int, s: int, d: int, pad: tuple[int, int], ceil: bool) -> int:
    span = size + pad[0] + pad[1] - (k - 1) * d - 1
    out = (-(-span // s) if ceil else span // s) + 1
    # Like onnxruntime and torch: a window may not start in the end padding.
    if ceil and (out - 1) * s >= size + pad[0]:
        out -= 1
    return out


_MAX_POOL: dict[int, Callable[..., torch.Tensor]] = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL: dict[int, Callable[..., torch.Tensor]] = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pool_geometry(
    x: torch.Tensor, attrs: Attrs, op_type: str
) -> tuple[list[int], list[int], list[int], Pads, bool, list[int]]:
    """kernel, strides, dilations, pads, ceil_mode and output sizes of a pooling node."""
    n = x.dim() - 2
    if n not in _MAX_POOL:
        raise ModelError(f"{op_type}: {n}-D pooling is not supported (1-D, 2-D and 3-D are)")
    if "kernel_shape" not in attrs:
        raise ModelError(f"{op_type}: the 'kernel_shape' attribute is missing")
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides", [1] * n))
    dilations = list(attrs.get("dilations", [1] * n))
    pads = _spatial_pads(attrs, x.shape[2:], kernel, strides, dilations, op_type)
    # With SAME padding the output size is fixed (ceil(in / stride)); ceil_mode does not apply.
    ceil = attrs.get("ceil_mode", 0) == 1 and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")
    outs = [
        _pool_out_size(size, k, s, d, p, ceil)
        for size, k, s, d, p in zip(x.shape[2:], kernel, strides, dilations, pads, strict=True)
    ]
    return kernel, strides, dilations, pads, ceil, outs


def _torch_pads_ok(pads: Pads, kernel: Sequence[int]) -> list[int] | None:
    """Padding torch pooling accepts as is: symmetric and at most half the kernel."""
    padding = _symmetric(pads)
    if padding is None or any(p > k // 2 for p, k in zip(padding, kernel, strict=True)):
        return None
    return padding


def _extend_to_windows(
    pads: Pads,
    sizes: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    outs: Sequence[int],
) -> Pads:
    """Pads grown at the end so every output window lies inside the padded input (ceil_mode)."""
    grown: Pads = []
    for (b, e), size, k, s, d, o in zip(pads, sizes, kernel, strides, dilations, outs, strict=True):
        needed = (o - 1) * s + (k - 1) * d + 1
        grown.append((b, max(e, needed - size - b)))
    return grown


def _crop(y: torch.Tensor, outs: Sequence[int]) -> torch.Tensor:
    for i, o in enumerate(outs):
        y = y.narrow(2 + i, 0, o)
    return y


@register("MaxPool", wants_num_outputs=True)
def max_pool(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "MaxPool")
    kernel, strides, dilations, pads, ceil, outs = _pool_geometry(x, attrs, "MaxPool")
    n = x.dim() - 2
    want_indices = attrs.get(NUM_OUTPUTS_KEY, 1) > 1
    padding = _torch_pads_ok(pads, kernel)
    if padding is not None and not want_indices:
        return [_MAX_POOL[n](x, kernel, strides, padding, dilations, ceil_mode=ceil)]
    # Asymmetric or wide pads, or indices wanted: pad with -inf ourselves, over every window the
    # output needs, so that torch's indices are positions in a padded tensor we know the layout of.
    grown = _extend_to_windows(pads, x.shape[2:], kernel, strides, dilations, outs)
    fill = -math.inf if x.dtype.is_floating_point else float(torch.iinfo(x.dtype).min)
    padded = _pad_spatial(x, grown, fill)
    if not want_indices:
        return [_crop(_MAX_POOL[n](padded, kernel, strides, 0, dilations), outs)]
    y, flat = _MAX_POOL[n](padded, kernel, strides, 0, dilations, return_indices=True)
    y, flat = _crop(y, outs), _crop(flat, outs)
    return [y, _onnx_pool_indices(flat, x.shape, padded.shape[2:], grown, int(attrs.get("storage_order", 0)))]


def _onnx_pool_indices(
    flat: torch.Tensor, in_shape: Sequence[int], padded_sizes: Sequence[int], pads: Pads, storage_order: int
) -> torch.Tensor:
    """torch's per-plane indices into the padded input, as ONNX's: flat over the whole unpadded input
    (N x C x D1 x ...), row-major, or with the spatial dims column-major when storage_order=1."""
    sizes = list(in_shape[2:])
    coords = []
    rest = flat
    for size in reversed(padded_sizes):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    coords = [c - p[0] for c, p in zip(coords, pads, strict=True)]
    index = torch.zeros_like(flat)
    if storage_order == 1:
        for c, size in zip(reversed(coords), reversed(sizes), strict=True):
            index = index * size + c
    else:
        for c, size in zip(coords, sizes, strict=True):
            index = index * size + c
    plane = math.prod(sizes)
    batch, channels = in_shape[0], in_shape[1]
    offsets = torch.arange(batch * channels, device=flat.device).reshape(batch, channels) * plane
    return index + offsets.reshape(batch, channels, *([1] * len(sizes)))


@register("AveragePool")
def average_pool(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "AveragePool")
    kernel, strides, dilations, pads, ceil, outs = _pool_geometry(x, attrs, "AveragePool")
    include_pad = attrs.get("count_include_pad", 0) == 1
    n = x.dim() - 2
    padding = _torch_pads_ok(pads, kernel)
    if padding is not None and all(d == 1 for d in dilations):
        # torch divides like onnxruntime: the pads count when count_include_pad=1, the ceil_mode
        # overhang past the end pad never does.
        if n == 3 and x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16):
            # torch's CPU avg_pool3d has no half kernels (a written-out LocalResponseNorm pools the
            # channels as a third spatial dim): average in float32, round once to the input's type.
            return [_AVG_POOL[n](x.float(), kernel, strides, padding, ceil, include_pad).to(x.dtype)]
        return [_AVG_POOL[n](x, kernel, strides, padding, ceil, include_pad)]
    # Otherwise sum with a depthwise all-ones conv and divide by a count made the same way from a
    # mask of the cells that count: real ones, plus the declared pads when they are included.
    grown = _extend_to_windows(pads, x.shape[2:], kernel, strides, dilations, outs)
    channels = x.shape[1]
    ones = torch.ones([channels, 1, *kernel], dtype=x.dtype, device=x.device)
    sums = _CONV[n](_pad_spatial(x, grown, 0.0), ones, None, strides, 0, dilations, channels)
    mask = torch.ones([1, 1, *x.shape[2:]], dtype=x.dtype, device=x.device)
    if include_pad:
        mask = _pad_spatial(mask, pads, 1.0)
        mask = _pad_spatial(mask, [(0, g[1] - p[1]) for g, p in zip(grown, pads, strict=True)], 0.0)
    else:
        mask = _pad_spatial(mask, grown, 0.0)
    counts = _CONV[n](mask, ones[:1], None, strides, 0, dilations)
    return [_crop(sums, outs) / _crop(counts, outs)]


def _nchw(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 3, 1, 2)


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 3, 1)


# The channels-last region (opfuse/passes/layout.py): NHWC tensors in and out. An NHWC tensor
# permuted to NCHW is torch's channels_last memory format, which cuDNN and the pooling kernels run
# natively, so these permutations move no data.
@register("opfuse.ConvNHWC")
def conv_nhwc(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    """The NHWC conv; with inputs 3 and 4 (passes/shortcut_conv.py) plus the 1x1 conv of a second
    input at `shortcut_strides`: two library convolutions and their sum (three launches)."""
    x, w = required(inputs, 0, "ConvNHWC"), required(inputs, 1, "ConvNHWC")
    y = conv([_nchw(x), _nchw(w), optional(inputs, 2)], attrs)[0]
    sx = optional(inputs, 3)
    if sx is not None:
        sw = required(inputs, 4, "ConvNHWC")
        strides = [int(v) for v in attrs["shortcut_strides"]]
        y = y + conv([_nchw(sx), _nchw(sw), None], {"kernel_shape": [1, 1], "strides": strides})[0]
    return [_nhwc(y)]


@register("opfuse.MaxPoolNHWC")
def max_pool_nhwc(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [_nhwc(max_pool([_nchw(required(inputs, 0, "MaxPoolNHWC"))], attrs)[0])]


@register("opfuse.AveragePoolNHWC")
def average_pool_nhwc(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [_nhwc(average_pool([_nchw(required(inputs, 0, "AveragePoolNHWC"))], attrs)[0])]


@register("GlobalAveragePool")
def global_average_pool(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "GlobalAveragePool")
    return [torch.mean(x, dim=list(range(2, x.dim())), keepdim=True)]


@register("GlobalMaxPool")
def global_max_pool(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "GlobalMaxPool")
    return [torch.amax(x, dim=list(range(2, x.dim())), keepdim=True)]


@register("BatchNormalization", wants_num_outputs=True)
def batch_normalization(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    if attrs.get("training_mode", 0) == 1 or attrs.get(NUM_OUTPUTS_KEY, 1) > 1:
        raise ModelError(
            "BatchNormalization: training mode (running mean/var outputs) is not supported; "
            "export the model in inference mode"
        )
    x, scale, bias, mean, var = (required(inputs, i, "BatchNormalization") for i in range(5))
    eps = float(attrs.get("epsilon", 1e-5))
    return [F.batch_norm(x, mean, var, scale, bias, training=False, eps=eps)]


@register("LayerNormalization", wants_num_outputs=True)
def layer_normalization(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "LayerNormalization")
    scale, bias = required(inputs, 1, "LayerNormalization"), optional(inputs, 2)
    axis = normalize_axis(int(attrs.get("axis", -1)), x.dim(), "LayerNormalization")
    eps = float(attrs.get("epsilon", 1e-5))
    stash = onnx_torch_dtype(int(attrs.get("stash_type", 1)))
    dims = list(range(axis, x.dim()))
    norm_shape = list(x.shape[axis:])
    if list(scale.shape) == norm_shape and (bias is None or list(bias.shape) == norm_shape):
        # torch computes statistics in float for half inputs, which is what stash_type=1 asks.
        y, mean, rstd = torch.native_layer_norm(x, norm_shape, scale, bias, eps)
    else:
        # Scale and B may be anything that broadcasts to the normalized shape.
        xs = x.to(stash)
        mean = torch.mean(xs, dim=dims, keepdim=True)
        centered = xs - mean
        rstd = torch.rsqrt(torch.mean(centered * centered, dim=dims, keepdim=True) + eps)
        y = centered * rstd * scale
        y = (y if bias is None else y + bias).to(x.dtype)
    if attrs.get(NUM_OUTPUTS_KEY, 1) == 1:
        return [y]
    return [y, mean.to(stash), rstd.to(stash)]
