"""`pad_gather`: a constant Pad, with the layout ops around it, read only by one pointwise kernel
(or one GEMM's epilogue: fusion/rules/anchor_epilogue.py) is computed by that kernel's loads; so
is a Gather by constant indices no view describes, read by one pointwise kernel.

A Pad writes a copy of its input with a border: a kernel of its own, and another for each Reshape
of the padded value that is no strided view. Relative-position logits shift their rows that way
(HaloNet's, BoTNet's: pad a column, flatten, pad, reshape, slice, expand, transpose, then add the
height and width logits), and CoaT pads its convolutional position term with a row for the class
token. Where the value reaches one pointwise kernel only through Reshapes, Transposes, Expands,
Slices and constant Pads, that kernel loads each element from the buffer behind the chain at the
coordinates the chain maps it to (ir/index_map.py), and the border lanes take the Pad's value: the
chain's ops leave the plan. A chain without a Pad is left to `layout_views` (strides) where
strides reach its start; where they do not (Swin's and DaViT's window reverse: a Reshape of a
permuted value merges dims no one stride spans, and the runtime would copy it), it is an index
map too.

A Gather by constant indices that gather_to_slice could not make a view of (they overlap, repeat
or are clamped: the dynamo exporter's adaptive average pooling gathers each window's pixels, then
masks, sums and divides them) ran as a kernel writing every gathered element. In the chain it is
a step like the others: the kernel loads each element's coordinate on the Gather's axis from the
index table (a kernel input, clamped into the axis: tuning runs the kernel on random inputs).
A row kernel's full-shaped input is read through such chains too (fusion/rules/row_reduction.py).
"""

from __future__ import annotations

from opfuse.fusion.views import RESHAPES, input_view, slice_steps
from opfuse.graph import Graph, Node
from opfuse.ir.index_map import IndexMap, IndexStep
from opfuse.ir.ops import FLOAT_TYPES
from opfuse.ir.queries import scalar_constant
from opfuse.ir.support import pad_per_dim


def _slice_step(graph: Graph, node: Node) -> IndexStep | None:
    """A Slice with constant starts, axes and positive steps as a step, or None."""
    parsed = slice_steps(graph, node)
    if parsed is None:
        return None
    x = tuple(graph.spec(node.inputs[0]).shape)
    first, stride = [0] * len(x), [1] * len(x)
    for axis, start, step in parsed:
        first[axis], stride[axis] = start, step
    return IndexStep(
        "slice", x, tuple(graph.spec(node.outputs[0]).shape), starts=tuple(first), steps=tuple(stride)
    )


def _gather_step(graph: Graph, node: Node, x: tuple[int, ...], y: tuple[int, ...]) -> IndexStep | None:
    """A Gather by a constant table of non-negative integers on a static axis as a step, or None."""
    if len(node.inputs) < 2 or node.inputs[1] not in graph.constants or not x:
        return None
    table = graph.constants[node.inputs[1]]
    axis = int(node.attrs.get("axis", 0)) % len(x)
    if table.dtype.kind not in "iu" or (table.size and (table.min() < 0 or table.max() >= x[axis])):
        return None  # negative indices: a Gather of its own (check_indices has the range)
    return IndexStep("gather", x, y, axis=axis, table=node.inputs[1], index_shape=tuple(table.shape))


def _step(graph: Graph, node: Node, gathers: bool = False) -> IndexStep | None:
    """`node` as a step of an index map, or None where it is none (a Gather only with `gathers`)."""
    if not node.inputs or not node.outputs:
        return None
    x = tuple(graph.spec(node.inputs[0]).shape)
    y = tuple(graph.spec(node.outputs[0]).shape)
    if any(d < 0 for d in (*x, *y)):
        return None
    if node.op_type in RESHAPES:
        return IndexStep("reshape", x, y)
    if node.op_type == "Transpose":
        perm = tuple(int(p) for p in node.attrs.get("perm", range(len(x) - 1, -1, -1)))
        return IndexStep("transpose", x, y, perm=perm)
    if node.op_type == "Expand":
        lead = len(y) - len(x)
        if lead < 0 or any(a not in (1, b) for a, b in zip(x, y[lead:], strict=True)):
            return None
        return IndexStep("expand", x, y)
    if node.op_type == "Slice":
        return _slice_step(graph, node)
    if node.op_type == "Pad":
        mode = node.attrs.get("mode", "constant")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        per_dim = pad_per_dim(graph, node)
        if mode != "constant" or per_dim is None or any(b < 0 or e < 0 for b, e in per_dim):
            return None
        value = 0.0
        if len(node.inputs) > 2 and node.inputs[2]:
            c = scalar_constant(graph, node.inputs[2])
            if c is None:
                return None
            value = float(c)
        return IndexStep("pad", x, y, begins=tuple(b for b, _ in per_dim), value=value)
    if node.op_type == "Gather" and gathers:
        return _gather_step(graph, node, x, y)
    return None


