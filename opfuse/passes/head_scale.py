"""A per-head scale of attention scores moves onto the query, so the attention rule sees a plain
MatMul → [mask] → Softmax → MatMul.

Swin V2 (cosine attention: scores times exp(logit_scale), one value per head) and XCiT (scores
times a learned temperature per head) scale the scores by a constant of shape [H, 1, 1]: not the
one number the flash-attention kernel multiplies its scores by, so each block ran two lone batched
MatMuls around a row kernel. The scale is constant along the scores' last two axes, so
(q @ k) * s = (q * s) @ k exactly in real arithmetic; the Mul then joins q's producer (in Swin V2 the
F.normalize row kernel) and the attention rule takes the rest. Only where the product goes on
into a Softmax (through at most one Add, the position bias), and where the scale does not grow
q's shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import FLOAT_TYPES
from opfuse.ir.queries import UseDef
from opfuse.passes.rules import Rule


def _scale_operand(graph: Graph, node: Node) -> int | None:
    """Which input of a Mul (Div: the divisor only) is a constant of more than one element."""
    if node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
        return None
    for i in (1, 0) if node.op_type == "Mul" else (1,):
        c = graph.constants.get(node.inputs[i])
        if c is not None and np.asarray(c).size > 1:
            return i
    return None  # none, or one number: the attention rule takes that as it is


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    """`node`: a Mul (or Div) of a MatMul's product by a constant, on the way to a Softmax."""
    i = _scale_operand(graph, node)  # first: most Muls stop here, before any use-def lookup
    if i is None:
        return None
    ud = UseDef(graph)
    mm = ud.producer(node.inputs[1 - i])
    if mm is None or mm.op_type != "MatMul":
        return None
    nxt = ud.sole_consumer(node.outputs[0])
    if nxt is not None and nxt.op_type == "Add":
        nxt = ud.sole_consumer(nxt.outputs[0])
    if nxt is None or nxt.op_type != "Softmax":
        return None
    return {
        "nodes": [mm, node],
        "matmul": mm,
        "scale": node.inputs[i],
        "sole": ud.sole_consumer(mm.outputs[0]),
    }


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    mm, scale = m["matmul"], m["scale"]
    s = np.asarray(graph.constants[scale])
    q, scores = graph.spec(mm.inputs[0]), graph.spec(mm.outputs[0])
    if m["sole"] is not node:
        return "the product has other readers"
    if q.dtype not in FLOAT_TYPES or not all(isinstance(d, int) for d in (*q.shape, *scores.shape)):
        return "the query is not a float tensor of static shape"
    if s.ndim < 2 or s.shape[-2:] != (1, 1):
        return f"the scale {list(s.shape)} varies along the scores' rows or columns"
    try:
        grown = tuple(np.broadcast_shapes(s.shape, tuple(q.shape))) != tuple(q.shape)
    except ValueError:
        grown = True
    if grown:
        return f"the scale {list(s.shape)} would broadcast the query {list(q.shape)} to a larger shape"
    if not np.all(np.isfinite(s)) or (node.op_type == "Div" and np.any(s == 0)):
        return "the scale is not finite"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    mm, scale = m["matmul"], m["scale"]
    q = mm.inputs[0]
    spec = graph.spec(q)
    scaled = f"{node.id}_query"
    graph.values[scaled] = TensorSpec(scaled, spec.dtype, tuple(spec.shape))
    # The query scaled as the scores were (Mul or Div), in the scaling node's place; the MatMul
    # moves right after it (it reads the scaled query) and writes what the scaling node wrote.
    scaling = Node(node.id, node.op_type, [q, scale], [scaled], dict(node.attrs), node.name)
    graph.nodes[graph.nodes.index(node)] = scaling
    graph.nodes.remove(mm)
    matmul = Node(mm.id, "MatMul", [scaled, mm.inputs[1]], list(node.outputs), {}, mm.name)
    graph.nodes.insert(graph.nodes.index(scaling) + 1, matmul)
    graph.values.pop(mm.outputs[0], None)


head_scale = Rule(names.HEAD_SCALE, _match, _check, _rewrite)
