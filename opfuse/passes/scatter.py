"""ScatterND by constant indices is a Where between the data and a Gather of the updates.

A slice assignment in PyTorch (`scores[:, :3, :, w:] = chunk[:, :, :w + 1]`) exports as
ScatterND: the data with the updates written at index tuples the TorchScript exporter computes
from shapes, constants once shapes are static. Longformer-style sliding-window attention builds
its band of scores with six of them a layer, one after the other: each a kernel copying the whole
tensor, then a kernel writing the updates.

With the tuples known, each output element's source is known too: position p takes update
`table[p]` where the tuples hit it (`mask[p]`), the data's element elsewhere. So ScatterND(data,
indices, updates) is Where(mask, Gather(updates with the tuples' axes flattened, table), data):
pointwise, and a Gather by constant indices that a pointwise kernel computes in its loads
(`pad_gather`). A chain of them and what reads the result run as one kernel.

Not rewritten: a reduction other than "none", tuples that hit one element twice (the order of the
writes decides it), and a table of more than MAX_TABLE elements (it is a constant of the plan).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import Rule

# The table and mask have one entry per element of the data's first k dims (k: the tuples'
# length): constants of the plan, so bounded.
MAX_TABLE = 1 << 22


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "ScatterND" or len(node.inputs) < 3 or node.inputs[1] not in graph.constants:
        return None
    return {"nodes": [node]}


def _positions(graph: Graph, node: Node) -> np.ndarray | str:
    """Each update tuple's flat position in the data's first k dims (shape: the indices' without
    the last), or why the node is not rewritten."""
    reduction = node.attrs.get("reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction != "none":
        return f"reduction {reduction!r} combines the updates with the data"
    data = tuple(graph.spec(node.inputs[0]).shape)
    idx = np.asarray(graph.constants[node.inputs[1]])
    if idx.dtype.kind not in "iu" or idx.ndim < 1 or not 1 <= idx.shape[-1] <= len(data):
        return "the indices are not tuples of integers no longer than the data's rank"
    if any(d < 0 for d in data):
        return "the data's shape is not static"
    if idx.size == 0:
        return "no updates"
    k = idx.shape[-1]
    lead = data[:k]
    if int(np.prod(lead, dtype=np.int64)) > MAX_TABLE:
        return f"the scattered dims hold more than {MAX_TABLE} elements (the table would be a constant that size)"
    sizes = np.asarray(lead, dtype=np.int64)
    tuples = idx.astype(np.int64)
    tuples = np.where(tuples < 0, tuples + sizes, tuples)
    if np.any(tuples < 0) or np.any(tuples >= sizes):  # check_indices refused the model already
        return "an index is out of range"
    flat = np.ravel_multi_index(tuple(np.moveaxis(tuples, -1, 0)), lead)
    if len(np.unique(flat)) != flat.size:
        return "two updates write one element (the order of the writes decides it)"
    return np.asarray(flat, dtype=np.int64)


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    flat = _positions(graph, node)
    if isinstance(flat, str):
        return flat
    m["flat"] = flat  # for the rewrite
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    """Reshape the updates (their index axes into one), Gather on axis 0 by the table, and Where
    the mask holds (no Where where the updates cover the data)."""
    flat: np.ndarray = m["flat"]
    data = graph.spec(node.inputs[0])
    k = np.asarray(graph.constants[node.inputs[1]]).shape[-1]
    lead, rest = tuple(data.shape[:k]), tuple(data.shape[k:])
    count = int(np.prod(lead, dtype=np.int64))
    table = np.zeros(count, dtype=np.int64)
    table[flat.ravel()] = np.arange(flat.size, dtype=np.int64)
    hit = np.zeros(count, dtype=bool)
    hit[flat.ravel()] = True
    nodes: list[Node] = []
    src = node.inputs[2]
    if tuple(graph.spec(src).shape) != (flat.size, *rest):
        src = f"{node.id}_updates"
        nodes.append(graph.reshape_node(f"{node.id}u", node.inputs[2], (flat.size, *rest), src, node.name))
    out = node.outputs[0]
    gathered = out if hit.all() else f"{node.id}_gathered"
    graph.values[gathered] = TensorSpec(gathered, data.dtype, tuple(data.shape))
    index = graph.add_constant(f"{node.id}_table", table.reshape(lead), "int64")
    nodes.append(Node(f"{node.id}g", "Gather", [src, index], [gathered], {"axis": 0}, node.name))
    if not hit.all():
        mask = graph.add_constant(f"{node.id}_mask", hit.reshape(lead + (1,) * len(rest)), "bool")
        nodes.append(Node(f"{node.id}w", "Where", [mask, gathered, node.inputs[0]], [out], {}, node.name))
    i = graph.nodes.index(node)
    graph.nodes[i : i + 1] = nodes


scatternd_as_where = Rule(names.SCATTERND_AS_WHERE, _match, _check, _rewrite)
