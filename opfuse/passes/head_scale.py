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
from opfuse.passes.rules import Rule

FLOAT_TYPES = ("float32", "float16", "bfloat16")


def _sole_reader(graph: Graph, value: str) -> Node | None:
    readers = graph.consumers().get(value, [])
    if len(readers) != 1 or value in {o.name for o in graph.outputs}:
        return None
    return readers[0]


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    """`node`: a Mul (or Div) of a MatMul's product by a constant, on the way to a Softmax."""
    if node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
        return None
    producers = graph.producers()
    for i in (0, 1) if node.op_type == "Mul" else (0,):
        mm = producers.get(node.inputs[i])
        scale = node.inputs[1 - i]
        if mm is not None and mm.op_type == "MatMul" and scale in graph.constants:
            if np.asarray(graph.constants[scale]).size == 1:
                return None  # one number: the attention rule takes it as it is
            break
    else:
        return None
    nxt = _sole_reader(graph, node.outputs[0])
    if nxt is not None and nxt.op_type == "Add":
        nxt = _sole_reader(graph, nxt.outputs[0])
    if nxt is None or nxt.op_type != "Softmax":
        return None
    return {"nodes": [mm, node], "matmul": mm, "scale": scale}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    mm, scale = m["matmul"], m["scale"]
    s = np.asarray(graph.constants[scale])
    q, scores = graph.spec(mm.inputs[0]), graph.spec(mm.outputs[0])
    if graph.consumers().get(mm.outputs[0], []) != [node]:
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
    # The query scaled as the scores were: Mul(q, s) or Div(q, s), in the Mul's place.
    graph.nodes[graph.nodes.index(node)] = Node(
        node.id, node.op_type, [q, scale], [scaled], dict(node.attrs), node.name
    )
    # The MatMul moves after it (it reads the scaled query) and writes what the Mul wrote.
    graph.nodes.remove(mm)
    at = graph.nodes.index(next(n for n in graph.nodes if n.id == node.id)) + 1
    graph.nodes.insert(at, Node(mm.id, "MatMul", [scaled, mm.inputs[1]], list(node.outputs), {}, mm.name))
    graph.values.pop(mm.outputs[0], None)


head_scale = Rule(names.HEAD_SCALE, _match, _check, _rewrite)
