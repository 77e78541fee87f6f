"""A Resize read by a pointwise kernel as gather loads at computed coordinates.

The kernel iterates over the resized value (possibly sliced, or transposed: then `order` says
which of its axes holds each resized axis); for each element it maps the output coordinate on
each resized axis back to the input as the ONNX Resize operator does, in float32 as onnxruntime
computes it (an IEEE division by the float32 scale, so the nearest pixel it picks is the one
onnxruntime picks), and loads the input there: one load for `nearest`, one per tap and their
blend for `linear` (four taps for a bilinear resize) and `cubic` (sixteen for a bicubic one).
The resized tensor is never written.
"""

from __future__ import annotations

import numpy as np

from opfuse.codegen.source import float_literal
from opfuse.ir.resize import ResizeAxis, ResizeGather


def _source_coordinate(x: str, axis: ResizeAxis, coordinate_mode: str) -> str:
    """The float32 input coordinate of output coordinate `x` (a float32 expression), as
    onnxruntime's coordinate transforms compute it, operation by operation."""
    scale = float_literal(axis.scale)
    if coordinate_mode == "asymmetric":
        return f"tl.div_rn({x}, {scale})"
    if coordinate_mode == "align_corners":
        if axis.out_size == 1:
            return f"({x} * 0.0)"
        return f"tl.div_rn({x} * {float(axis.in_size - 1)}, {float(axis.out_size - 1)})"
    if coordinate_mode == "pytorch_half_pixel" and axis.out_size == 1:
        return f"({x} * 0.0)"  # one output pixel maps to the input's first
    # half_pixel (also with one output pixel: the centre of the input), pytorch_half_pixel
    return f"(tl.div_rn({x} + 0.5, {scale}) - 0.5)"


def _nearest_index(src: str, nearest_mode: str) -> str:
    if nearest_mode == "floor":
        return f"tl.floor({src})"
    if nearest_mode == "ceil":
        return f"tl.ceil({src})"
    if nearest_mode == "round_prefer_ceil":  # round half away from zero (negatives clamp to 0)
        return f"tl.floor({src} + 0.5)"
    # round_prefer_floor: halves go down, the rest to the nearest
    return f"tl.where({src} - tl.floor({src}) == 0.5, tl.floor({src}), tl.floor({src} + 0.5))"


def _cubic_taps(
    var: str, src: str, last: int, stride: int, a: float, index_type: str, lines: list[str]
) -> list[tuple[str, str | None]]:
    """The four taps of a cubic resize along one axis, as onnxruntime takes them: the source
    coordinate unclamped, the pixels floor(x) - 1 .. floor(x) + 2 (clamped to the input: edge
    pixels repeat) weighed by Keys' cubic convolution with coefficient `a` at the distance t =
    x - floor(x)."""
    A = float_literal(a)
    lines.append(f"{var}s = {src}")
    lines.append(f"{var}f = tl.floor({var}s)")
    lines.append(f"{var}t = {var}s - {var}f")
    lines.append(f"{var}b = {var}f.to({index_type})")
    # Keys' kernel: |d| <= 1: (a + 2)|d|^3 - (a + 3)|d|^2 + 1; 1 < |d| < 2: a|d|^3 - 5a|d|^2 + 8a|d| - 4a.
    distances = [f"({var}t + 1.0)", f"{var}t", f"(1.0 - {var}t)", f"(2.0 - {var}t)"]
    out: list[tuple[str, str | None]] = []
    for k, d in enumerate(distances):
        w = f"{var}w{k}"
        if k in (1, 2):
            lines.append(f"{w} = (({A} + 2.0) * {d} - ({A} + 3.0)) * {d} * {d} + 1.0")
        else:
            lines.append(f"{w} = (({A} * {d} - 5.0 * {A}) * {d} + 8.0 * {A}) * {d} - 4.0 * {A}")
        index = f"tl.minimum(tl.maximum({var}b + {k - 1}, 0), {last})"
        out.append((f"{index} * {stride}" if stride != 1 else index, w))
    return out


