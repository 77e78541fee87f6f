"""Constant indices checked once, at compile time.

Gather, GatherElements, GatherND, ScatterElements and ScatterND take indices in [-n, n-1] on an
axis of size n (negative ones count from the end); anything outside is an error, as onnxruntime
raises it. Where the indices are a constant of the model the compiler knows them: a model with
one out of range is refused here, naming the node, before constant folding or a rewrite (a Gather
of consecutive indices becomes a Slice, which would clamp) could hide it. Indices computed at run
time are checked by the per-op kernels (runtime/ops_index.checked_index).
"""

from __future__ import annotations

import numpy as np

from opfuse.errors import ModelError
from opfuse.graph import Graph, Node
from opfuse.passes.rules import node_label

# op -> how its indices map to the data's axes: "axis" (one axis, the attribute) or "nd" (the
# last dim of the indices holds coordinates into the axes after batch_dims).
INDEXED_OPS = {
    "Gather": "axis",
    "GatherElements": "axis",
    "ScatterElements": "axis",
    "GatherND": "nd",
    "ScatterND": "nd",
}


def _axes(node: Node, shape: tuple[int, ...], indices: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(data axis, the index values into it) for each axis `node` indexes."""
    if INDEXED_OPS[node.op_type] == "axis":
        axis = int(node.attrs.get("axis", 0))
        return [(axis + len(shape) if axis < 0 else axis, indices)]
    first = int(node.attrs.get("batch_dims", 0))
    if indices.ndim == 0:
        return []
    return [(first + i, indices[..., i]) for i in range(indices.shape[-1])]


def check_constant_indices(graph: Graph) -> None:
    """Raise ModelError for a node whose constant indices fall outside its data's range."""
    for node in graph.nodes:
        if node.op_type not in INDEXED_OPS or len(node.inputs) < 2 or node.inputs[1] not in graph.constants:
            continue
        shape = graph.spec(node.inputs[0]).shape
        if not all(isinstance(d, int) for d in shape):
            continue
        indices = np.asarray(graph.constants[node.inputs[1]]).astype(np.int64)
        for axis, values in _axes(node, tuple(shape), indices):
            if not 0 <= axis < len(shape) or values.size == 0:
                continue  # an invalid axis is the op's own error, raised where it runs
            size = int(shape[axis])
            bad = values[(values < -size) | (values >= size)]
            if bad.size:
                raise ModelError(
                    f"node {node_label(node)!r} ({node.op_type}): its constant index {int(bad.reshape(-1)[0])} "
                    f"is out of range for axis {axis} of size {size} of input {node.inputs[0]!r} "
                    f"(valid: {-size} to {size - 1}); onnxruntime refuses to run it too. Fix the "
                    "indices in the model (or the shapes the model was compiled for)"
                )
