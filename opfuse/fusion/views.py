"""Layout ops as index arithmetic: a value reached through Reshape/Transpose/Slice (and scalar
scales, and one Split) is read straight from the buffer behind them with strides, so no copy is
made."""

from __future__ import annotations

import itertools

import numpy as np

from opfuse.graph import Graph, Node
from opfuse.ir.queries import contiguous_strides, scalar_constant
from opfuse.ir.views import StridedView

# Ops that only give the same elements a new shape (Reshape's rule decides whether as a view).
RESHAPES = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})
# Every op a view can be read through.
VIEW_THROUGH = RESHAPES | {"Transpose", "Slice", "Split"}


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


def slice_steps(graph: Graph, node: Node) -> list[tuple[int, int, int]] | None:
    """[(axis, start, step)] of a Slice with constant starts, axes and positive steps, each start
    clamped into its axis, or None (the output's static shape gives each window's length)."""
    x = graph.spec(node.inputs[0]).shape
    ins = list(node.inputs) + [""] * (5 - len(node.inputs))
    starts = graph.constants.get(ins[1]) if ins[1] else None
    if starts is None or any(d < 0 for d in x):
        return None
    axes = graph.constants.get(ins[3]) if ins[3] else np.arange(len(np.ravel(starts)))
    steps = graph.constants.get(ins[4]) if ins[4] else np.ones(len(np.ravel(starts)), dtype=np.int64)
    if axes is None or steps is None or any(int(s) < 1 for s in np.ravel(steps)):
        return None
    out: list[tuple[int, int, int]] = []
    for a, st, k in zip(np.ravel(axes), np.ravel(starts), np.ravel(steps), strict=True):
        axis = int(a) % len(x)
        start = int(st)
        start = max(0, min(x[axis], start + x[axis] if start < 0 else start))
        out.append((axis, start, int(k)))
    return out


def slice_window(graph: Graph, node: Node) -> list[tuple[int, int]] | None:
    """[(axis, start)] of a Slice with constant starts/axes, unit steps and a static output shape
    (the output's shape gives each window's length), or None."""
    steps = slice_steps(graph, node)
    if steps is None or any(k != 1 for _, _, k in steps):
        return None
    return [(axis, start) for axis, start, _ in steps]


def input_view(
    graph: Graph,
    value: str,
    allow_scale: bool = True,
    readers: frozenset[str] = frozenset(),
) -> StridedView:
    """Walk back from `value` through Transpose, reshapes, Slice, Split and scalar Mul/Div, then
    replay the chain forward as strides over the buffer at its start. A node folds (leaves the
    plan) only when its output feeds nothing else; the others stay in `kept`. Where a reshape of
    the layout would need a copy, that Reshape stays in the plan and the view starts from its
    output."""
    producers = graph.producers()
    walk: list[tuple[Node, str]] = []  # (node, its output on the path), nearest to `value` first
    kept: set[str] = set()  # nodes on the path that other readers still need: they stay
    shared = False
    cur = value
    while True:
        p = producers.get(cur)
        if p is None:
            break
        # Folding a producer removes its output: only a value read once (by the next hop, or by
        # the kernel itself) may go. Past a value others read too, the view ops on the way stay
        # in the plan for them (views launch nothing) and the kernel reads around them.
        owned = not shared and (
            _single_use(graph, cur) or (cur == value and _read_only_by(graph, cur, readers))
        )
        if p.op_type == "Split":
            if _split_offset(graph, p, cur) is None:
                break
            walk.append((p, cur))
            kept.add(p.id)  # the Split's other outputs are read elsewhere, or by other operands
            shared = True
            cur = p.inputs[0]
            continue
        scaled = p.op_type in ("Mul", "Div") and scalar_constant(graph, p.inputs[1]) not in (None, 0.0)
        sliced = p.op_type == "Slice" and slice_window(graph, p) is not None
        if not (
            p.op_type in RESHAPES or p.op_type == "Transpose" or sliced or (allow_scale and scaled and owned)
        ):
            break
        walk.append((p, cur))
        if not owned:
            kept.add(p.id)
            shared = True
        cur = p.inputs[0]
    forward = list(reversed(walk))
    base = cur
    while True:
        result = _replay(graph, base, forward)
        if isinstance(result, StridedView):
            result.kept = {n.id for n in result.nodes if n.id in kept}
            return result
        # forward[result] cannot be a view: it runs as a copy, and the view starts after it.
        base = forward[result][1]
        forward = forward[result + 1 :]


