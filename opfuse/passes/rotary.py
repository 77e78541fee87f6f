"""Rotary embeddings' rotate_half as one small GEMM, so the whole rotation is one kernel.

LLaMA-style models compute `q * cos + rotate_half(q) * sin` with rotate_half(x) =
Concat(-x[..., h:], x[..., :h]): two slice copies, a negation and a concatenation, each a kernel,
between the projections and attention. rotate_half is a signed permutation of the last axis, so it
is x @ R for a constant [2h, 2h] matrix R (one -1 or +1 per column). As a MatMul by a constant it
is an anchor whose epilogue takes the `* sin` and the `+ q * cos`; the arithmetic stays exact (each
output is one input, times ±1, accumulated in float32).

GPT-J, CodeGen and EVA-02 rotate interleaved pairs instead: rotate_every_two(x) =
stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2), exported as two strided Slices, a Neg, two
Unsqueezes, a Concat and a Reshape. It is a signed permutation of the last axis too
(out[2i] = -x[2i + 1], out[2i + 1] = x[2i]) and becomes the same kind of MatMul.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import FLOAT_TYPES
from opfuse.passes.rules import Rule


def _const_ints(graph: Graph, name: str) -> list[int] | None:
    if not name or name not in graph.constants:
        return None
    return [int(v) for v in np.asarray(graph.constants[name]).ravel()]


def _slice(graph: Graph, node: Node | None) -> tuple[str, int, int, int, int] | None:
    """(input, axis, start, end, step) of a Slice along one axis with constant bounds and a
    positive step, start and end clamped into the axis."""
    if node is None or node.op_type != "Slice" or len(node.inputs) < 3:
        return None
    shape = graph.spec(node.inputs[0]).shape
    starts, ends = _const_ints(graph, node.inputs[1]), _const_ints(graph, node.inputs[2])
    axes = _const_ints(graph, node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else [0]
    steps = _const_ints(graph, node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1]
    if not shape or starts is None or ends is None or axes is None or steps is None:
        return None
    if not (len(starts) == len(ends) == len(axes) == len(steps) == 1) or steps[0] < 1:
        return None
    axis = axes[0] % len(shape)
    size = shape[axis]

    def clamp(v: int) -> int:
        return min(max(v + size if v < 0 else v, 0), size)

    return node.inputs[0], axis, clamp(starts[0]), clamp(ends[0]), steps[0]


def slice_range(graph: Graph, node: Node | None) -> tuple[str, int, int, int] | None:
    """(input, axis, start, end) of a Slice along one axis with step 1 and constant bounds."""
    sl = _slice(graph, node)
    return sl[:4] if sl is not None and sl[4] == 1 else None


def every_other(graph: Graph, node: Node | None) -> tuple[str, int, int] | None:
    """(input, axis, start) of a Slice along one axis with step 2 from `start` to the end."""
    sl = _slice(graph, node)
    if sl is None or sl[4] != 2 or sl[3] != graph.spec(sl[0]).shape[sl[1]]:
        return None
    return sl[0], sl[1], sl[2]


def _unsqueezed_last(graph: Graph, node: Node | None) -> str | None:
    """The input of an Unsqueeze that adds one trailing axis, else None."""
    if node is None or node.op_type != "Unsqueeze":
        return None
    rank = len(graph.spec(node.outputs[0]).shape)
    axes = _const_ints(graph, node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    axes = axes if axes is not None else [int(a) for a in node.attrs.get("axes", [])]
    return node.inputs[0] if [a % rank for a in axes] == [rank - 1] else None


def _match_interleaved(graph: Graph, node: Node) -> dict[str, Any] | None:
    """Reshape(Concat(Unsqueeze(Neg(x[..., 1::2])), Unsqueeze(x[..., ::2]), axis=-1)) to x's shape."""
    producers = graph.producers()
    cat = producers.get(node.inputs[0])
    if cat is None or cat.op_type != "Concat" or len(cat.inputs) != 2:
        return None
    ups = [producers.get(x) for x in cat.inputs]
    neg_out, even_out = (_unsqueezed_last(graph, u) for u in ups)
    neg = producers.get(neg_out or "")
    if neg is None or neg.op_type != "Neg" or even_out is None:
        return None
    odd, even = producers.get(neg.inputs[0]), producers.get(even_out)
    so, se = every_other(graph, odd), every_other(graph, even)
    if so is None or se is None:
        return None
    return {
        "nodes": [node],
        "form": "interleaved",
        "odd": so,
        "even": se,
        "cat": cat,
        "dead": [cat, *ups, neg, odd, even],
    }


