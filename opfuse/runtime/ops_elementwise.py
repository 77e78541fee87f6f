"""Per-op torch kernels of the ONNX elementwise ops: math, activations, comparisons, logic, casts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from opfuse.errors import ModelError
from opfuse.runtime.ops_registry import onnx_torch_dtype, optional, register, required

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]


def _unary(op_type: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    def impl(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
        return [fn(required(inputs, 0, op_type))]

    register(op_type)(impl)


def _binary(op_type: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    def impl(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
        return [fn(required(inputs, 0, op_type), required(inputs, 1, op_type))]

    register(op_type)(impl)


def _variadic(op_type: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    def impl(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
        xs = [x for x in inputs if x is not None]
        if not xs:
            raise ModelError(f"{op_type} needs at least one input")
        return [functools.reduce(fn, xs)]

    register(op_type)(impl)


for _op, _fn in {
    "Relu": torch.relu,
    "Sigmoid": torch.sigmoid,
    "Tanh": torch.tanh,
    "Erf": torch.erf,
    "Sqrt": torch.sqrt,
    "Exp": torch.exp,
    "Log": torch.log,
    "Neg": torch.neg,
    "Abs": torch.abs,
    "Reciprocal": torch.reciprocal,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Round": torch.round,  # half to even, as ONNX asks
    "Sign": torch.sign,
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Softsign": F.softsign,
    "Not": torch.logical_not,
    "IsNaN": torch.isnan,
}.items():
    _unary(_op, _fn)

for _op, _fn in {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Equal": torch.eq,
    "Less": torch.lt,
    "LessOrEqual": torch.le,
    "Greater": torch.gt,
    "GreaterOrEqual": torch.ge,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
}.items():
    _binary(_op, _fn)

for _op, _fn in {
    "Max": torch.maximum,
    "Min": torch.minimum,
    "Sum": torch.add,
}.items():
    _variadic(_op, _fn)


def _nonzero_divisor(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b with zeros replaced by ones, where b was zero), for integer division.

    Integer division by zero is undefined in ONNX (onnxruntime's C++ traps) and raises in torch on
    the CPU; opfuse gives 0 there instead, so that random inputs at compile time cannot crash it.
    """
    zero = b == 0
    return torch.where(zero, torch.ones_like(b), b), zero


