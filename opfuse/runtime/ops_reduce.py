"""Per-op torch kernels of the ONNX reductions (opset 18: axes as an input), arg-reductions and
the softmax family (Softmax, LogSoftmax, Hardmax)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opfuse.runtime.ops_registry import int_list, normalize_axes, normalize_axis, optional, register, required

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]
# (x, dims, keepdim) -> reduced x; dims is non-empty, normalized and sorted.
Reducer = Callable[[torch.Tensor, list[int], bool], torch.Tensor]


def _reduce_mean(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    if x.dtype.is_floating_point:
        return torch.mean(x, dim=dims, keepdim=keepdim)
    # torch.mean refuses integers; onnxruntime sums and divides with C++ `/` (truncation).
    count = 1
    for d in dims:
        count *= x.shape[d]
    return torch.div(torch.sum(x, dim=dims, keepdim=keepdim), count, rounding_mode="trunc")


def _reduce_prod(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    # torch.prod takes one dim at a time; go from the last so earlier indices stay valid.
    for d in reversed(dims):
        x = torch.prod(x, dim=d, keepdim=keepdim)
    return x


def _reduce_sum(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    return torch.sum(x, dim=dims, keepdim=keepdim)


def _empty_extreme(x: torch.Tensor, dims: list[int], keepdim: bool, largest: bool) -> torch.Tensor:
    """Max (or min) over no elements: the identity of the reduction, the lowest (highest) value."""
    shape = [1 if i in dims else n for i, n in enumerate(x.shape) if keepdim or i not in dims]
    if x.dtype == torch.bool:
        fill: float | bool = not largest
    elif x.dtype.is_floating_point:
        fill = -torch.inf if largest else torch.inf
    else:
        info = torch.iinfo(x.dtype)
        fill = info.min if largest else info.max
    return torch.full(shape, fill, dtype=x.dtype, device=x.device)


def _reduce_max(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    if any(x.shape[d] == 0 for d in dims):
        return _empty_extreme(x, dims, keepdim, largest=True)
    if x.dtype == torch.bool:  # bool from opset 20: max is any
        return torch.amax(x.to(torch.uint8), dim=dims, keepdim=keepdim).to(torch.bool)
    return torch.amax(x, dim=dims, keepdim=keepdim)


def _reduce_min(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    if any(x.shape[d] == 0 for d in dims):
        return _empty_extreme(x, dims, keepdim, largest=False)
    if x.dtype == torch.bool:
        return torch.amin(x.to(torch.uint8), dim=dims, keepdim=keepdim).to(torch.bool)
    return torch.amin(x, dim=dims, keepdim=keepdim)


def _reduce_l1(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    return torch.sum(torch.abs(x), dim=dims, keepdim=keepdim)


def _reduce_l2(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    return torch.sqrt(torch.sum(x * x, dim=dims, keepdim=keepdim))


def _reduce_sum_square(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    return torch.sum(x * x, dim=dims, keepdim=keepdim)


def _reduce_log_sum(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    return torch.log(torch.sum(x, dim=dims, keepdim=keepdim))


def _reduce_log_sum_exp(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    return torch.logsumexp(x, dim=dims, keepdim=keepdim)


# Reducing over no axes (noop_with_empty_axes=1) leaves the elementwise part of the reduction, as
# in the ONNX reference: ReduceSumSquare squares, ReduceL1 takes |x|, the rest are the identity.
_NOOP: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ReduceL1": torch.abs,
    "ReduceL2": torch.abs,
    "ReduceSumSquare": lambda x: x * x,
}


def _register_reduce(op_type: str, reducer: Reducer) -> None:
    noop = _NOOP.get(op_type, lambda x: x)

    def impl(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
        x = required(inputs, 0, op_type)
        axes_t = optional(inputs, 1)
        axes = int_list(axes_t) if axes_t is not None else []
        keepdim = attrs.get("keepdims", 1) == 1
        if not axes:
            if attrs.get("noop_with_empty_axes", 0) == 1:
                return [noop(x)]
            # Spelled out because torch reads dim=[] as "all dims" only for some reductions.
            axes = list(range(x.dim()))
        if x.dim() == 0:
            return [noop(x)]
        return [reducer(x, sorted(set(normalize_axes(axes, x.dim(), op_type))), keepdim)]

    register(op_type, host_inputs=(1,))(impl)


for _op, _reducer in {
    "ReduceMean": _reduce_mean,
    "ReduceSum": _reduce_sum,
    "ReduceMax": _reduce_max,
    "ReduceMin": _reduce_min,
    "ReduceProd": _reduce_prod,
    "ReduceL1": _reduce_l1,
    "ReduceL2": _reduce_l2,
    "ReduceSumSquare": _reduce_sum_square,
    "ReduceLogSum": _reduce_log_sum,
    "ReduceLogSumExp": _reduce_log_sum_exp,
}.items():
    _register_reduce(_op, _reducer)


def _arg_reduce(op_type: str, fn: Callable[..., torch.Tensor]) -> None:
    def impl(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
        x = required(inputs, 0, op_type)
        axis = normalize_axis(int(attrs.get("axis", 0)), x.dim(), op_type)
        keepdim = attrs.get("keepdims", 1) == 1
        if attrs.get("select_last_index", 0) == 1:
            # torch returns the first of equal extremes; search the flipped axis and map back.
            idx = fn(torch.flip(x, [axis]), dim=axis, keepdim=keepdim)
            return [x.shape[axis] - 1 - idx]
        return [fn(x, dim=axis, keepdim=keepdim)]

    register(op_type)(impl)


_arg_reduce("ArgMax", torch.argmax)
_arg_reduce("ArgMin", torch.argmin)


@register("Softmax")
def softmax(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Softmax")
    return [torch.softmax(x, dim=normalize_axis(int(attrs.get("axis", -1)), x.dim(), "Softmax"))]


@register("Hardmax")
def hardmax(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Hardmax")
    axis = normalize_axis(int(attrs.get("axis", -1)), x.dim(), "Hardmax")
    # 1 at the first largest element along the axis (argmax picks the first of equal maxima).
    index = torch.argmax(x, dim=axis, keepdim=True)
    return [torch.zeros_like(x).scatter_(axis, index, 1)]


@register("LogSoftmax")
def log_softmax(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "LogSoftmax")
    return [torch.log_softmax(x, dim=normalize_axis(int(attrs.get("axis", -1)), x.dim(), "LogSoftmax"))]
