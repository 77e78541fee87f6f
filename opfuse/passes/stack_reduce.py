"""`reduce_stack`: a reduction over the axis a stack adds is an elementwise sum (mean, maximum,
minimum) of the stacked tensors.

`torch.stack(xs, d).sum(d)` is exported as an Unsqueeze of each x, a Concat along d and a ReduceSum
over d; weighted, `(torch.stack(xs, d) * w).sum(d)`, with a Mul between. Selective-kernel
attention (SKNet) sums its branches this way, and again weighted by their softmax; BiFPN's fast
fusion and an ensemble's mean are written the same. As written, the Concat is a copy of every
branch and the reduction a kernel over it. As `x0 + x1 (+ ...)`, or `x0 * w0 + x1 * w1` with each
weight's slice of the stacked axis, they are pointwise ops that join their neighbours' kernels (a
conv's epilogue, the next reduction's prologue), and the Concat goes once nothing else reads it.

Made where the reduction (ReduceSum, ReduceMean, ReduceMax, ReduceMin) reduces exactly the Concat's
axis, the Concat stacks 2 to MAX_PARTS inputs, each of size 1 along it, and between them at most
one Mul (Sum and Mean only) by a tensor or constant that broadcasts along that axis (size 1, or the
stack's). The order of the
additions is the reduction's (left to right), as a library reduction may not sum; verification
compares the result with the original model's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.rows import reduced_axes
from opfuse.passes.rules import Rule

RULE = names.REDUCE_STACK
COMBINE = {"ReduceSum": "Add", "ReduceMean": "Add", "ReduceMax": "Max", "ReduceMin": "Min"}
MAX_PARTS = 16


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    """reduce(Concat(parts, axis)) or reduce(Concat(parts, axis) * w) over that axis alone."""
    if node.op_type not in COMBINE or not node.inputs or not node.inputs[0]:
        return None
    producers = graph.producers()
    x = producers.get(node.inputs[0])
    mul = None
    if x is not None and x.op_type == "Mul" and node.op_type in ("ReduceSum", "ReduceMean"):
        cats = [producers.get(i) for i in x.inputs]
        k = next((j for j, c in enumerate(cats) if c is not None and c.op_type == "Concat"), None)
        if k is None:
            return None
        mul, x = x, cats[k]
    if x is None or x.op_type != "Concat":
        return None
    return {"concat": x, "mul": mul, "nodes": [n for n in (x, mul, node) if n is not None]}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    concat, mul = m["concat"], m["mul"]
    out = graph.spec(concat.outputs[0]).shape
    rank = len(out)
    axis = int(concat.attrs.get("axis", 0)) % rank
    if reduced_axes(graph, node) != [axis]:
        return "the reduction is not over the stacked axis alone"
    parts = [p for p in concat.inputs if p]
    if not 2 <= len(parts) <= MAX_PARTS:
        return f"a stack of {len(parts)} tensors (2 to {MAX_PARTS} are summed)"
    if any(len(graph.spec(p).shape) != rank or graph.spec(p).shape[axis] != 1 for p in parts):
        return "not a stack: an input has more than one element along the axis"
    if len({tuple(graph.spec(p).shape) for p in parts}) != 1:
        return "the stacked tensors differ in shape"
    if mul is not None:
        w = next(i for i in mul.inputs if i != concat.outputs[0])
        ws = graph.spec(w).shape
        if len(ws) > rank or graph.spec(mul.outputs[0]).shape != out:
            return "the weight broadcasts the stack to a larger shape"
        padded = (1,) * (rank - len(ws)) + tuple(ws)
        if padded[axis] not in (1, len(parts)):
            return "the weight's stacked axis is neither 1 nor the stack's"
        if mul.inputs[0] == mul.inputs[1]:
            return "the stack squared"
    readers = graph.consumers()
    if mul is not None and [r.id for r in readers.get(mul.outputs[0], [])] != [node.id]:
        return "the weighted stack is read by other ops too"
    if any(o.name in (concat.outputs[0], (mul or concat).outputs[0]) for o in graph.outputs):
        return "the stack is a model output"
    if graph.spec(node.outputs[0]).dtype not in ("float32", "float16", "float64"):
        return f"values of type {graph.spec(node.outputs[0]).dtype}"
    return None


def _value(graph: Graph, name: str, dtype: str, shape: tuple[int, ...]) -> str:
    graph.values[name] = TensorSpec(name, dtype, shape)
    return name


class _Stack:
    """The rewrite's new nodes, named after the reduction."""

    def __init__(self, graph: Graph, node: Node) -> None:
        self.graph, self.tag = graph, f"{node.id}_stack"
        self.new: list[Node] = []
        self.producers = graph.producers()

    def reshape(self, value: str, shape: tuple[int, ...], j: str) -> str:
        """`value` as `shape` (the same elements): the tensor an Unsqueeze made it from, else a
        Reshape (a view)."""
        graph = self.graph
        if tuple(graph.spec(value).shape) == shape:
            return value
        p = self.producers.get(value)
        if p is not None and p.op_type == "Unsqueeze" and tuple(graph.spec(p.inputs[0]).shape) == shape:
            return p.inputs[0]
        self.new.append(graph.reshape_node(f"{self.tag}_{j}", value, shape, f"{self.tag}_{j}"))
        return self.new[-1].outputs[0]

    def weight(self, w: str, i: int, axis: int, keep: bool) -> str:
        """Part i's weight: its slice of w's stacked axis (`axis`, counted in w's own dims), that
        axis dropped unless `keep`."""
        graph, tag = self.graph, self.tag
        ws = tuple(graph.spec(w).shape)
        dropped = ws[:axis] + ws[axis + 1 :]
        if w in graph.constants:
            arr = np.take(graph.constants[w], [i], axis=axis)
            arr = arr if keep else arr.reshape(dropped)
            return graph.add_constant(f"{tag}_w{i}", arr, graph.spec(w).dtype)
        ins = [w]
        for k, v in (("s", i), ("e", i + 1), ("a", axis)):
            ins.append(graph.add_constant(f"{tag}_w{i}_{k}", np.array([v], dtype=np.int64), "int64"))
        sliced = _value(graph, f"{tag}_w{i}_slice", graph.spec(w).dtype, (*ws[:axis], 1, *ws[axis + 1 :]))
        self.new.append(Node(f"{tag}_w{i}_slice", "Slice", ins, [sliced], {}, ""))
        return sliced if keep else self.reshape(sliced, dropped, f"w{i}")


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    concat, mul = m["concat"], m["mul"]
    rank = len(graph.spec(concat.outputs[0]).shape)
    axis = int(concat.attrs.get("axis", 0)) % rank
    parts = [p for p in concat.inputs if p]
    keep = int(node.attrs.get("keepdims", 1)) == 1
    out = node.outputs[0]
    dtype, shape = graph.spec(out).dtype, tuple(graph.spec(out).shape)
    st = _Stack(graph, node)
    terms = [st.reshape(p, shape, f"p{i}") for i, p in enumerate(parts)]
    if mul is not None:
        w = next(i for i in mul.inputs if i != concat.outputs[0])
        ws = tuple(graph.spec(w).shape)
        w_axis = axis - (rank - len(ws))  # the stacked axis among w's dims (< 0: w lacks it)
        shared = None  # w broadcasts along the axis: every part's weight, made once
        if w_axis < 0 or (keep and ws[w_axis] == 1):
            shared = w
        elif ws[w_axis] == 1:
            shared = st.reshape(w, ws[:w_axis] + ws[w_axis + 1 :], "w")
        for i, t in enumerate(terms):
            wi = shared if shared is not None else st.weight(w, i, w_axis, keep)
            prod = _value(graph, f"{st.tag}_m{i}", dtype, shape)
            st.new.append(Node(f"{st.tag}_m{i}", "Mul", [t, wi], [prod], {}, mul.name))
            terms[i] = prod
    mean = node.op_type == "ReduceMean"
    acc = terms[0]
    for i, t in enumerate(terms[1:], 1):
        name = out if i == len(terms) - 1 and not mean else _value(graph, f"{st.tag}_s{i}", dtype, shape)
        st.new.append(Node(f"{st.tag}_s{i}", COMBINE[node.op_type], [acc, t], [name], {}, node.name))
        acc = name
    if mean:
        inv = graph.add_constant(f"{st.tag}_inv", np.array(1.0 / len(terms), dtype=np.dtype(dtype)), dtype)
        st.new.append(Node(f"{st.tag}_mean", "Mul", [acc, inv], [out], {}, node.name))
    removed = {node.id} | ({mul.id} if mul is not None else set())
    graph.splice(graph.nodes.index(node), st.new, removed)
    if not graph.consumers().get(concat.outputs[0]):
        graph.nodes.remove(concat)


reduce_stack = Rule(RULE, _match, _check, _rewrite)
