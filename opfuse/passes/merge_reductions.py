"""`merge_reductions`: a reduction of a reduction of the same kind is one reduction over both
sets of axes.

`x.mean(2, keepdim=True).mean(3, keepdim=True)` (FocalNet's global context) is exported as two
ReduceMeans: two row kernels, the second reading the first's output. Over the union of the axes
it is one mean of x (every output element averages the same number of inputs), and likewise for
ReduceSum, ReduceMax and ReduceMin. Made where the first keeps its dims (so the second's axes
number the same dims of x), the first's output is read by the second alone and is no model
output, and the axes are constants. The merged reduction keeps its dims; where the second dropped
its own, a Reshape (a view) drops them after it, leaving the first's kept dims as they were. The order of the additions changes, as a library reduction
may sum in any order; verification compares the result with the original model's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.rows import reduced_axes
from opfuse.passes.rules import Rule

RULE = names.MERGE_REDUCTIONS
KINDS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    """reduce(reduce(x)) of one kind: the outer reduction is `node`."""
    if node.op_type not in KINDS or not node.inputs or not node.inputs[0]:
        return None
    first = graph.producers().get(node.inputs[0])
    if first is None or first.op_type != node.op_type:
        return None
    return {"first": first}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    first = m["first"]
    if int(first.attrs.get("keepdims", 1)) != 1:
        return "the first reduction drops its axes: the second's axes number other dims"
    inner, outer = reduced_axes(graph, first), reduced_axes(graph, node)
    if inner is None or outer is None or not inner or not outer:
        return "the axes are not constants"
    if [u.id for u in graph.consumers().get(first.outputs[0], [])] != [node.id]:
        return "the first reduction's output is read by other ops too"
    if first.outputs[0] in {o.name for o in graph.outputs}:
        return "the first reduction's output is a model output"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    first = m["first"]
    inner, outer = reduced_axes(graph, first), reduced_axes(graph, node)
    assert inner is not None and outer is not None
    axes = graph.add_constant(
        f"{node.id}_merged_axes", np.array(sorted(set(inner) | set(outer)), dtype=np.int64), "int64"
    )
    attrs = {k: v for k, v in node.attrs.items() if k not in ("axes", "noop_with_empty_axes", "keepdims")}
    out = node.outputs[0]
    new = []
    if int(node.attrs.get("keepdims", 1)) != 1:  # the first's axes stay (size 1), the second's go
        spec = graph.spec(first.outputs[0])
        kept = tuple(1 if d in outer else size for d, size in enumerate(spec.shape))
        graph.values[f"{node.id}_kept"] = TensorSpec(f"{node.id}_kept", spec.dtype, kept)
        new.append(
            graph.reshape_node(f"{node.id}_drop", f"{node.id}_kept", tuple(graph.spec(out).shape), out)
        )
        out = f"{node.id}_kept"
    merged = Node(
        f"{node.id}_merged", node.op_type, [first.inputs[0], axes], [out], attrs | {"keepdims": 1}, node.name
    )
    graph.splice(graph.nodes.index(node), [merged, *new], {node.id, first.id})


merge_reductions = Rule(RULE, _match, _check, _rewrite)
