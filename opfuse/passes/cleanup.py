"""Cleanup rules: inference-time no-ops go away before planning.

Identity and inference-time Dropout, and copies whose output is their input: a Pad of all-zero
pads (timm's and torchvision's window attention pads to a multiple of the window size, zero where
the map divides), an Expand or Cast to the input's own shape and type, a Slice with unit steps
that keeps the whole input. Each ran as a copy kernel; their consumers now read the input. So
does arithmetic by a constant neutral element (x + 0, x * 1), which kept a conv's output from
its sibling sums (`sum_sibling_convs`).

An Expand read only by elementwise ops that broadcast to the same shape without it (F.normalize
divides by its norm expanded to the input's shape) goes too: the consumers broadcast the input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.queries import scalar_constant
from opfuse.ir.support import pad_per_dim, spatial_pad_reason
from opfuse.passes.rules import Rule

NOOP_OPS = ("Identity", "Dropout")
# Ops that broadcast all their inputs against each other (numpy's rule, ONNX's multidirectional).
BROADCASTING_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Where", "And", "Or", "Xor"}
    | {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"}
)


def replace_uses(graph: Graph, old: str, new: str) -> None:
    for n in graph.nodes:
        n.inputs = [new if x == old else x for x in n.inputs]


def _constant(graph: Graph, node: Node, i: int) -> np.ndarray | None:
    """The node's i-th input where it is given and constant (else None)."""
    name = node.inputs[i] if len(node.inputs) > i else ""
    return graph.constants.get(name) if name else None


# Reductions that give back the one element they reduce (not LogSumExp: log(exp(x)) overflows
# where x does not), and the global pools, which reduce every spatial axis.
UNIT_REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd")
GLOBAL_POOLS = ("GlobalAveragePool", "GlobalMaxPool")


def reduces_size_1_axes(graph: Graph, node: Node) -> bool:
    """Whether `node` is a global pool of a 1x1 map (its input, element for element), or a
    reduction that drops axes of one element each (the dynamo exporter's mean over a window of
    one pixel: a Reshape). A reduction that keeps its size-1 axes stays: the row planner puts the
    ops of a broadcast row with it (MobileViT V2's context sum over one patch joins its Softmax's
    kernel through it; without it they were two kernels: mobilevitv2_050 77 -> 80)."""
    if (
        node.op_type not in (*UNIT_REDUCTIONS, *GLOBAL_POOLS)
        or not node.inputs
        or not _static(graph, node.inputs[0])
    ):
        return False
    shape = tuple(graph.spec(node.inputs[0]).shape)
    if node.op_type in GLOBAL_POOLS:
        return len(shape) > 2 and all(d == 1 for d in shape[2:])
    if int(node.attrs.get("keepdims", 1)):
        return False
    given = _constant(graph, node, 1) if len(node.inputs) > 1 and node.inputs[1] else node.attrs.get("axes")
    if given is None and len(node.inputs) > 1 and node.inputs[1]:
        return False  # axes computed at run time
    axes = [
        int(a) % len(shape)
        for a in np.asarray(given if given is not None else [], dtype=np.int64).reshape(-1)
    ]
    if not axes:
        if int(node.attrs.get("noop_with_empty_axes", 0)):
            return True
        axes = list(range(len(shape)))
    return all(shape[a] == 1 for a in axes) and _static(graph, node.outputs[0])


def copies_its_input(graph: Graph, node: Node) -> bool:
    """Whether `node`'s output is its first input, element for element."""
    if node.op_type in NOOP_OPS:
        return True
    if reduces_size_1_axes(graph, node):
        x, y = graph.spec(node.inputs[0]), graph.spec(node.outputs[0])
        return tuple(x.shape) == tuple(y.shape) and x.dtype == y.dtype
    if node.op_type not in ("Pad", "Expand", "Cast", "Slice"):
        return False
    x, y = graph.spec(node.inputs[0]), graph.spec(node.outputs[0])
    if tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
        return False
    if node.op_type == "Pad":
        pads = _constant(graph, node, 1) if len(node.inputs) > 1 else node.attrs.get("pads")
        return pads is not None and not np.any(np.asarray(pads))
    if node.op_type == "Slice" and len(node.inputs) > 4 and node.inputs[4]:
        steps = _constant(graph, node, 4)
        return steps is not None and bool(np.all(np.asarray(steps) == 1))
    return True  # an Expand or a Cast to its input's shape and type; a Slice of unit steps keeping it all


