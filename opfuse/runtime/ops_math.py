"""Per-op torch kernels of the ONNX math ops beyond arithmetic: trigonometric and hyperbolic
functions, infinity tests, bitwise operations on integers, and the signal windows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opfuse.errors import ModelError
from opfuse.runtime.ops_registry import normalize_axis, onnx_torch_dtype, register, required, target_device

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]


def _unary(op_type: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    def impl(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
        return [fn(required(inputs, 0, op_type))]

    register(op_type)(impl)


for _op, _fn in {
    "Tan": torch.tan,
    "Acos": torch.acos,
    "Asin": torch.asin,
    "Atan": torch.atan,
    "Sinh": torch.sinh,
    "Cosh": torch.cosh,
    "Asinh": torch.asinh,
    "Acosh": torch.acosh,
    "Atanh": torch.atanh,
    "BitwiseNot": torch.bitwise_not,
}.items():
    _unary(_op, _fn)


def _binary(op_type: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    def impl(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
        return [fn(required(inputs, 0, op_type), required(inputs, 1, op_type))]

    register(op_type)(impl)


for _op, _bfn in {
    "BitwiseAnd": torch.bitwise_and,
    "BitwiseOr": torch.bitwise_or,
    "BitwiseXor": torch.bitwise_xor,
}.items():
    _binary(_op, _bfn)


@register("IsInf")
def is_inf(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "IsInf")
    negative, positive = attrs.get("detect_negative", 1) == 1, attrs.get("detect_positive", 1) == 1
    if negative and positive:
        return [torch.isinf(x)]
    if negative:
        return [torch.isneginf(x)]
    if positive:
        return [torch.isposinf(x)]
    return [torch.zeros_like(x, dtype=torch.bool)]


_BITS = {torch.uint8: 8, torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


@register("BitShift")
def bit_shift(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, shift = required(inputs, 0, "BitShift"), required(inputs, 1, "BitShift")
    direction = attrs.get("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise ModelError(f"BitShift: direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    if x.dtype not in _BITS:
        raise ModelError(f"BitShift: integer inputs only, got {x.dtype}")
    x, shift = torch.broadcast_tensors(x, shift.to(x.dtype))
    # Shifting by the width or more (or a negative amount) is undefined in C and in torch; ONNX
    # defines it: everything shifted out (0), or the sign bit everywhere for a right shift.
    out_of_range = (shift < 0) | (shift >= _BITS[x.dtype])
    safe = torch.where(out_of_range, torch.zeros_like(shift), shift)
    if direction == "LEFT":
        y = torch.bitwise_left_shift(x, safe)
        return [torch.where(out_of_range, torch.zeros_like(y), y)]
    y = torch.bitwise_right_shift(x, safe)  # arithmetic for signed types, as ONNX asks
    fill = torch.where(x < 0, torch.full_like(x, -1), torch.zeros_like(x)) if x.dtype.is_signed else 0 * x
    return [torch.where(out_of_range, fill, y)]


# Generalized cosine windows: w[n] = a0 - a1 cos(2 pi n / N) + a2 cos(4 pi n / N), as the ONNX
# function bodies write them (float32 arithmetic, in this order).
_WINDOWS = {
    "HannWindow": (0.5, 0.5, 0.0),
    "HammingWindow": (0.54347825, 0.45652175, 0.0),
    "BlackmanWindow": (0.42, 0.5, 0.08),
}


def _window(op_type: str) -> None:
    a0, a1, a2 = (torch.tensor(a, dtype=torch.float32) for a in _WINDOWS[op_type])

    def impl(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
        size = int(required(inputs, 0, op_type).reshape(-1)[0].item())
        periodic = attrs.get("periodic", 1) == 1
        n = torch.arange(size, dtype=torch.float32, device=target_device(attrs))
        angle = n * (torch.tensor(6.2831855, dtype=torch.float32) / float(size if periodic else size - 1))
        w = a0 - a1 * torch.cos(angle) + a2 * torch.cos(angle * 2.0)
        return [w.to(onnx_torch_dtype(int(attrs.get("output_datatype", 1))))]

    register(op_type, host_inputs=(0,), wants_device=True)(impl)


for _name in _WINDOWS:
    _window(_name)


def _in_half(x: torch.Tensor, lengths: list[int]) -> bool:
    """Whether a transform of `x` over axes of these lengths runs in half precision: a float16
    signal on a GPU whose every transformed length is a power of two (the only lengths cuFFT's
    half-precision plans take), as PyTorch runs `torch.fft` on such a tensor. Others widen to
    float32, a cast kernel each side of the transform (FNet's 16 x 64 token mixing on an H100:
    10.0 us a transform widened, 7.3 us in half precision)."""
    pow2 = all(n > 0 and n & (n - 1) == 0 for n in lengths)
    return x.dtype == torch.float16 and x.device.type == "cuda" and pow2


def _signal(x: torch.Tensor, half: bool = False) -> torch.Tensor:
    """A DFT's [..., 1] real or [..., 2] complex signal as a float32 (float64) tensor, or as it is
    where the transform runs in half precision (`half`): the pairs read in place as complex
    values (view_as_complex), a real signal as its one part."""
    if half:
        xs = x.contiguous()
    else:
        xs = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).contiguous()
    return torch.view_as_complex(xs) if x.shape[-1] == 2 else xs[..., 0]


def _transform(
    x: torch.Tensor, lengths: list[int], library: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`library` (the transform) of `x`'s signal: in half precision where _in_half says so, else
    widened; the result as [..., 2] pairs (a complex output) or as it is, in x's type."""
    out = None
    if _in_half(x, lengths):
        try:
            out = library(_signal(x, half=True))
        except RuntimeError:  # complex half is new to the library: where it refuses, widen
            pass
    if out is None:
        out = library(_signal(x))
    return (torch.view_as_real(out) if out.is_complex() else out).to(x.dtype)


