"""`sum_sibling_gemms`: two products of one input by constant weights, added together, are one
product by the sum of the weights.

A distilled classifier (DeiT's, LeViT's, EfficientFormer's) ends with two heads on the same
features, averaged: `(head(x) + head_dist(x)) / 2`. Each head is a GEMM; the second takes the first
as its epilogue's input, so the first runs as a kernel of its own that writes its logits for the
other to read back. `x @ W1 + b1 + x @ W2 + b2` is `x @ (W1 + W2) + (b1 + b2)`: one GEMM, whose
epilogue runs the rest (the halving). The weights are summed in float64 and stored in their own
type; the order of the additions changes, as any fusion's does (verification compares the result
with the original model's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node
from opfuse.passes.rules import Rule

RULE = names.SUM_SIBLING_GEMMS


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    """Add(P1, P2) where P1 and P2 are both Gemm or both MatMul of the same first input by a
    constant 2-D weight, each read only by the Add."""
    if node.op_type != "Add" or len(node.inputs) != 2 or node.inputs[0] == node.inputs[1]:
        return None
    producers, consumers = graph.producers(), graph.consumers()
    outputs = {o.name for o in graph.outputs}
    pair = [producers.get(x) for x in node.inputs]
    if any(p is None or p.op_type not in ("Gemm", "MatMul") for p in pair):
        return None
    p1, p2 = (p for p in pair if p is not None)
    if p1.op_type != p2.op_type or p1.inputs[0] != p2.inputs[0]:
        return None
    if any(p.outputs[0] in outputs or len(consumers.get(p.outputs[0], [])) != 1 for p in (p1, p2)):
        return None
    return {"gemms": [p1, p2], "nodes": [p1, p2, node]}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    p1, p2 = m["gemms"]
    w1, w2 = (graph.constants.get(p.inputs[1]) for p in (p1, p2))
    if w1 is None or w2 is None:
        return "a weight is not a constant"
    if w1.ndim != 2 or w1.shape != w2.shape or w1.dtype != w2.dtype:
        return f"the weights differ in shape or type ({list(w1.shape)}, {list(w2.shape)})"
    out = graph.spec(node.outputs[0]).shape
    if any(graph.spec(p.outputs[0]).shape != out for p in (p1, p2)):
        return "the Add broadcasts a product: not one GEMM's output"
    if p1.op_type == "Gemm":
        for p in (p1, p2):
            if int(p.attrs.get("transA", 0)):
                return "a Gemm with transA"
            if len(p.inputs) > 2 and p.inputs[2] and p.inputs[2] not in graph.constants:
                return "a Gemm's C is not a constant"
        if int(p1.attrs.get("transB", 0)) != int(p2.attrs.get("transB", 0)):
            return "one Gemm transposes its weight and the other does not"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    p1, p2 = m["gemms"]
    dtype = graph.constants[p1.inputs[1]].dtype
    w = np.zeros(graph.constants[p1.inputs[1]].shape, dtype=np.float64)
    c: np.ndarray | None = None
    for p in (p1, p2):
        alpha = float(p.attrs.get("alpha", 1.0)) if p.op_type == "Gemm" else 1.0
        w += alpha * graph.constants[p.inputs[1]].astype(np.float64)
        if p.op_type == "Gemm" and len(p.inputs) > 2 and p.inputs[2]:
            term = float(p.attrs.get("beta", 1.0)) * graph.constants[p.inputs[2]].astype(np.float64)
            c = term if c is None else c + term
    w_name = f"{p1.id}_sum_w"
    operands = [p1.inputs[0], graph.add_constant(w_name, w.astype(dtype), graph.spec(p1.inputs[1]).dtype)]
    attrs: dict[str, Any] = {}
    if p1.op_type == "Gemm":
        attrs = {"transB": int(p1.attrs.get("transB", 0))}
        if c is not None:
            c_name = f"{p1.id}_sum_c"
            operands.append(graph.add_constant(c_name, c.astype(dtype), graph.spec(p1.inputs[1]).dtype))
    label = "+".join(n.name for n in m["nodes"] if n.name)
    new = Node(f"{p1.id}+", p1.op_type, operands, [node.outputs[0]], attrs, label)
    graph.splice(graph.nodes.index(node), [new], {n.id for n in m["nodes"]})


sum_sibling_gemms = Rule(RULE, _match, _check, _rewrite)
