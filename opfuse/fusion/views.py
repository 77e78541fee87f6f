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
    offset: int = 0  # elements from the start of `base` (a Split output starts inside its input)


def _single_use(graph: Graph, name: str) -> bool:
    return len(graph.consumers().get(name, [])) == 1 and name not in {o.name for o in graph.outputs}


def _read_only_by(graph: Graph, name: str, readers: frozenset[str]) -> bool:
    """`name` has several readers, all of them nodes of the kernel (`readers`), and is no output."""
    if not readers or name in {o.name for o in graph.outputs}:
        return False
    return all(u.id in readers for u in graph.consumers().get(name, []))


def view_strides(
    shape: tuple[int, ...], strides: tuple[int, ...], new_shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """Strides of `new_shape` viewing the same elements as (shape, strides), or None when a
    reshape of that layout would need a copy (the rule torch.Tensor.view follows)."""
    if int(np.prod(shape, dtype=np.int64)) == 0 or not shape:
        return contiguous_strides(new_shape) if not shape else None
    out = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = strides[-1]
    tensor_numel = 1
    view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                out[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_base = strides[d - 1]
                tensor_numel = 1
                view_numel = 1
    if view_d != -1:
        return None
    return tuple(out)


def _split_offset(graph: Graph, split: Node, output: str) -> tuple[int, int] | None:
    """(axis, start) of one output of a Split with static sizes."""
    x = graph.spec(split.inputs[0]).shape
    axis = int(split.attrs.get("axis", 0)) % len(x)
    sizes = [graph.spec(o).shape[axis] for o in split.outputs]
    if output not in split.outputs:
        return None
    k = split.outputs.index(output)
    return axis, sum(sizes[:k])


def input_view(
    graph: Graph,
    value: str,
    allow_scale: bool = True,
    allow_split: bool = True,
    readers: frozenset[str] = frozenset(),
) -> StridedView:
    """Walk back from `value` through Transpose, Reshape, one Split and scalar Mul/Div (each
    folding only when its output feeds nothing else), then replay the chain forward as strides
    over the buffer at its start. Where a reshape of the layout would need a copy, that Reshape
    stays in the plan and the view starts from its output."""
    producers = graph.producers()
    walk: list[tuple[Node, str]] = []  # (node, its output on the path), nearest to `value` first
    cur = value
    while True:
        p = producers.get(cur)
        # Folding a producer removes its output: only a value read once (by the next hop, or by
        # the kernel itself) may go.
        if p is None or not (
            _single_use(graph, cur) or (cur == value and _read_only_by(graph, cur, readers))
        ):
            break
        if allow_split and p.op_type == "Split" and _split_offset(graph, p, cur) is not None:
            walk.append((p, cur))
            cur = p.inputs[0]
            break  # the Split's input is read by its other outputs too: it is the base
        scaled = p.op_type in ("Mul", "Div") and scalar_constant(graph, p.inputs[1]) not in (None, 0.0)
        if p.op_type not in ("Transpose", "Reshape") and not (allow_scale and scaled):
            break
        walk.append((p, cur))
        cur = p.inputs[0]
    forward = list(reversed(walk))
    base = cur
    while True:
        result = _replay(graph, base, forward)
        if isinstance(result, StridedView):
            return result
        # forward[result] cannot be a view: it runs as a copy, and the view starts after it.
        base = forward[result][1]
        forward = forward[result + 1 :]


def _replay(graph: Graph, base: str, forward: list[tuple[Node, str]]) -> StridedView | int:
    shape = graph.spec(base).shape
    strides = contiguous_strides(shape)
    offset = 0
    scale = 1.0
    for i, (node, out) in enumerate(forward):
        if node.op_type == "Split":
            where = _split_offset(graph, node, out)
            assert where is not None
            offset += where[1] * strides[where[0]]
            shape = graph.spec(out).shape
        elif node.op_type == "Transpose":
            perm = [int(x) for x in node.attrs.get("perm", list(range(len(shape)))[::-1])]
            shape = tuple(shape[k] for k in perm)
            strides = tuple(strides[k] for k in perm)
        elif node.op_type == "Reshape":
            new_shape = graph.spec(out).shape
            new_strides = view_strides(shape, strides, new_shape)
            if new_strides is None:
                return i
            shape, strides = new_shape, new_strides
        else:
            c = scalar_constant(graph, node.inputs[1])
            assert c is not None
            scale *= c if node.op_type == "Mul" else 1.0 / c
    return StridedView(base, shape, strides, scale, [n for n, _ in forward], offset)


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
