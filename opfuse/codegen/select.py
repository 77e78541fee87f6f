"""The Concat-select fragment (`concat_select`): a Concat inside a kernel, each output element
loaded from the input whose range along the axis holds it, the others' loads masked off. Used by
the pointwise and row templates."""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.codegen.fragments import broadcast_index, concat_parts
from opfuse.codegen.index_map import index_map_load
from opfuse.codegen.resize import resize_load
from opfuse.codegen.source import SourceBuffer
from opfuse.graph import Graph, Node
from opfuse.ir.index_map import IndexMap
from opfuse.ir.resize import ResizeGather


def emit_concat(
    buf: SourceBuffer,
    graph: Graph,
    node: Node,
    prefix: str,
    slot: dict[str, int],
    views: dict[str, Any],
    index_type: str,
    offs: str = "offs",
    mask: str = "mask",
    tables: dict[str, str] | None = None,
) -> None:
    """Concat: the output offset's position within its slab (the elements of one outer index,
    `length * inner` of them) picks the input whose range holds it; each input is loaded at its own
    offset (outer index * its slab + position - its start * inner), masked to the lanes it holds
    (through its layout view, resize gather or index map as any input is), and `prefix` is the
    selection. `offs` and `mask`: the flat offsets into the Concat's output the kernel computes,
    and the lanes that load (a row kernel's rows: `row * R + cols` and its column mask); `tables`:
    the index tables' arguments of the index maps' Gathers."""
    shape = tuple(graph.spec(node.outputs[0]).shape)
    axis, parts = concat_parts(graph, node)
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    slab = int(shape[axis]) * inner
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    pos = f"{prefix}_s"
    buf.line(f"{pos} = {offs} % {slab}" if outer > 1 else f"{pos} = {offs}")
    if outer > 1:
        buf.line(f"{prefix}_o = {offs} // {slab}")
    loaded: list[str] = []
    for k, (name, start, length) in enumerate(parts):
        i = slot[name]
        lo, hi = start * inner, (start + length) * inner
        local = f"{pos} - {lo}" if lo else pos
        buf.line(
            f"{prefix}_q{k} = {prefix}_o * {length * inner} + {local}"
            if outer > 1
            else f"{prefix}_q{k} = {local}"
        )
        held = [f"({pos} >= {lo})"] if lo else []
        held += [f"({pos} < {hi})"] if hi < slab else []
        buf.line(f"{prefix}_m{k} = {' & '.join([mask, *held])}")
        view = views.get(name)
        if isinstance(view, ResizeGather | IndexMap):
            lines: list[str] = []
            value = (
                resize_load(
                    f"{prefix}_r{k}", f"in{i}", view, lines, index_type, f"{prefix}_q{k}", f"{prefix}_m{k}"
                )
                if isinstance(view, ResizeGather)
                else index_map_load(
                    f"{prefix}_r{k}", f"in{i}", view, lines, f"{prefix}_q{k}", f"{prefix}_m{k}", tables
                )
            )
            for text in lines:
                buf.line(text)
            buf.line(f"{prefix}_{k} = {value}")
        else:
            in_shape = tuple(view.shape if view is not None else graph.spec(name).shape)
            strides = tuple(view.strides) if view is not None else None
            idx = broadcast_index(in_shape, in_shape, strides, f"{prefix}_q{k}") or "0"
            offset = f" + {view.offset}" if view is not None and view.offset else ""
            buf.line(
                f"{prefix}_{k} = tl.load(in{i} + {idx}{offset}, mask={prefix}_m{k}, other=0.0).to(tl.float32)"
            )
        loaded.append(f"{prefix}_{k}")
    # The last input holds what the others' ranges do not: select from the end backwards.
    expr = loaded[-1]
    for k in range(len(parts) - 2, -1, -1):
        expr = f"tl.where({pos} < {(parts[k][1] + parts[k][2]) * inner}, {loaded[k]}, {expr})"
    buf.line(f"{prefix} = {expr}  # Concat")