def resize_load(
    name: str,
    pointer: str,
    gather: ResizeGather,
    lines: list[str],
    index_type: str,
    offs: str = "offs",
    mask: str = "mask",
) -> str:
    """Append to `lines` the statements that load the resized value for every `offs` (registers
    named after `name`) and return the expression of the value in float32. `index_type`: the
    integer type of the addresses (tl.int64 where an input or the output has 2**31 elements).
    `offs` and `mask`: the offsets into the resized value and the lanes that load (a Concat's
    input: its own offsets, and the lanes its range holds)."""
    shape = gather.shape
    out_strides = [int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape))]
    taps: list[list[tuple[str, str | None]]] = []  # per axis: (index, weight or None)
    fixed: list[str] = []
    for d, axis in enumerate(gather.axes):
        j = gather.order[d]  # the axis of the value read that holds resized axis d
        coord = (
            f"(({offs} // {out_strides[j]}) % {shape[j]})" if out_strides[j] > 1 else f"({offs} % {shape[j]})"
        )
        if axis.start:
            coord = f"({coord} + {axis.start})"
        stride = gather.strides[d]
        if d < 2 or axis.identity(gather.coordinate_mode):
            if axis.in_size > 1 and stride:
                coord = coord if index_type == "tl.int32" else f"{coord}.to({index_type})"
                fixed.append(f"{coord} * {stride}" if stride != 1 else coord)
            continue
        var = f"{name}_{'nchw'[d]}"
        lines.append(f"{var} = {coord}.to(tl.float32)")
        src = _source_coordinate(var, axis, gather.coordinate_mode)
        last = axis.in_size - 1
        if gather.mode == "nearest":
            idx = f"{var}i"
            pick = _nearest_index(f"{var}s", gather.nearest_mode)
            lines.append(f"{var}s = {src}")
            lines.append(f"{idx} = tl.minimum(tl.maximum({pick}, 0.0), {float(last)}).to({index_type})")
            taps.append([(f"{idx} * {stride}", None)])
            continue
        if gather.mode == "cubic":
            taps.append(_cubic_taps(var, src, last, stride, gather.cubic_a, index_type, lines))
            continue
        # linear: the coordinate clamped to the input, its two neighbours (the same pixel at the
        # last one) and their distances, which weigh the other neighbour; 0.5 each on one pixel.
        lines.append(f"{var}s = tl.minimum(tl.maximum({src}, 0.0), {float(last)})")
        lines.append(f"{var}0 = {var}s.to({index_type})")
        lines.append(f"{var}1 = tl.minimum({var}0 + 1, {last})")
        lines.append(f"{var}d0 = tl.where({var}0 == {var}1, 0.5, tl.abs({var}s - {var}0.to(tl.float32)))")
        lines.append(f"{var}d1 = tl.where({var}0 == {var}1, 0.5, tl.abs({var}s - {var}1.to(tl.float32)))")
        # The tap at index 0 weighs the distance to index 1, and the other way round.
        taps.append([(f"{var}0 * {stride}", f"{var}d1"), (f"{var}1 * {stride}", f"{var}d0")])
    base = " + ".join(fixed) if fixed else "0"
    offset = f" + {gather.offset}" if gather.offset else ""
    lines.append(f"{name}_p = {pointer}{offset} + {base}")
    terms: list[str] = []
    grid: list[list[tuple[str, str | None]]] = [[]]
    for axis_taps in taps:
        grid = [[*g, t] for g in grid for t in axis_taps]
    for k, combo in enumerate(grid):
        address = "".join(f" + {i}" for i, _ in combo)
        lines.append(f"{name}_{k} = tl.load({name}_p{address}, mask={mask}, other=0.0).to(tl.float32)")
        weights = [w for _, w in combo if w is not None]
        terms.append(" * ".join([*weights, f"{name}_{k}"]))
    return terms[0] if len(terms) == 1 else "(" + " + ".join(terms) + ")"
