"""Gather by constant consecutive indices is a Slice: a view, not a kernel.

Models that pack projections pick their parts out with Gather (PyTorch's MultiheadAttention
exports q, k and v as `proj[0]`, `proj[1]`, `proj[2]`): a gather kernel each, copying the whole
activation. With the indices known and consecutive, the same values are a Slice along the axis
(then Squeeze for a scalar index, Reshape for a multi-dimensional one), which the runtime
serves as a view and the planners can fold into the addressing of the kernels that read it.

GatherND by constant index tuples (`gathernd_as_gather`, first) is a Gather of the data with the
tuples' axes flattened into one (a Reshape, a view) by the tuples' flat positions: one spelling
for what follows. Falcon's fused QKV picks its key and value heads with `[..., -2, :]` and
`[..., -1, :]`, exported as GatherND of one tuple: a Gather of one position, so a Slice.

Indices of several dims that step evenly along each (an affine grid, `start + sum(step_i * j_i)`)
whose steps nest (sorted, each the next one's step times its count: an unfold's patches, `[[0, 2,
4, 6], [1, 3, 5, 7]]` for 2x2 patches of 8 pixels) pick a strided window of the axis in another
order: a Slice, a Reshape of the axis into the grid's dims by decreasing step, and a Transpose
back into the indices' order, all views a kernel can read through.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import Rule


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Gather" or len(node.inputs) < 2:
        return None
    if node.inputs[1] not in graph.constants:
        return None
    return {"nodes": [node]}


# Indices of an affine grid (several dims) may pick a whole axis: an image's rows or columns.
MAX_GRID_INDICES = 1 << 16


@dataclass(frozen=True)
class Grid:
    """Indices `start + sum(steps[i] * j_i)` over the index dims `dims`, whose non-unit dims
    nest by decreasing step: the window `start, start + step, ...` of `count` positions, read
    as dims `order` (index dims by decreasing step) and transposed back."""

    start: int
    step: int  # the innermost (smallest) step
    count: int
    order: tuple[int, ...]  # index dims of more than one element, by decreasing step
    dims: tuple[int, ...]  # the index array's shape


def affine_grid(idx: np.ndarray) -> Grid | str:
    """The nested affine grid `idx` (non-negative) is, or why it is not one."""
    if idx.ndim < 1 or idx.size < 2:
        return "fewer than two indices"
    start = int(idx.reshape(-1)[0])
    steps = [
        int(idx[(0,) * d + (1,) + (0,) * (idx.ndim - d - 1)]) - start if n > 1 else 0
        for d, n in enumerate(idx.shape)
    ]
    grid = start + sum(
        (np.arange(n, dtype=np.int64) * st).reshape([n if k == d else 1 for k in range(idx.ndim)])
        for d, (n, st) in enumerate(zip(idx.shape, steps, strict=True))
    )
    if not np.array_equal(np.broadcast_to(grid, idx.shape), idx):
        return "the indices are not an even step along each of their dims"
    order = sorted((d for d, n in enumerate(idx.shape) if n > 1), key=lambda d: -steps[d])
    if any(steps[d] < 1 for d in order):
        return "the indices do not increase along each of their dims"
    for outer, inner in itertools.pairwise(order):
        if steps[outer] != steps[inner] * idx.shape[inner]:
            return "the steps of the indices' dims do not nest (the picked positions overlap or leave gaps)"
    return Grid(start, steps[order[-1]], int(idx.size), tuple(order), tuple(idx.shape))


def _picked(graph: Graph, node: Node) -> tuple[int, list[int], int]:
    data = graph.spec(node.inputs[0]).shape
    axis = int(node.attrs.get("axis", 0)) % max(1, len(data))
    size = data[axis] if data else 0
    idx = np.asarray(graph.constants[node.inputs[1]]).reshape(-1)
    return axis, [int(i) + size if int(i) < 0 else int(i) for i in idx], size


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if np.asarray(graph.constants[node.inputs[1]]).dtype.kind not in "iu":
        return "indices are not integers"
    if not graph.spec(node.inputs[0]).shape:
        return "the data is a scalar"
    axis, picked, size = _picked(graph, node)
    if not picked or len(picked) > MAX_GRID_INDICES:
        return f"{len(picked)} indices (a slice is made of 1 to {MAX_GRID_INDICES})"
    if min(picked) < 0 or max(picked) >= size:
        return f"an index is out of range for axis {axis} of size {size}"
    if _consecutive(picked):
        return None
    grid = _grid(graph, node)
    return grid if isinstance(grid, str) else None


def _consecutive(picked: list[int]) -> bool:
    """One run of consecutive indices: a Slice (then a Reshape to the indices' shape)."""
    return picked == list(range(picked[0], picked[0] + len(picked)))


def _grid(graph: Graph, node: Node) -> Grid | str:
    _, picked, _ = _picked(graph, node)
    idx = np.asarray(picked, dtype=np.int64).reshape(np.asarray(graph.constants[node.inputs[1]]).shape)
    if idx.ndim == 1:  # one dim: consecutive (above) or a strided run
        grid = affine_grid(idx)
        return "the indices are not consecutive" if isinstance(grid, str) else grid
    return affine_grid(idx)


def _constant(graph: Graph, name: str, values: list[int]) -> str:
    graph.constants[name] = np.asarray(values, dtype=np.int64)
    graph.values[name] = TensorSpec(name, "int64", (len(values),))
    return name


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    axis, picked, _ = _picked(graph, node)
    if not _consecutive(picked):
        _rewrite_grid(graph, node, axis)
        return
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


def _rewrite_grid(graph: Graph, node: Node, axis: int) -> None:
    """Slice (the grid's window, by its innermost step), Reshape (the axis into the grid's dims
    by decreasing step), Transpose (into the indices' order), Reshape (the output's shape)."""
    grid = _grid(graph, node)
    assert not isinstance(grid, str)
    data = graph.spec(node.inputs[0])
    out = graph.spec(node.outputs[0])
    lead, rest = tuple(data.shape[:axis]), tuple(data.shape[axis + 1 :])
    nodes: list[Node] = []

    def value(suffix: str, shape: tuple[int, ...]) -> str:
        name = f"{node.id}_{suffix}"
        graph.values[name] = TensorSpec(name, data.dtype, shape)
        return name

    cur = node.inputs[0]
    end = grid.start + grid.step * (grid.count - 1) + 1
    if (grid.start, end, grid.step) != (0, data.shape[axis], 1):
        sliced = value("slice", (*lead, grid.count, *rest))
        args = [
            cur,
            *(
                _constant(graph, f"{node.id}_{k}", [v])
                for k, v in (("starts", grid.start), ("ends", end), ("axes", axis), ("steps", grid.step))
            ),
        ]
        nodes.append(Node(f"{node.id}s", "Slice", args, [sliced], {}, node.name))
        cur = sliced
    split = tuple(grid.dims[d] for d in grid.order)
    if len(split) > 1:
        shaped = value("split", (*lead, *split, *rest))
        shape = _constant(graph, f"{node.id}_split_shape", list((*lead, *split, *rest)))
        nodes.append(Node(f"{node.id}r", "Reshape", [cur, shape], [shaped], {}, node.name))
        cur = shaped
        kept = sorted(grid.order)  # the index dims of more than one element, in the indices' order
        inner = [axis + grid.order.index(d) for d in kept]
        perm = [*range(axis), *inner, *range(axis + len(split), len(lead) + len(split) + len(rest))]
        if perm != sorted(perm):
            moved = value("perm", tuple((*lead, *split, *rest)[p] for p in perm))
            nodes.append(Node(f"{node.id}t", "Transpose", [cur], [moved], {"perm": perm}, node.name))
            cur = moved
    if nodes and graph.spec(cur).shape == out.shape:  # the last node writes the Gather's output
        del graph.values[cur]
        nodes[-1].outputs = [node.outputs[0]]
    else:
        shape = _constant(graph, f"{node.id}_shape", list(out.shape))
        nodes.append(Node(f"{node.id}o", "Reshape", [cur, shape], [node.outputs[0]], {}, node.name))
    i = graph.nodes.index(node)
    graph.nodes[i : i + 1] = nodes


def _nd_match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "GatherND" or len(node.inputs) < 2 or node.inputs[1] not in graph.constants:
        return None
    return {"nodes": [node]}


def _nd_tuples(graph: Graph, node: Node) -> np.ndarray | str:
    """The GatherND's index tuples ([..., k], non-negative), or why it is not rewritten."""
    if int(node.attrs.get("batch_dims", 0)):
        return "batch_dims is not 0"
    data = graph.spec(node.inputs[0]).shape
    idx = np.asarray(graph.constants[node.inputs[1]])
    if idx.dtype.kind not in "iu":
        return "indices are not integers"
    if idx.ndim < 1 or not 1 <= idx.shape[-1] <= len(data):
        return "index tuples longer than the data's rank"
    if any(d < 0 for d in data):
        return "the data's shape is not static"
    sizes = np.asarray(data[: idx.shape[-1]], dtype=np.int64)
    tuples = idx.astype(np.int64)
    tuples = np.where(tuples < 0, tuples + sizes, tuples)
    if np.any(tuples < 0) or np.any(tuples >= sizes):  # check_indices refused the model already
        return "an index is out of range"
    return tuples


def _nd_check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    tuples = _nd_tuples(graph, node)
    return tuples if isinstance(tuples, str) else None


def _nd_rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    """Reshape (the tuples' k axes into one, where k > 1), then Gather on axis 0 by each tuple's
    flat position in those axes."""
    tuples = _nd_tuples(graph, node)
    assert not isinstance(tuples, str)
    data = graph.spec(node.inputs[0])
    k = tuples.shape[-1]
    lead, rest = tuple(data.shape[:k]), tuple(data.shape[k:])
    flat = np.ravel_multi_index(tuple(np.moveaxis(tuples, -1, 0)), lead).astype(np.int64)
    index = f"{node.id}_index"
    graph.constants[index] = np.asarray(flat, dtype=np.int64).reshape(tuples.shape[:-1])
    graph.values[index] = TensorSpec(index, "int64", tuple(tuples.shape[:-1]))
    nodes: list[Node] = []
    src = node.inputs[0]
    if k > 1:
        src = f"{node.id}_flat"
        graph.values[src] = TensorSpec(src, data.dtype, (int(np.prod(lead)), *rest))
        shape = _constant(graph, f"{node.id}_flat_shape", [int(np.prod(lead)), *rest])
        nodes.append(Node(f"{node.id}f", "Reshape", [node.inputs[0], shape], [src], {}, node.name))
    nodes.append(Node(f"{node.id}g", "Gather", [src, index], [node.outputs[0]], {"axis": 0}, node.name))
    i = graph.nodes.index(node)
    graph.nodes[i : i + 1] = nodes


gathernd_as_gather = Rule(
    names.GATHERND_AS_GATHER,
    _nd_match,
    _nd_check,
    _nd_rewrite,
)

gather_to_slice = Rule(
    names.GATHER_TO_SLICE,
    _match,
    _check,
    _rewrite,
)
