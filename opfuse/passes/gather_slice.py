"""Gather (or GatherND) by constant consecutive indices is a Slice: a view, not a kernel.

Models that pack projections pick their parts out with Gather (PyTorch's MultiheadAttention
exports q, k and v as `proj[0]`, `proj[1]`, `proj[2]`): a gather kernel each, copying the whole
activation. With the indices known and consecutive, the same values are a Slice along the axis
(then Squeeze for a scalar index, Reshape for a multi-dimensional one), which the runtime
serves as a view and the planners can fold into the addressing of the kernels that read it.
GatherND by index tuples that differ only in their last coordinate, consecutive there (Falcon's
fused QKV picks its key and value heads with `[..., -2, :]` and `[..., -1, :]`, exported as
GatherND of one tuple), is the same: a Slice over the tuples' axes, then a Reshape.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import Rule

MAX_INDICES = 64


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type not in ("Gather", "GatherND") or len(node.inputs) < 2:
        return None
    if node.inputs[1] not in graph.constants:
        return None
    return {"nodes": [node]}


def _nd_window(graph: Graph, node: Node) -> tuple[list[int], list[int]] | str:
    """GatherND by constant index tuples that share all but their last coordinate, whose last
    coordinates are consecutive: (the first tuple, the count), the window of a Slice over the
    tuples' axes; else why not."""
    if int(node.attrs.get("batch_dims", 0)):
        return "batch_dims is not 0"
    data = graph.spec(node.inputs[0]).shape
    idx = np.asarray(graph.constants[node.inputs[1]])
    if idx.dtype.kind not in "iu":
        return "indices are not integers"
    if idx.ndim < 1 or not 1 <= idx.shape[-1] <= len(data):
        return "index tuples longer than the data's rank"
    tuples = idx.reshape(-1, idx.shape[-1]).astype(np.int64)
    sizes = np.asarray(data[: idx.shape[-1]], dtype=np.int64)
    tuples = np.where(tuples < 0, tuples + sizes, tuples)
    if not len(tuples) or len(tuples) > MAX_INDICES:
        return f"{len(tuples)} index tuples (a slice is made of 1 to {MAX_INDICES})"
    if np.any(tuples < 0) or np.any(tuples >= sizes):
        return "an index is out of range"
    first = [int(v) for v in tuples[0]]
    if np.any(tuples[:, :-1] != tuples[0, :-1]) or list(tuples[:, -1]) != list(
        range(first[-1], first[-1] + len(tuples))
    ):
        return "the index tuples are not consecutive along one axis"
    return first, [len(tuples)]


def _picked(graph: Graph, node: Node) -> tuple[int, list[int], int]:
    data = graph.spec(node.inputs[0]).shape
    axis = int(node.attrs.get("axis", 0)) % max(1, len(data))
    size = data[axis] if data else 0
    idx = np.asarray(graph.constants[node.inputs[1]]).reshape(-1)
    return axis, [int(i) + size if int(i) < 0 else int(i) for i in idx], size


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if node.op_type == "GatherND":
        window = _nd_window(graph, node)
        return window if isinstance(window, str) else None
    if np.asarray(graph.constants[node.inputs[1]]).dtype.kind not in "iu":
        return "indices are not integers"
    if not graph.spec(node.inputs[0]).shape:
        return "the data is a scalar"
    axis, picked, size = _picked(graph, node)
    if not picked or len(picked) > MAX_INDICES:
        return f"{len(picked)} indices (a slice is made of 1 to {MAX_INDICES})"
    if picked != list(range(picked[0], picked[0] + len(picked))):
        return "the indices are not consecutive"
    if picked[0] < 0 or picked[-1] >= size:
        return f"an index is out of range for axis {axis} of size {size}"
    return None


def _constant(graph: Graph, name: str, values: list[int]) -> str:
    graph.constants[name] = np.asarray(values, dtype=np.int64)
    graph.values[name] = TensorSpec(name, "int64", (len(values),))
    return name


def _rewrite_nd(graph: Graph, node: Node) -> None:
    """GatherND: a Slice of one element along each tuple axis but the last, the run along the
    last, then a Reshape to the output's shape."""
    window = _nd_window(graph, node)
    assert not isinstance(window, str)
    first, (count,) = window
    data = graph.spec(node.inputs[0])
    k = len(first)
    ends = [v + 1 for v in first[:-1]] + [first[-1] + count]
    sliced = f"{node.id}_slice"
    graph.values[sliced] = TensorSpec(sliced, data.dtype, (*([1] * (k - 1)), count, *data.shape[k:]))
    args = [
        node.inputs[0],
        _constant(graph, f"{node.id}_starts", first),
        _constant(graph, f"{node.id}_ends", ends),
        _constant(graph, f"{node.id}_axes", list(range(k))),
    ]
    shape = _constant(graph, f"{node.id}_shape", list(graph.spec(node.outputs[0]).shape))
    i = graph.nodes.index(node)
    graph.nodes[i : i + 1] = [
        Node(f"{node.id}s", "Slice", args, [sliced], {}, node.name),
        Node(f"{node.id}r", "Reshape", [sliced, shape], [node.outputs[0]], {}, node.name),
    ]


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    if node.op_type == "GatherND":
        _rewrite_nd(graph, node)
        return
    axis, picked, _ = _picked(graph, node)
    data = graph.spec(node.inputs[0])
    out = node.outputs[0]
    sliced_shape = tuple(len(picked) if d == axis else s for d, s in enumerate(data.shape))
    idx_shape = np.asarray(graph.constants[node.inputs[1]]).shape
    start, end = picked[0], picked[-1] + 1
    nodes = []
    slice_out = out
    if idx_shape != (len(picked),):  # a scalar or multi-dimensional index: reshape the slice after
        slice_out = f"{node.id}_slice"
        graph.values[slice_out] = TensorSpec(slice_out, data.dtype, sliced_shape)
    args = [
        node.inputs[0],
        _constant(graph, f"{node.id}_starts", [start]),
        _constant(graph, f"{node.id}_ends", [end]),
        _constant(graph, f"{node.id}_axes", [axis]),
    ]
    nodes.append(Node(f"{node.id}s", "Slice", args, [slice_out], {}, node.name))
    if slice_out != out:
        shape = _constant(graph, f"{node.id}_shape", list(graph.spec(out).shape))
        nodes.append(Node(f"{node.id}r", "Reshape", [slice_out, shape], [out], {}, node.name))
    i = graph.nodes.index(node)
    graph.nodes[i : i + 1] = nodes


gather_to_slice = Rule(
    names.GATHER_TO_SLICE,
    _match,
    _check,
    _rewrite,
)
