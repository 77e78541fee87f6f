"""Pointwise ops move above the views before them: `view(x) -> f` becomes `f(x) -> view`.

A view (Reshape, Flatten, Squeeze, Unsqueeze, Transpose) launches nothing, but it stands between
a producer and the pointwise ops after it, and the fusion rules grow an epilogue only through
consumers of the producer's own shape. Exports put views there all the time: LeViT's
`Linear -> flatten -> BatchNorm1d -> unflatten -> Hardswish`, attention's
`(P @ V) -> transpose -> reshape -> act`, a head's `flatten -> act`. Computed before the view, the
same ops are the producer's epilogue (or join its pointwise group), and the view moves after them.

The move is exact: a pointwise op computes each element from the elements at the same index, and
a view only renames indices. It is made where
- the op has one tensor input, the view's output, and no other reader of that view (else both
  forms would be computed);
- each of its other inputs is a constant that broadcasts the same way on both sides of the view:
  a scalar (any view), or for a Reshape-like view a constant whose non-1 dims are trailing dims
  the view keeps unchanged (per-channel constants of a Linear's output, which a flatten of the
  leading dims keeps: (C,) against [B, N, C] and [B*N, C] alike);
- the op's output has the view's output shape (a constant of higher rank would widen it);
- the view's output is not a graph output;
- at most one pointwise op reads the op's output: where several do (Funnel's query scale, read by
  three bias adds), they share one kernel with it after the view, and moved, the op would leave
  them a kernel each;
- the first node above the views takes pointwise ops into its kernel (a GEMM, a conv, a pool
  head, a row op, a pointwise op). Behind a library op the pointwise rule already reads through the view,
  beside the op's own consumers; moved, the op would part from them.
Moves repeat until none is left, so a chain of ops climbs a chain of views.
"""

from __future__ import annotations

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import CONV_OPS, NHWC_POOLS, ROW_OPS
from opfuse.ir.support import pointwise_reason
from opfuse.passes.rules import PassContext

RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
VIEWS = RESHAPES | {"Transpose"}
# Producers a pointwise op can join as their epilogue besides pointwise ops: the anchors
# (anchor_epilogue.py) and the row ops (row_reduction.py).
EPILOGUE_HEADS = frozenset({"MatMul", "Gemm", *NHWC_POOLS.values(), *CONV_OPS}) | ROW_OPS


def _joins_producer(graph: Graph, view: Node, producers: dict[str, Node], touched: set[str]) -> bool:
    """Whether the first node above the view (and any views above it) takes a pointwise op into
    its kernel. Where it does not (a library op, a graph input), the op stays after the view: the
    pointwise rule reads it through the view beside its own consumers, and moving it would only
    part it from them. False for this sweep where a node on the way moved in it: the maps are the
    sweep's, and the next sweep decides."""
    node: Node | None = view
    while node is not None and node.op_type in VIEWS:
        node = producers.get(node.inputs[0])
        if node is not None and node.id in touched:
            return False
    if node is None:
        return False
    return node.op_type in EPILOGUE_HEADS or pointwise_reason(graph, node) is None


def constant_like(
    graph: Graph, name: str, view: Node, before: tuple[int, ...], after: tuple[int, ...]
) -> np.ndarray | None:
    """The constant `name`, shaped to broadcast against the view's input (`before`) exactly as it
    does against its output (`after`); None where it cannot."""
    arr = graph.constants[name]
    if arr.size == 1:
        return arr.reshape(())
    if view.op_type not in RESHAPES:
        return None
    dims = list(arr.shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    k = len(dims)
    if (
        k > len(before)
        or k > len(after)
        or tuple(before[len(before) - k :]) != tuple(after[len(after) - k :])
    ):
        return None
    return arr.reshape(dims)


def _move(graph: Graph, node: Node, view: Node, consts: dict[str, np.ndarray]) -> None:
    src = view.inputs[0]
    early = f"{node.id}_before_{view.id}"
    out = graph.spec(node.outputs[0])
    graph.values[early] = TensorSpec(early, out.dtype, graph.spec(src).shape)
    inputs = []
    for x in node.inputs:
        if x == view.outputs[0]:
            inputs.append(src)
        elif x in consts:
            new = consts[x]
            if new.shape != graph.constants[x].shape:
                cname = f"{x}_as_{'x'.join(map(str, new.shape)) or 'scalar'}"
                x = graph.add_constant(cname, new, graph.spec(x).dtype)
            inputs.append(x)
        else:
            inputs.append(x)
    old = view.outputs[0]
    i, j = graph.nodes.index(view), graph.nodes.index(node)
    graph.nodes[i] = Node(node.id, node.op_type, inputs, [early], dict(node.attrs), node.name)
    graph.nodes[j] = Node(
        view.id, view.op_type, [early, *view.inputs[1:]], list(node.outputs), dict(view.attrs), view.name
    )
    graph.values.pop(old, None)


def pointwise_before_views(graph: Graph, ctx: PassContext) -> None:
    outputs = {o.name for o in graph.outputs}
    moved = 0
    while True:  # sweeps: each moves every op it can one view up, on the maps of its start
        producers, consumers = graph.producers(), graph.consumers()
        touched: set[str] = set()
        for node in list(graph.nodes):
            if node.id in touched or pointwise_reason(graph, node) is not None:
                continue
            tensors = [x for x in node.inputs if x and x not in graph.constants]
            if len(tensors) != 1:
                continue
            x = tensors[0]
            view = producers.get(x)
            if view is None or view.op_type not in VIEWS or view.id in touched or x in outputs:
                continue
            if len(consumers.get(x, [])) != 1 or view.inputs[0] in graph.constants:
                continue
            if not _joins_producer(graph, view, producers, touched):
                continue
            readers = consumers.get(node.outputs[0], [])
            if sum(1 for r in readers if pointwise_reason(graph, r) is None) > 1:
                continue
            before, after = graph.spec(view.inputs[0]).shape, graph.spec(x).shape
            if graph.spec(node.outputs[0]).shape != after:
                continue  # a constant of higher rank widens the output: not elementwise on x
            consts: dict[str, np.ndarray] = {}
            for c in {y for y in node.inputs if y and y in graph.constants}:
                arr = constant_like(graph, c, view, before, after)
                if arr is None:
                    break
                consts[c] = arr
            else:
                _move(graph, node, view, consts)
                touched |= {node.id, view.id}
        if not touched:
            break
        moved += len(touched) // 2
    if moved:
        ctx.log.fire(names.POINTWISE_BEFORE_VIEWS, moved)
