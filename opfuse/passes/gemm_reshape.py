"""Reshape → Gemm → Reshape (a linear layer applied to [B, S, K] by flattening) becomes
MatMul + Add on the 3-D tensor, so the bias and what follows fuse into the GEMM's epilogue and
the two reshapes disappear."""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.cleanup import replace_uses
from opfuse.passes.rules import Rule


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Gemm":
        return None
    producers, consumers = graph.producers(), graph.consumers()
    flatten = producers.get(node.inputs[0])
    users = consumers.get(node.outputs[0], [])
    if flatten is None or flatten.op_type != "Reshape" or len(users) != 1 or users[0].op_type != "Reshape":
        return None
    return {"flatten": flatten, "unflatten": users[0], "nodes": [flatten, node, users[0]]}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    flatten, unflatten = m["flatten"], m["unflatten"]
    out = graph.spec(unflatten.outputs[0]).shape
    n = graph.spec(node.outputs[0]).shape[1]
    if int(node.attrs.get("transA", 0)):
        return "Gemm with transA"
    if float(node.attrs.get("alpha", 1.0)) != 1.0 or float(node.attrs.get("beta", 1.0)) != 1.0:
        return "Gemm with alpha or beta other than 1"
    rows = graph.spec(node.inputs[0]).shape[0]
    if len(out) < 2 or out[-1] != n or int(np.prod(out[:-1])) != rows:
        return "the output reshape does not keep the features as its last dim over the same rows"
    if len(graph.consumers().get(flatten.outputs[0], [])) != 1:
        return "the flattened input is also used elsewhere"
    if int(node.attrs.get("transB", 0)) and node.inputs[1] not in graph.constants:
        return "a transposed weight that is not a constant"
    if len(node.inputs) > 2 and node.inputs[2] and graph.spec(node.inputs[2]).shape not in ((n,), (1, n), ()):
        return "the bias is not a vector over the output features"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    flatten, unflatten = m["flatten"], m["unflatten"]
    x = flatten.inputs[0]
    out_shape = graph.spec(unflatten.outputs[0]).shape
    k = graph.spec(node.inputs[0]).shape[1]
    if tuple(graph.spec(x).shape) != (*out_shape[:-1], k):
        # [rows, K] -> [*out[:-1], n] is a row-major unflatten of the rows: the input takes the
        # same leading dims (ViT's attention merges heads [B, S, H, D] -> [B*S, H*D] -> [B, S, E]).
        shaped = f"{node.id}_in"
        view = graph.reshape_node(
            f"{node.id}r", x, (*out_shape[:-1], k), shaped, flatten.name, target=f"{node.id}_in_shape"
        )
        graph.nodes.insert(graph.nodes.index(flatten), view)
        x = shaped
    w = node.inputs[1]
    if int(node.attrs.get("transB", 0)):
        wt = graph.constants[w].T.copy()
        w = f"{node.id}_wT"
        graph.constants[w] = wt
        graph.values[w] = TensorSpec(w, graph.spec(node.inputs[1]).dtype, tuple(wt.shape))
    out = unflatten.outputs[0]
    has_bias = len(node.inputs) > 2 and bool(node.inputs[2])
    mm_out = f"{node.id}_mm" if has_bias else out
    if has_bias:
        graph.values[mm_out] = TensorSpec(mm_out, graph.spec(out).dtype, graph.spec(out).shape)
    i = graph.nodes.index(node)
    new = [Node(f"{node.id}m", "MatMul", [x, w], [mm_out], {}, node.name)]
    if has_bias:
        bias = node.inputs[2]
        if bias in graph.constants and graph.constants[bias].ndim == 2:
            flat = f"{node.id}_bias"
            graph.constants[flat] = np.asarray(graph.constants[bias]).reshape(-1)
            graph.values[flat] = TensorSpec(flat, graph.spec(bias).dtype, (graph.constants[flat].shape[0],))
            bias = flat
        new.append(Node(f"{node.id}b", "Add", [mm_out, bias], [out], {}, node.name))
    graph.nodes[i : i + 1] = new
    graph.nodes.remove(flatten)
    graph.nodes.remove(unflatten)
    replace_uses(graph, unflatten.outputs[0], out)


gemm_to_matmul = Rule(
    names.GEMM_TO_MATMUL,
    _match,
    _check,
    _rewrite,
)