def _replay(graph: Graph, base: str, forward: list[tuple[Node, str]]) -> StridedView | int:
    """The chain as one strided view over `base`, or the index of the first Reshape that cannot
    be one (the view then starts after it). A reshape torch would copy may still be a view of the
    chain as a whole (a head split merged into the batch and split out again): that is tried on
    finer dims (`_replay_fine`) before giving up."""
    result = _replay_coarse(graph, base, forward)
    if isinstance(result, StridedView):
        return result
    fine = _replay_fine(graph, base, forward)
    return fine if fine is not None else result


Fine = list[tuple[int, int]]  # (size, stride) pieces of one dim, outer to inner


def merged_run(pieces: Fine) -> tuple[int, int] | None:
    """One (size, stride) for pieces that lie as one strided run, else None."""
    real = [(n, st) for n, st in pieces if n != 1]
    if not real:
        return 1, 0
    for (_, outer), (n, inner) in itertools.pairwise(real):
        if outer != n * inner:
            return None
    return int(np.prod([n for n, _ in real], dtype=np.int64)), real[-1][1]


def _replay_fine(graph: Graph, base: str, forward: list[tuple[Node, str]]) -> StridedView | None:
    """Like `_replay_coarse`, but each dim is kept as pieces of the base's dims, split as reshapes
    need, so a reshape merging dims that are not one strided run only fails if the final view
    still has such a dim."""
    shape = graph.spec(base).shape
    dims: list[Fine] = [[(int(n), int(st))] for n, st in zip(shape, contiguous_strides(shape), strict=True)]
    offset = 0
    scale = 1.0
    for node, out in forward:
        if node.op_type in ("Split", "Slice"):
            window = (
                [_split_offset(graph, node, out) or (0, 0)]
                if node.op_type == "Split"
                else slice_window(graph, node) or []
            )
            new_shape = graph.spec(out).shape
            for axis, start in window:
                run = merged_run(dims[axis])
                if run is None:
                    return None
                offset += start * run[1]
                dims[axis] = [(int(new_shape[axis]), run[1])]
        elif node.op_type == "Transpose":
            perm = [int(x) for x in node.attrs.get("perm", list(range(len(dims)))[::-1])]
            dims = [dims[k] for k in perm]
        elif node.op_type in RESHAPES:
            pieces = [pc for d in dims for pc in d if pc[0] != 1]
            new_dims: list[Fine] = []
            for size in graph.spec(out).shape:
                got: Fine = []
                need = int(size)
                while need > 1:
                    if not pieces:
                        return None
                    n, st = pieces.pop(0)
                    if n <= need:
                        if need % n:
                            return None
                        got.append((n, st))
                        need //= n
                    else:  # this dim takes the outer part of the piece
                        if n % need:
                            return None
                        got.append((need, st * (n // need)))
                        pieces.insert(0, (n // need, st))
                        need = 1
                new_dims.append(got or [(1, 0)])
            if pieces:
                return None
            dims = new_dims
        else:
            c = scalar_constant(graph, node.inputs[1])
            assert c is not None
            scale *= c if node.op_type == "Mul" else 1.0 / c
    out_shape = tuple(int(np.prod([n for n, _ in d], dtype=np.int64)) for d in dims)
    if forward and out_shape != tuple(graph.spec(forward[-1][1]).shape):
        return None
    contiguous = contiguous_strides(out_shape)
    strides = []
    for d, pieces_of_d in enumerate(dims):
        run = merged_run(pieces_of_d)
        if run is None:
            return None
        strides.append(run[1] if run[0] != 1 else contiguous[d])
    return StridedView(base, out_shape, tuple(strides), scale, [n for n, _ in forward], offset)


def _replay_coarse(graph: Graph, base: str, forward: list[tuple[Node, str]]) -> StridedView | int:
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
        elif node.op_type == "Slice":  # a window: same strides, a later start, a shorter extent
            window = slice_window(graph, node)
            assert window is not None
            offset += sum(start * strides[axis] for axis, start in window)
            shape = graph.spec(out).shape
        elif node.op_type == "Transpose":
            perm = [int(x) for x in node.attrs.get("perm", list(range(len(shape)))[::-1])]
            shape = tuple(shape[k] for k in perm)
            strides = tuple(strides[k] for k in perm)
        elif node.op_type in RESHAPES:
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
