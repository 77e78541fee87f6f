"""Fold nodes whose inputs are all constants (shape arithmetic above all) at compile time."""

from __future__ import annotations

import numpy as np
import torch

from opfuse.graph import Graph, Node, TensorSpec
from opfuse.runtime.ops import run_op
from opfuse.runtime.tensors import from_numpy, to_numpy

# Results larger than this stay computed at run time rather than bloating the bundle.
MAX_FOLDED_BYTES = 64 * 1024 * 1024


def _shape_constant(graph: Graph, node: Node) -> np.ndarray | None:
    """Shape and Size of a value whose shape is static are constants."""
    if node.op_type not in ("Shape", "Size") or node.inputs[0] not in graph.values:
        return None
    shape = graph.values[node.inputs[0]].shape
    if node.op_type == "Size":
        return np.asarray(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    rank = len(shape)
    start = int(node.attrs.get("start", 0))
    end = int(node.attrs.get("end", rank))
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.asarray(shape[start:end], dtype=np.int64)


def fold_constant_nodes(graph: Graph) -> int:
    folded = 0
    for node in list(graph.nodes):
        shape_value = _shape_constant(graph, node)
        if shape_value is not None:
            out = node.outputs[0]
            graph.constants[out] = shape_value
            graph.values[out] = TensorSpec(out, "int64", tuple(shape_value.shape))
            graph.nodes.remove(node)
            folded += 1
            continue
        inputs = [x for x in node.inputs if x]
        if not all(x in graph.constants for x in inputs):
            continue
        if any(graph.spec(o).numel * 8 > MAX_FOLDED_BYTES for o in node.outputs if o):
            continue
        args: list[torch.Tensor | None] = [from_numpy(graph.constants[x]) if x else None for x in node.inputs]
        with torch.no_grad():
            outs = run_op(node.op_type, args, node.attrs, num_outputs=len(node.outputs))
        for name, value in zip(node.outputs, outs, strict=False):
            if not name:
                continue
            arr = to_numpy(value)
            graph.constants[name] = arr
            graph.values[name] = TensorSpec(name, graph.spec(name).dtype, tuple(arr.shape))
        graph.nodes.remove(node)
        folded += 1
    return folded


def drop_unused_constants(graph: Graph) -> None:
    used = {x for n in graph.nodes for x in n.inputs if x} | {o.name for o in graph.outputs}
    for name in [c for c in graph.constants if c not in used]:
        del graph.constants[name]


def as_array(value: object) -> np.ndarray:
    return np.asarray(value)