@register("Div")
def div(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    a, b = required(inputs, 0, "Div"), required(inputs, 1, "Div")
    if a.dtype.is_floating_point:
        return [torch.div(a, b)]
    # ONNX leaves integer division to the backend; onnxruntime does C++ `/`, which truncates
    # toward zero (-7 / 2 == -3), where torch's floor division would give -4.
    b, zero = _nonzero_divisor(b)
    q = torch.div(a, b, rounding_mode="trunc")
    return [torch.where(zero, torch.zeros_like(q), q)]


@register("Mod")
def mod(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    a, b = required(inputs, 0, "Mod"), required(inputs, 1, "Mod")
    fmod = attrs.get("fmod", 0) == 1
    if not a.dtype.is_floating_point:
        b, zero = _nonzero_divisor(b)
        # fmod=1 takes the sign of the dividend, like C fmod; fmod=0 that of the divisor, like Python %.
        r = torch.fmod(a, b) if fmod else torch.remainder(a, b)
        return [torch.where(zero, torch.zeros_like(r), r)]
    if fmod:
        return [torch.fmod(a, b)]
    # fmod=0 on floats (defined from opset 28; before, only for integers): A - floor(A / B) * B, where
    # a finite dividend over an infinite divisor gives the dividend if their signs agree, else the
    # divisor (torch's formula would give NaN).
    r = torch.remainder(a, b)
    finite_over_inf = torch.isinf(b) & torch.isfinite(a) & (a != 0)
    return [torch.where(finite_over_inf, torch.where((a > 0) == (b > 0), a, b), r)]


@register("Pow")
def pow_(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    base, exponent = required(inputs, 0, "Pow"), required(inputs, 1, "Pow")
    y = torch.pow(base, exponent)
    # ONNX types the result like the base; torch promotes (int ** float is float). onnxruntime
    # computes in the wider type and truncates back (2 ** 0.5 -> 1), which `.to` also does.
    return [y if y.dtype == base.dtype else y.to(base.dtype)]


@register("Mean")
def mean(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    xs = [x for x in inputs if x is not None]
    if not xs:
        raise ModelError("Mean needs at least one input")
    return [functools.reduce(torch.add, xs) / len(xs)]


@register("Clip")
def clip(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Clip")
    lo, hi = optional(inputs, 1), optional(inputs, 2)
    if lo is None and hi is None:
        return [x]
    # torch.clamp follows ONNX when min > max: every element becomes max.
    return [torch.clamp(x, lo, hi)]


@register("Where")
def where(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [
        torch.where(required(inputs, 0, "Where"), required(inputs, 1, "Where"), required(inputs, 2, "Where"))
    ]


@register("LeakyRelu")
def leaky_relu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [F.leaky_relu(required(inputs, 0, "LeakyRelu"), float(attrs.get("alpha", 0.01)))]


@register("PRelu")
def prelu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, slope = required(inputs, 0, "PRelu"), required(inputs, 1, "PRelu")
    # ONNX broadcasts the slope numpy-style; F.prelu wants it per channel, so spell it out.
    return [torch.where(x < 0, x * slope, x)]


@register("Elu")
def elu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [F.elu(required(inputs, 0, "Elu"), float(attrs.get("alpha", 1.0)))]


@register("Selu")
def selu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Selu")
    alpha = float(attrs.get("alpha", 1.67326319217681884765625))
    gamma = float(attrs.get("gamma", 1.05070102214813232421875))
    return [gamma * torch.where(x > 0, x, alpha * torch.expm1(x))]


@register("HardSigmoid")
def hard_sigmoid(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "HardSigmoid")
    alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
    return [torch.clamp(x * alpha + beta, 0.0, 1.0)]


@register("HardSwish")
def hard_swish(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [F.hardswish(required(inputs, 0, "HardSwish"))]


@register("Gelu")
def gelu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    approximate = attrs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ModelError(f"Gelu: approximate={approximate!r} is not one of 'none', 'tanh'")
    return [F.gelu(required(inputs, 0, "Gelu"), approximate=approximate)]


@register("Softplus")
def softplus(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    # F.softplus switches to the identity above its threshold (20), where log1p(exp(x)) == x in
    # float32 anyway.
    return [F.softplus(required(inputs, 0, "Softplus"))]


@register("Cast")
def cast(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Cast")
    if "to" not in attrs:
        raise ModelError("Cast: the 'to' attribute is missing")
    dtype = onnx_torch_dtype(int(attrs["to"]))
    # Float -> int truncates toward zero in both torch and onnxruntime; out-of-range values are
    # undefined in both.
    return [x if x.dtype == dtype else x.to(dtype)]


@register("Celu")
def celu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [F.celu(required(inputs, 0, "Celu"), float(attrs.get("alpha", 1.0)))]


@register("Mish")
def mish(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    return [F.mish(required(inputs, 0, "Mish"))]


@register("ThresholdedRelu")
def thresholded_relu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "ThresholdedRelu")
    return [torch.where(x > float(attrs.get("alpha", 1.0)), x, torch.zeros_like(x))]


@register("Shrink")
def shrink(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Shrink")
    bias, lambd = float(attrs.get("bias", 0.0)), float(attrs.get("lambd", 0.5))
    # Spelled out (not F.softshrink): ONNX has a separate bias, and integer inputs are allowed.
    y = torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, torch.zeros_like(x)))
    return [y.to(x.dtype)]


@register("Swish")
def swish(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "Swish")
    alpha = float(attrs.get("alpha", 1.0))
    return [x * torch.sigmoid(x if alpha == 1.0 else alpha * x)]


@register("SwiGLU")
def swiglu(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    gate, value = required(inputs, 0, "SwiGLU"), required(inputs, 1, "SwiGLU")
    alpha = float(attrs.get("alpha", 1.0))
    return [gate * torch.sigmoid(gate if alpha == 1.0 else alpha * gate) * value]


@register("CastLike")
def cast_like(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, like = required(inputs, 0, "CastLike"), required(inputs, 1, "CastLike")
    return [x if x.dtype == like.dtype else x.to(like.dtype)]
