"""Fold an inference BatchNormalization into the Conv that feeds it (new weights and bias)."""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.cleanup import replace_uses
from opfuse.passes.rules import Rule


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "BatchNormalization":
        return None
    conv = graph.producers().get(node.inputs[0])
    if conv is None or conv.op_type != "Conv":
        return None
    return {"conv": conv, "nodes": [conv, node]}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    conv: Node = m["conv"]
    if len([o for o in node.outputs if o]) > 1:
        return "BatchNormalization is in training mode (it has running-statistics outputs)"
    if any(name and name not in graph.constants for name in node.inputs[1:5]):
        return "scale, bias, mean or variance is not a constant"
    if conv.inputs[1] not in graph.constants:
        return "the Conv weight is not a constant"
    if len(conv.inputs) > 2 and conv.inputs[2] and conv.inputs[2] not in graph.constants:
        return "the Conv bias is not a constant"
    if len(graph.consumers().get(conv.outputs[0], [])) != 1:
        return "the Conv output is also used elsewhere, so it must stay un-normalized"
    if conv.outputs[0] in {o.name for o in graph.outputs}:
        return "the Conv output is a graph output"
    w = graph.constants[conv.inputs[1]]
    if graph.constants[node.inputs[1]].shape != (w.shape[0],):
        return "the normalization parameters do not match the Conv's output channels"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    conv: Node = m["conv"]
    eps = float(node.attrs.get("epsilon", 1e-5))
    scale, bias, mean, var = (graph.constants[n].astype(np.float64) for n in node.inputs[1:5])
    w = graph.constants[conv.inputs[1]]
    has_bias = len(conv.inputs) > 2 and bool(conv.inputs[2])
    b = graph.constants[conv.inputs[2]].astype(np.float64) if has_bias else np.zeros(w.shape[0])
    factor = scale / np.sqrt(var + eps)
    new_w = (w.astype(np.float64) * factor.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
    new_b = ((b - mean) * factor + bias).astype(w.dtype)
    w_name, b_name = f"{conv.id}_bnfold_w", f"{conv.id}_bnfold_b"
    graph.constants[w_name] = new_w
    graph.constants[b_name] = new_b
    graph.values[w_name] = TensorSpec(w_name, graph.values[conv.inputs[1]].dtype, tuple(new_w.shape))
    graph.values[b_name] = TensorSpec(b_name, graph.values[conv.inputs[1]].dtype, tuple(new_b.shape))
    conv.inputs = [conv.inputs[0], w_name, b_name]
    conv.name = f"{conv.name}+{node.name}" if conv.name and node.name else (conv.name or node.name)
    graph.nodes.remove(node)
    # The BN's output keeps its name (it may be a graph output): the Conv now writes it.
    old_out = conv.outputs[0]
    conv.outputs = [node.outputs[0]]
    replace_uses(graph, old_out, node.outputs[0])


fold_batchnorm = Rule(
    names.FOLD_BATCHNORM,
    _match,
    _check,
    _rewrite,
)


def _match_affine(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "BatchNormalization":
        return None
    return {"nodes": [node]}


def _check_affine(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if len([o for o in node.outputs if o]) > 1:
        return "BatchNormalization is in training mode (it has running-statistics outputs)"
    if any(name and name not in graph.constants for name in node.inputs[1:5]):
        return "scale, bias, mean or variance is not a constant"
    if len(graph.spec(node.inputs[0]).shape) < 2:
        return "input has no channel axis"
    return None


def _rewrite_affine(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    x = graph.spec(node.inputs[0])
    eps = float(node.attrs.get("epsilon", 1e-5))
    scale, bias, mean, var = (graph.constants[n].astype(np.float64) for n in node.inputs[1:5])
    a = scale / np.sqrt(var + eps)
    b = bias - mean * a
    # Channels are axis 1: shape the per-channel constants [C, 1, ..., 1] so they broadcast there.
    cshape = (x.shape[1],) + (1,) * (len(x.shape) - 2)
    dtype = graph.constants[node.inputs[1]].dtype
    a_name, b_name, mid = f"{node.id}_bn_a", f"{node.id}_bn_b", f"{node.id}_bn_scaled"
    graph.constants[a_name] = a.reshape(cshape).astype(dtype)
    graph.constants[b_name] = b.reshape(cshape).astype(dtype)
    graph.values[a_name] = TensorSpec(a_name, graph.values[node.inputs[1]].dtype, cshape)
    graph.values[b_name] = TensorSpec(b_name, graph.values[node.inputs[1]].dtype, cshape)
    graph.values[mid] = TensorSpec(mid, x.dtype, x.shape)
    i = graph.nodes.index(node)
    mul = Node(f"{node.id}a", "Mul", [node.inputs[0], a_name], [mid], {}, node.name)
    add = Node(f"{node.id}b", "Add", [mid, b_name], [node.outputs[0]], {}, node.name)
    graph.nodes[i : i + 1] = [mul, add]


batchnorm_to_affine = Rule(
    names.BATCHNORM_TO_AFFINE,
    _match_affine,
    _check_affine,
    _rewrite_affine,
)
