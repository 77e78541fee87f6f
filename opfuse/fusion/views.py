"""Layout ops as index arithmetic: a value reached through Reshape/Transpose (and scalar scales)
is read straight from the buffer behind them with strides, so no copy is made."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from opfuse.codegen.pointwise import scalar_constant
from opfuse.graph import Graph, Node


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape)))


@dataclass
class StridedView:
    base: str  # the materialized buffer (contiguous) that is actually read
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    scale: float = 1.0  # product of scalar Mul/Div folded on the way
    nodes: list[Node] = field(default_factory=list)  # the layout/scale nodes this view replaces


def _single_use(graph: Graph, name: str) -> bool:
    return len(graph.consumers().get(name, [])) == 1 and name not in {o.name for o in graph.outputs}


def input_view(graph: Graph, value: str, allow_scale: bool = True) -> StridedView:
    """Walk back from `value` through Transpose, one Reshape of a contiguous buffer, and scalar
    Mul/Div; each step folds only when its output feeds nothing else."""
    producers = graph.producers()
    perms: list[list[int]] = []
    scale = 1.0
    nodes: list[Node] = []
    cur = value
    reshape_shape: tuple[int, ...] | None = None
    while True:
        p = producers.get(cur)
        if p is None or (cur != value and not _single_use(graph, cur)):
            break
        if p.op_type == "Transpose":
            perms.append([int(x) for x in p.attrs.get("perm", list(range(len(graph.spec(cur).shape))[::-1]))])
        elif not allow_scale and p.op_type in ("Mul", "Div"):
            break
        elif p.op_type in ("Mul", "Div") and scalar_constant(graph, p.inputs[1]) is not None:
            c = scalar_constant(graph, p.inputs[1])
            assert c is not None
            if p.op_type == "Div" and c == 0.0:
                break
            scale *= c if p.op_type == "Mul" else 1.0 / c
        elif p.op_type in ("Mul",) and scalar_constant(graph, p.inputs[0]) is not None:
            c0 = scalar_constant(graph, p.inputs[0])
            assert c0 is not None
            scale *= c0
            nodes.append(p)
            cur = p.inputs[1]
            continue
        elif p.op_type == "Reshape" and graph.spec(p.inputs[0]).shape == graph.spec(cur).shape:
            pass  # a reshape to the same shape is a no-op
        elif p.op_type == "Reshape" and reshape_shape is None:
            reshape_shape = graph.spec(cur).shape
            nodes.append(p)
            cur = p.inputs[0]
            break  # a reshape of a contiguous buffer: the buffer itself is the base
        else:
            break
        nodes.append(p)
        cur = p.inputs[0]
    shape = reshape_shape if reshape_shape is not None else graph.spec(cur).shape
    strides = contiguous_strides(shape)
    # Apply the transposes from the base outward (they were collected walking inward).
    for perm in reversed(perms):
        shape = tuple(shape[i] for i in perm)
        strides = tuple(strides[i] for i in perm)
    return StridedView(cur, shape, strides, scale, nodes)


def output_view(graph: Graph, value: str) -> StridedView:
    """Where `value` can be written directly: through a following Transpose and Reshape that
    only reorder it, into the buffer at the end of that chain."""
    consumers = graph.consumers()
    shape = graph.spec(value).shape
    nodes: list[Node] = []
    cur = value
    perm: list[int] | None = None
    while (
        _single_use(graph, cur)
        and consumers[cur][0].op_type == "Reshape"
        and graph.spec(consumers[cur][0].outputs[0]).shape == shape
    ):  # reshapes to the same shape are no-ops
        nodes.append(consumers[cur][0])
        cur = consumers[cur][0].outputs[0]
    if _single_use(graph, cur) and consumers[cur][0].op_type == "Transpose":
        t = consumers[cur][0]
        perm = [int(x) for x in t.attrs.get("perm", list(range(len(shape)))[::-1])]
        nodes.append(t)
        cur = t.outputs[0]
        if _single_use(graph, cur) and consumers[cur][0].op_type == "Reshape":
            nodes.append(consumers[cur][0])
            final = consumers[cur][0].outputs[0]
        else:
            final = cur
        t_strides = contiguous_strides(graph.spec(cur).shape)  # Transpose output, laid out as `final`
        strides = [0] * len(shape)
        for i, p in enumerate(perm):
            strides[p] = t_strides[i]
        return StridedView(final, shape, tuple(strides), 1.0, nodes)
    return StridedView(value, shape, contiguous_strides(shape), 1.0, nodes)