def _check_interleaved(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    (x, axis, os_), (x2, axis2, es) = m["odd"], m["even"]
    shape = graph.spec(x).shape
    if x != x2 or axis != axis2:
        return "the two halves come from different tensors or axes"
    if axis != len(shape) - 1 or int(m["cat"].attrs.get("axis", 0)) % (len(shape) + 1) != len(shape):
        return "not a rotation of the last axis"
    if shape[-1] % 2 or (os_, es) != (1, 0):
        return "the slices are not the odd and even elements of the last axis"
    if tuple(graph.spec(node.outputs[0]).shape) != tuple(shape):
        return "the pairs are not flattened back to the input's shape"
    if graph.spec(x).dtype not in FLOAT_TYPES:
        return f"values of type {graph.spec(x).dtype}"
    return None


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type == "Reshape":
        return _match_interleaved(graph, node)
    if node.op_type != "Concat" or len(node.inputs) != 2:
        return None
    producers = graph.producers()
    neg, low = producers.get(node.inputs[0]), producers.get(node.inputs[1])
    if neg is None or neg.op_type != "Neg":
        return None
    high = producers.get(neg.inputs[0])
    hi, lo = slice_range(graph, high), slice_range(graph, low)
    if hi is None or lo is None:
        return None
    return {"nodes": [node], "form": "half", "hi": hi, "lo": lo, "dead": [neg, high, low]}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if m["form"] == "interleaved":
        return _check_interleaved(graph, node, m)
    (x, axis, hs, he), (x2, axis2, ls, le) = m["hi"], m["lo"]
    shape = graph.spec(x).shape
    if x != x2 or axis != axis2:
        return "the two halves come from different tensors or axes"
    if axis != len(shape) - 1 or int(node.attrs.get("axis", 0)) % len(shape) != axis:
        return "not a rotation of the last axis"
    d = shape[-1]
    if d % 2 or (hs, he, ls, le) != (d // 2, d, 0, d // 2):
        return "the slices are not the two halves of the last axis"
    if graph.spec(x).dtype not in FLOAT_TYPES:
        return f"values of type {graph.spec(x).dtype}"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    x = m["hi"][0] if m["form"] == "half" else m["odd"][0]
    d = graph.spec(x).shape[-1]
    h = d // 2
    rot = np.zeros((d, d), dtype=np.float32)
    for i in range(h):
        if m["form"] == "half":
            rot[i + h, i] = -1.0  # out[i] = -x[i + h]
            rot[i, i + h] = 1.0  # out[i + h] = x[i]
        else:
            rot[2 * i + 1, 2 * i] = -1.0  # out[2i] = -x[2i + 1]
            rot[2 * i, 2 * i + 1] = 1.0  # out[2i + 1] = x[2i]
    name = f"{node.id}_rotate_half"
    graph.constants[name] = rot
    graph.values[name] = TensorSpec(name, "float32", (d, d))
    i = graph.nodes.index(node)
    graph.nodes[i] = Node(node.id, "MatMul", [x, name], list(node.outputs), {}, node.name)
    # The slices and the negation, if nothing else reads them.
    outputs = {o.name for o in graph.outputs}
    for dead in m["dead"]:
        used = any(o in outputs or any(o in n.inputs for n in graph.nodes) for o in dead.outputs if o)
        if not used and dead in graph.nodes:
            graph.nodes.remove(dead)


rotate_half = Rule(
    names.ROTATE_HALF,
    _match,
    _check,
    _rewrite,
)
