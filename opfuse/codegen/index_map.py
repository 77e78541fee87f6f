"""Loads through an IndexMap (ir/index_map.py): an element's coordinates walked back through
Transposes, Expands, Reshapes, Slices, constant Pads and Gathers to the buffer behind them; a Pad's
border lanes are masked and take its value, a Gather's coordinate is loaded from its index table."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from opfuse.codegen.source import float_literal
from opfuse.ir.index_map import IndexMap


def _split(flat: str, shape: tuple[int, ...]) -> list[str]:
    """The coordinates of a row-major flat index into `shape` (dims of size 1: 0)."""
    out: list[str] = []
    for d, size in enumerate(shape):
        inner = math.prod(shape[d + 1 :])
        if size == 1:
            out.append("0")
            continue
        coord = f"({flat} // {inner})" if inner > 1 else flat
        out.append(f"({coord} % {size})" if d > 0 else coord)
    return out


def _join(coords: list[str], shape: tuple[int, ...]) -> str:
    """The row-major flat index of `coords` in `shape`."""
    terms: list[str] = []
    inner = 1
    for c, size in zip(reversed(coords), reversed(shape), strict=True):
        if size != 1 and c != "0":
            terms.append(f"{c} * {inner}" if inner != 1 else c)
        inner *= size
    return " + ".join(reversed(terms)) or "0"


def table_args(tensor_inputs: list[str], views: Mapping[str, Any]) -> dict[str, str]:
    """The index tables the Gathers of the kernel's IndexMap views read, each with its argument
    name (`tab0`, ...): kernel inputs after the tensors, in the order the views name them."""
    tables = (t for x in tensor_inputs if isinstance(views.get(x), IndexMap) for t in views[x].tables())
    return {t: f"tab{j}" for j, t in enumerate(dict.fromkeys(tables))}


def index_map_load(
    prefix: str,
    ptr: str,
    im: IndexMap,
    lines: list[str],
    at: str = "offs",
    mask: str = "mask",
    tables: Mapping[str, str] | None = None,
) -> str:
    """Append to `lines` the loads of `im` at the kernel's flat offsets `at` (row-major in
    `im.shape`) on the lanes of `mask`; return the loaded value's expression (float32). `tables`:
    the pointer of each index table its Gathers read, by the table's name."""
    idx, held, borders = index_map_offset(prefix, im, lines, at, mask, tables)
    value = f"tl.load({ptr} + {idx}, mask={held}, other=0.0).to(tl.float32)"
    return with_borders(value, borders)


def with_borders(value: str, borders: list[tuple[str, float]]) -> str:
    """`value` where each Pad's border takes the Pad's value (`borders` as index_map_offset gives
    them, outermost first)."""
    for ok, fill in reversed(borders):  # innermost first: an outer border overrides
        if fill != 0.0:
            value = f"tl.where({ok}, {value}, {float_literal(fill)})"
    return value


def index_map_offset(
    prefix: str,
    im: IndexMap,
    lines: list[str],
    at: str,
    mask: str,
    tables: Mapping[str, str] | None = None,
) -> tuple[str, str, list[tuple[str, float]]]:
    """Append to `lines` the walk of the kernel's flat offsets `at` (row-major in `im.shape`) back
    to `im.base`; return the offset in the base, the lanes to load (`mask` and inside every Pad),
    and each Pad's inside mask with its value, outermost first (0 where a lane is in its border,
    loaded as masked off). The Gathers' table loads hold to `mask`."""
    lines.append(f"{prefix}_f0 = {at}")
    coords = _split(f"{prefix}_f0", im.shape)
    inside: list[str] = []
    borders: list[tuple[str, float]] = []  # (a Pad's inside mask, its value), outermost first
    for i, step in enumerate(im.steps):
        if step.op == "transpose":
            back = ["0"] * len(coords)
            for out_axis, in_axis in enumerate(step.perm):
                back[in_axis] = coords[out_axis]
            coords = back
        elif step.op == "expand":
            lead = len(step.out_shape) - len(step.in_shape)
            coords = ["0" if size == 1 else c for c, size in zip(coords[lead:], step.in_shape, strict=True)]
        elif step.op == "reshape":
            if tuple(step.in_shape) != tuple(step.out_shape):
                lines.append(f"{prefix}_f{i + 1} = {_join(coords, step.out_shape)}")
                coords = _split(f"{prefix}_f{i + 1}", step.in_shape)
        elif step.op == "slice":
            coords = [
                c if (s == 0 and k == 1) else (f"({c} * {k} + {s})" if k != 1 else f"({c} + {s})")
                for c, s, k in zip(coords, step.starts, step.steps, strict=True)
            ]
        elif step.op == "pad":
            here: list[str] = []
            new: list[str] = []
            for d, (c, b) in enumerate(zip(coords, step.begins, strict=True)):
                size = step.in_shape[d]
                padded = b != 0 or size != step.out_shape[d]
                if not padded:
                    new.append(c)
                    continue
                name = f"{prefix}_p{i}_{d}"
                lines.append(f"{name} = {c} - {b}" if b else f"{name} = {c}")
                here.append(f"({name} >= 0) & ({name} < {size})")
                new.append(name)
            coords = new
            if here:
                lines.append(f"{prefix}_in{i} = {' & '.join(here)}")
                inside.append(f"{prefix}_in{i}")
                borders.append((f"{prefix}_in{i}", step.value))
        elif step.op == "gather":
            # Clamped into the axis: the table is the model's constant, but tuning runs the
            # kernel on random inputs, and a coordinate past the axis would read outside the buffer.
            k = len(step.index_shape)
            pos = _join(coords[step.axis : step.axis + k], step.index_shape)
            name = f"{prefix}_g{i}"
            held = " & ".join([mask, *inside])  # not in a Pad's border nearer the kernel
            lines.append(f"{name} = tl.load({(tables or {})[step.table]} + {pos}, mask={held}, other=0)")
            lines.append(f"{name} = tl.minimum(tl.maximum({name}, 0), {step.in_shape[step.axis] - 1})")
            coords = [*coords[: step.axis], name, *coords[step.axis + k :]]
        else:  # pragma: no cover - the planner makes only the steps above
            raise AssertionError(step.op)
    return _join(coords, im.base_shape), " & ".join([mask, *inside]), borders