def broadcast_by_readers(graph: Graph, node: Node) -> bool:
    """Whether `node` is an Expand whose readers all broadcast its input to the same outputs: each
    an elementwise op whose output shape is its inputs' broadcast with the Expand's input in place
    of its output."""
    if node.op_type != "Expand" or not node.inputs[0] or node.inputs[0] not in graph.values:
        return False
    readers = graph.consumers().get(node.outputs[0], [])
    if not readers or node.outputs[0] in {o.name for o in graph.outputs}:
        return False
    for r in readers:
        if r.op_type not in BROADCASTING_OPS:
            return False
        shapes = [graph.spec(node.inputs[0] if x == node.outputs[0] else x).shape for x in r.inputs if x]
        try:
            if tuple(np.broadcast_shapes(*shapes)) != tuple(graph.spec(r.outputs[0]).shape):
                return False
        except (ValueError, TypeError):  # not broadcastable, or a dim not static
            return False
    return True


# x + 0, 0 + x, x - 0, x * 1, 1 * x, x / 1: the constant that leaves the other operand as it is.
NEUTRAL = {"Add": (0.0, True), "Sub": (0.0, False), "Mul": (1.0, True), "Div": (1.0, False)}


def neutral_operand(graph: Graph, node: Node) -> str | None:
    """The operand an arithmetic op passes through unchanged (its other operand a one-element
    constant of the op's neutral value, no broadcast beyond the operand's shape, the same type),
    else None: a MobileOne block without an identity branch, exported by TorchScript, adds a
    literal 0. Only a literal: a bias or scale vector that happens to hold zeros or ones is a
    weight (a freshly initialized model's), which a trained model's would not be."""
    if node.op_type not in NEUTRAL or len(node.inputs) != 2:
        return None
    value, commutes = NEUTRAL[node.op_type]
    y = graph.spec(node.outputs[0])
    for i in (0, 1) if commutes else (0,):
        x, c = node.inputs[i], node.inputs[1 - i]
        if x in graph.constants or scalar_constant(graph, c) != value:
            continue
        spec = graph.spec(x)
        if tuple(spec.shape) == tuple(y.shape) and spec.dtype == y.dtype:
            return x
    return None


def _match_noop(graph: Graph, node: Node) -> dict[str, Any] | None:
    if copies_its_input(graph, node) or broadcast_by_readers(graph, node):
        return {"nodes": [node], "src": node.inputs[0]}
    if reduces_size_1_axes(graph, node):  # keepdims=0: the axes dropped, a view
        return {"nodes": [node], "reshape": True}
    src = neutral_operand(graph, node)
    return {"nodes": [node], "src": src} if src is not None else None