@register("DFT", host_inputs=(1, 2))
def dft(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    """DFT-17 (`axis` an attribute, default 1) and DFT-20 (`axis` the third input; the frontend
    writes its default, -2, out: opsets.explicit_dft_axis). The signal's last axis holds the real
    part, or the real and imaginary parts. The transform runs in float32 (float64 for a float64
    signal): a half-precision signal is widened, as every reduction here accumulates in float32,
    except where the library transforms it as it is (_in_half: float16 on a GPU, a power-of-two
    length), as PyTorch does. The complex values are read and written in place of the [..., 2]
    pairs (view_as_complex, view_as_real), so a transform is its FFT, and a cast each side where
    it is widened, whatever the axis. The output is [..., 2], or [..., 1] for an inverse
    one-sided transform (a real signal)."""
    x = required(inputs, 0, "DFT")
    length, axis_in = (inputs[i] if i < len(inputs) else None for i in (1, 2))
    axis = int(axis_in.reshape(-1)[0]) if axis_in is not None else int(attrs.get("axis", 1))
    axis = normalize_axis(axis, x.dim(), "DFT")
    if axis == x.dim() - 1 or x.shape[-1] not in (1, 2):
        raise ModelError(
            f"DFT: the input's last axis must hold the real (1) or real and imaginary (2) parts and "
            f"the transform run along another axis; got shape {list(x.shape)} and axis {axis}"
        )
    inverse, onesided = bool(int(attrs.get("inverse", 0))), bool(int(attrs.get("onesided", 0)))
    if length is not None:
        n = int(length.reshape(-1)[0])
    else:
        n = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    if n < 1:
        raise ModelError(f"DFT: dft_length {n} is not positive")

    def library(signal: torch.Tensor) -> torch.Tensor:
        if inverse and onesided:
            return torch.fft.irfft(signal, n=n, dim=axis).unsqueeze(-1)
        if onesided and not signal.is_complex():
            return torch.fft.rfft(signal, n=n, dim=axis)
        out = torch.fft.ifft(signal, n=n, dim=axis) if inverse else torch.fft.fft(signal, n=n, dim=axis)
        return out.narrow(axis, 0, n // 2 + 1) if onesided else out

    return [_transform(x, [n], library)]


@register("opfuse.DFTN")
def dft_n(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    """A full transform over each of `axes` at once (passes/dft.py: a chain of DFTs, one per axis),
    of a real ([..., 1]) or complex ([..., 2]) signal, widened or in half precision as DFT runs
    it: one library call."""
    x = required(inputs, 0, "DFTN")
    axes = [normalize_axis(int(a), x.dim(), "DFTN") for a in attrs["axes"]]
    transform = torch.fft.ifftn if int(attrs.get("inverse", 0)) else torch.fft.fftn
    return [_transform(x, [x.shape[a] for a in axes], lambda signal: transform(signal, dim=axes))]