def plan_pad_gathers(
    graph: Graph,
    readers: set[str],
    values: list[str],
    claimed: set[str],
    producers: dict[str, Node] | None = None,
    consumers: dict[str, list[Node]] | None = None,
    gathers: bool = False,
) -> tuple[dict[str, IndexMap], list[Node]]:
    """The inputs among `values` that reach the kernel (whose nodes are `readers`) through a chain
    of layout ops holding a constant Pad (or, with `gathers`, a Gather by constant indices), each
    read by nothing else than the kernel and its chains, as index maps; and the chains' nodes,
    which leave the plan. Chains may share nodes (LongT5 pads its keys' blocks once and slices the
    padded value three times into one Concat): each load recomputes the shared steps. `claimed`:
    nodes other groups hold."""
    producers = graph.producers() if producers is None else producers
    consumers = graph.consumers() if consumers is None else consumers
    # Every chain as long as its steps go; where an op of them is read by a node that is neither
    # the kernel's nor the chains', walk again within the ops kept: they only shrink, so this ends.
    shared: set[str] | None = None
    while True:
        maps, absorbed = _chains(graph, readers, values, claimed, producers, consumers, gathers, shared)
        kept = {n.id for n in absorbed}
        users = (u.id for n in absorbed for o in n.outputs for u in consumers.get(o, []))
        if all(u in readers or u in kept for u in users):
            return maps, absorbed
        shared = kept


def _chains(
    graph: Graph,
    readers: set[str],
    values: list[str],
    claimed: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
    gathers: bool,
    shared: set[str] | None,
) -> tuple[dict[str, IndexMap], list[Node]]:
    """plan_pad_gathers' chains, where a chain node's value may be read by the nodes of `shared`
    besides the kernel's (by any node where `shared` is None: the first, longest walk)."""
    outputs = {o.name for o in graph.outputs}
    maps: dict[str, IndexMap] = {}
    absorbed: dict[str, Node] = {}
    for x in values:
        if graph.spec(x).dtype not in FLOAT_TYPES:
            continue
        chain: list[Node] = []
        steps: list[IndexStep] = []
        cur = x
        while True:
            p = producers.get(cur)
            users = consumers.get(cur, [])
            if shared is None:
                only_ours = cur != x or all(u.id in readers for u in users)
            else:
                only_ours = all(u.id in readers or u.id in shared for u in users)
            if p is None or p.id in claimed or cur in outputs or not only_ours:
                break
            if shared is not None and p.id not in shared:
                break  # dropped before: the kept set only shrinks
            step = _step(graph, p, gathers)
            if step is None:
                break
            chain.append(p)
            steps.append(step)
            cur = p.inputs[0]
        if not chain:
            continue
        base = chain[-1].inputs[0]
        if not any(s.op in ("pad", "gather") for s in steps) and _strides_reach(graph, x, base, readers):
            continue  # strides cover it (layout_views)
        if base in graph.constants:
            continue  # a constant chain is folded, not gathered
        maps[x] = IndexMap(base, tuple(graph.spec(base).shape), tuple(graph.spec(x).shape), tuple(steps))
        absorbed.update((n.id, n) for n in chain)
    return maps, list(absorbed.values())


def _strides_reach(graph: Graph, x: str, base: str, readers: set[str]) -> bool:
    """Whether `x` is a strided view of `base` (layout_views reads it so); where a Reshape of a
    permuted or sliced value merges dims no one stride spans (a window partition reversed, then
    cropped), the view stops at a copy the runtime makes, and the index map reads `base` itself."""
    view = input_view(graph, x, allow_scale=False, readers=frozenset(readers))
    return view.base == base
