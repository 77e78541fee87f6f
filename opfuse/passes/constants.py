"""Fold nodes whose inputs are all constants (shape arithmetic above all) at compile time."""

from __future__ import annotations

import numpy as np
import torch

from opfuse.graph import Graph, TensorSpec
from opfuse.runtime.ops import run_op
from opfuse.runtime.tensors import from_numpy, to_numpy

# Results larger than this stay computed at run time rather than bloating the bundle.
MAX_FOLDED_BYTES = 64 * 1024 * 1024


def fold_constant_nodes(graph: Graph) -> int:
    folded = 0
    for node in list(graph.nodes):
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
