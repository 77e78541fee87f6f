"""A Resize read as gather loads: fusion/resize.py describes it, codegen/resize.py writes it."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("nearest", "linear", "cubic")


COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners")


NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


@dataclass
class ResizeAxis:
    """How one output axis of the resized value maps to its input."""

    in_size: int
    out_size: int  # the resized length (before any Slice), as the coordinate transform uses it
    scale: float  # float32 scale (sizes given: out/in in float32, as onnxruntime computes it)
    start: int = 0  # a Slice's start on the resized value: kernel coordinate + start

    def identity(self, coordinate_mode: str) -> bool:
        if coordinate_mode == "align_corners":
            return self.in_size == self.out_size
        return self.scale == 1.0 and self.in_size == self.out_size


@dataclass
class ResizeGather:
    """A kernel input that is a 4-D Resize over H and W (of `base`, read at `strides` from
    `offset`), sliced by unit-step Slices (each axis' `start`) and permuted by Transposes
    (`order`)."""

    base: str  # the buffer read (the Resize's input, or the buffer behind its layout ops)
    strides: tuple[int, ...]  # of the Resize's input [N, C, H, W] in `base`
    offset: int
    shape: tuple[int, ...]  # the value the kernel reads (after the Slices)
    axes: tuple[ResizeAxis, ...]  # N, C, H, W (N and C unresized)
    mode: str  # one of MODES
    coordinate_mode: str  # one of COORDINATE_MODES
    nearest_mode: str  # one of NEAREST_MODES
    # For each axis of the resized value (N, C, H, W), the axis of `shape` that holds it: the
    # identity, or a permutation where Transposes sit between the Resize and the kernel (a
    # Resize run in NCHW, its output transposed back into the channels-last region).
    order: tuple[int, ...] = (0, 1, 2, 3)
    cubic_a: float = -0.75  # the cubic filter's `cubic_coeff_a` (mode cubic)

    def extent(self) -> int:
        """One past the farthest element of `base` the gather may read."""
        return (
            self.offset + sum((a.in_size - 1) * st for a, st in zip(self.axes, self.strides, strict=True)) + 1
        )