def _check_noop(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if m.get("reshape"):
        return None
    if node.op_type == "Dropout" and len([o for o in node.outputs if o]) > 1:
        return "the Dropout mask output is used"
    graph_outputs = {o.name for o in graph.outputs}
    src = m.get("src", node.inputs[0])
    if node.outputs[0] in graph_outputs and (src in graph_outputs or src not in graph.producers()):
        return "its output is a graph output fed directly by a graph input or another output"
    return None


def _rewrite_noop(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    if m.get("reshape"):
        _as_reshape(graph, node)
        return
    src, dst = m.get("src", node.inputs[0]), node.outputs[0]
    graph.nodes.remove(node)
    graph_outputs = {o.name for o in graph.outputs}
    if dst in graph_outputs:
        # Keep the graph output's name: make the producer write it directly.
        producer = graph.producers()[src]
        producer.outputs = [dst if o == src else o for o in producer.outputs]
        replace_uses(graph, src, dst)
    else:
        replace_uses(graph, dst, src)


eliminate_noops = Rule(
    names.ELIMINATE_NOOPS,
    _match_noop,
    _check_noop,
    _rewrite_noop,
)


def _match_where(graph: Graph, node: Node) -> dict[str, Any] | None:
    """Where(constant condition, scalar constant, tensor): a masked fill written fill-first."""
    if node.op_type != "Where" or len(node.inputs) != 3:
        return None
    cond, fill, x = node.inputs
    if cond not in graph.constants or x in graph.constants or scalar_constant(graph, fill) is None:
        return None
    return {"nodes": [node]}


def _rewrite_where(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    cond, fill, x = node.inputs
    flipped = np.logical_not(np.asarray(graph.constants[cond], dtype=bool))
    node.inputs = [graph.add_constant(f"{node.id}_kept", flipped, "bool"), x, fill]


# DeBERTa masks its scores with masked_fill(mask, min): Where(mask, min, scores). The attention
# kernel (and every rule that reads a mask) takes Where(keep, scores, fill): with the condition a
# constant, the other spelling is the same op with the condition negated.
where_fill_last = Rule(names.WHERE_FILL_LAST, _match_where, lambda g, n, m: None, _rewrite_where)


def _match_pad_conv(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Conv" or not node.inputs[0]:
        return None
    pad = graph.producers().get(node.inputs[0])
    if pad is None or pad.op_type != "Pad":
        return None
    return {"nodes": [pad, node], "pad": pad}


def _check_pad_conv(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    pad: Node = m["pad"]
    if str(node.attrs.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        return f"the Conv pads itself (auto_pad {node.attrs.get('auto_pad')})"
    if str(pad.attrs.get("mode", "constant")) != "constant":
        return f"a {pad.attrs.get('mode')} Pad: a Conv pads with zeros only"
    if len(pad.inputs) > 2 and pad.inputs[2]:
        value = _constant(graph, pad, 2)
        if value is None or value.size != 1 or float(np.asarray(value).ravel()[0]) != 0.0:
            return "the pad value is not the constant 0"
    why = spatial_pad_reason(graph, pad)
    if why is not None:
        return why
    readers = graph.consumers().get(pad.outputs[0], [])
    if [r.id for r in readers] != [node.id] or pad.outputs[0] in {o.name for o in graph.outputs}:
        return "the padded tensor is read by more than this Conv"
    return None


def _rewrite_pad_conv(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    pad: Node = m["pad"]
    per_dim = pad_per_dim(graph, pad)
    assert per_dim is not None
    spatial = per_dim[2:]
    own = [int(p) for p in node.attrs.get("pads", [0] * 2 * len(spatial))]
    nd = len(spatial)
    node.attrs = {k: v for k, v in node.attrs.items() if k != "auto_pad"}
    node.attrs["pads"] = [own[d] + spatial[d][0] for d in range(nd)] + [
        own[nd + d] + spatial[d][1] for d in range(nd)
    ]
    node.inputs = [pad.inputs[0], *node.inputs[1:]]
    graph.nodes.remove(pad)


# A zero Pad of the spatial axes read only by a Conv (TensorFlow's "same" padding, written out by
# the exporter before every conv of a ported model) is the Conv's own padding: one launch less,
# and every conv template and library call handles its pads.
fold_pad_into_conv = Rule(names.FOLD_PAD_INTO_CONV, _match_pad_conv, _check_pad_conv, _rewrite_pad_conv)


def _static(graph: Graph, name: str) -> bool:
    return name in graph.values and all(int(d) >= 0 for d in graph.spec(name).shape)


# Views whose output is their input's elements in the same order, only the shape changed.
RESHAPING_VIEWS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _match_reshape(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Reshape" or not _static(graph, node.inputs[0]) or not _static(graph, node.outputs[0]):
        return None
    inner = graph.producers().get(node.inputs[0])
    if tuple(graph.spec(node.inputs[0]).shape) == tuple(graph.spec(node.outputs[0]).shape):
        return {"nodes": [node], "identity": True}
    if inner is not None and inner.op_type in RESHAPING_VIEWS and _static(graph, inner.inputs[0]):
        return {"nodes": [inner, node], "inner": inner}
    return None


def _check_reshape(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    return _check_noop(graph, node, m) if m.get("identity") else None


def _rewrite_reshape(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    if m.get("identity"):
        _rewrite_noop(graph, node, m)
        return
    # Reshape(Reshape(x)) is one Reshape of x to the outer's (static) shape; the inner one stays
    # for its other readers, or goes with the unused values once it has none.
    inner: Node = m["inner"]
    target = f"{node.id}_collapsed_shape"
    shape = tuple(int(d) for d in graph.spec(node.outputs[0]).shape)
    graph.constants[target] = np.array(shape, dtype=np.int64)
    graph.values[target] = TensorSpec(target, "int64", (len(shape),))
    node.inputs = [inner.inputs[0], target]
    node.attrs = {k: v for k, v in node.attrs.items() if k != "allowzero"}
    graph_outputs = {o.name for o in graph.outputs}
    if not graph.consumers().get(inner.outputs[0]) and inner.outputs[0] not in graph_outputs:
        graph.nodes.remove(inner)
    # Back to the view's input's own shape: no view at all (this node is not visited again).
    one = {"nodes": [node]}
    if tuple(graph.spec(inner.inputs[0]).shape) == shape and _check_noop(graph, node, one) is None:
        _rewrite_noop(graph, node, one)


# A Reshape of a Reshape (or of a Flatten, Squeeze, Unsqueeze) reads the first one's input (one
# view, not two), and a Reshape to its input's own shape is no view at all. Exporters write both
# (a Linear on the flattened tokens of LeViT, then the view back), and a pair between a GEMM's
# epilogue and the residual Add kept the Add out of the epilogue. Runs after
# pointwise_before_views, which leaves such pairs behind.
collapse_reshapes = Rule(names.COLLAPSE_RESHAPES, _match_reshape, _check_reshape, _rewrite_reshape)


def _non_unit(shape: tuple[int, ...]) -> list[int]:
    return [d for d, n in enumerate(shape) if n != 1]


def _unit_transpose(graph: Graph, node: Node) -> bool:
    """A Transpose that moves only size-1 dims: the others keep their order."""
    if node.op_type != "Transpose" or not _static(graph, node.inputs[0]):
        return False
    shape = tuple(graph.spec(node.inputs[0]).shape)
    perm = [int(p) for p in node.attrs.get("perm", list(range(len(shape)))[::-1])]
    moved = [p for p in perm if shape[p] != 1]
    return moved == sorted(moved) and perm != sorted(perm)


def _match_unit_view(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type == "Transpose":
        readers = graph.consumers().get(node.outputs[0], [])
        # Only where a Softmax reads it: elsewhere a pattern may look for the Transpose itself
        # (attention's transposed keys over a single token).
        softmax = len(readers) == 1 and readers[0].op_type in ("Softmax", "LogSoftmax")
        return {"nodes": [node], "transpose": True} if softmax and _unit_transpose(graph, node) else None
    if node.op_type != "Reshape" or not _static(graph, node.inputs[0]) or not _static(graph, node.outputs[0]):
        return None
    producers = graph.producers()
    row = producers.get(node.inputs[0])
    if row is None or row.op_type not in ("Softmax", "LogSoftmax") or not _static(graph, row.inputs[0]):
        return None
    # Only where a view computes the Softmax's input, which the moved Reshape then joins: ops of
    # the input's own shape (a mask added to the scores) would be left in another shape than the
    # Softmax and out of its row kernel.
    before = producers.get(row.inputs[0])
    if before is None or not (before.op_type in RESHAPING_VIEWS or _unit_transpose(graph, before)):
        return None
    x, y = tuple(graph.spec(node.inputs[0]).shape), tuple(graph.spec(node.outputs[0]).shape)
    if [x[d] for d in _non_unit(x)] != [y[d] for d in _non_unit(y)]:
        return None  # not only size-1 dims added or dropped
    axis = int(row.attrs.get("axis", -1)) % len(x)
    if x[axis] == 1:
        return None
    return {"nodes": [row, node], "row": row, "axis": _non_unit(y)[_non_unit(x).index(axis)]}


def _check_unit_view(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if m.get("transpose"):
        return None
    row: Node = m["row"]
    if len(graph.consumers().get(row.outputs[0], [])) != 1 or row.outputs[0] in {
        o.name for o in graph.outputs
    }:
        return "the Softmax is read besides the Reshape"
    return None


def _as_reshape(graph: Graph, node: Node) -> None:
    """`node` becomes a Reshape of its first input to its output's (static) shape."""
    out = [int(d) for d in graph.spec(node.outputs[0]).shape]
    target = graph.add_constant(f"{node.id}_unit_shape", np.array(out, dtype=np.int64), "int64")
    node.op_type, node.inputs, node.attrs = "Reshape", [node.inputs[0], target], {}


def _rewrite_unit_view(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    _as_reshape(graph, node)
    if m.get("transpose"):
        return
    # Softmax(x) -> Reshape  becomes  Reshape(x) -> Softmax on the same axis of the new shape.
    row: Node = m["row"]
    x, y = row.inputs[0], node.outputs[0]
    between = f"{node.id}_unit_view"
    graph.values[between] = TensorSpec(between, graph.spec(x).dtype, graph.spec(y).shape)
    del graph.values[row.outputs[0]]
    node.inputs, node.outputs = [x, node.inputs[1]], [between]
    row.inputs, row.outputs = [between], [y]
    row.attrs = {**row.attrs, "axis": m["axis"]}
    graph.nodes.remove(node)
    graph.nodes.insert(graph.nodes.index(row), node)


# A Transpose that moves only size-1 dims (the others keep their order) before a Softmax is a
# Reshape, and a Reshape that only adds or drops size-1 dims after a Softmax of a view goes before it (the Softmax over the
# same axis of the new shape). ResNeSt's split attention writes its radix Softmax between two
# such views; as Reshapes they collapse into one, and the Softmax's rows have the shape of the
# weighted sum that reads them (`row_reduction` computes both in one kernel).
unit_dim_views = Rule(names.UNIT_DIM_VIEWS, _match_unit_view, _check_unit_view, _rewrite_unit_view)
