"""Row reductions as the row kernels see them: the (outer, R, inner) space a row op reduces in,
and whether a row kernel computes a node or reads an input (asked by fusion, used by codegen)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import GLOBAL_POOLS, ROW_OPS, ROW_REDUCTIONS
from opfuse.ir.queries import next_pow2
from opfuse.ir.queries import prod as _prod

MAX_ROW = 16384  # a row lives in one program's registers


# Elements of a strided program's R × BLOCK_I tile: the same register budget as a 4096-long row.
TILE = 4096


# A strided reduction whose tile holds fewer adjacent columns than this is left unfused. On the
# H200 (fp16, EfficientNet-B0 b32, channels-last squeeze-excite pooling): 1 column per program over
# 56x56 and 112x112 pixels ran 3.5-5.5x slower than the unfused ops; 4 columns over 28x28 ran
# 1.3x faster.
MIN_TILED_COLUMNS = 4


@dataclass(frozen=True)
class RowSpace:
    """`full` viewed as (outer, R, inner): axes [first, end) are reduced. `groups` > 0 for
    GroupNormalization, whose rows are (n, g) groups of channels instead."""

    full: tuple[int, ...]
    first: int
    end: int
    groups: int = 0

    @property
    def outer(self) -> int:
        return self.full[0] * self.groups if self.groups else _prod(self.full[: self.first])

    @property
    def r(self) -> int:
        return _prod(self.full) // self.outer if self.groups else _prod(self.full[self.first : self.end])

    @property
    def inner(self) -> int:
        return 1 if self.groups else _prod(self.full[self.end :])

    @property
    def keep(self) -> tuple[int, ...]:
        """The reduced shape with keepdims=1."""
        f, a, b = self.full, self.first, self.end
        return (*f[:a], *([1] * (b - a)), *f[b:])

    @property
    def drop(self) -> tuple[int, ...]:
        """The reduced shape with keepdims=0."""
        return (*self.full[: self.first], *self.full[self.end :])

    def shapes(self) -> set[tuple[int, ...]]:
        """Shapes a value in this row space may have: full, or reduced (kept or dropped dims)."""
        return {self.full} if self.groups else {self.full, self.keep, self.drop}

    def load_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A reduced value with dropped dims is indexed as its keepdims twin."""
        shape = tuple(shape)
        return self.keep if shape == self.drop and len(shape) != len(self.full) else shape


def reduced_axes(graph: Graph, node: Node) -> list[int] | None:
    """The axes a row op reduces over (normalized), or None when they are not constant."""
    rank = len(graph.spec(node.inputs[0]).shape)
    if node.op_type in ROW_REDUCTIONS:
        if len(node.inputs) > 1 and node.inputs[1]:
            arr = graph.constants.get(node.inputs[1])
            if arr is None:
                return None
            axes = [int(a) for a in np.asarray(arr).ravel()]
        else:
            axes = [int(a) for a in node.attrs.get("axes", [])]
        if not axes:
            return [] if node.attrs.get("noop_with_empty_axes", 0) else list(range(rank))
        return sorted({a % rank for a in axes})
    if node.op_type in ("LayerNormalization", "RMSNormalization"):
        axis = int(node.attrs.get("axis", -1)) % rank
        return list(range(axis, rank))
    if node.op_type in GLOBAL_POOLS or node.op_type in ("InstanceNormalization", "GroupNormalization"):
        # GroupNormalization reduces over part of the channels too: see RowSpace.groups.
        return list(range(2 if node.op_type != "GroupNormalization" else 1, rank))
    return [int(node.attrs.get("axis", -1)) % rank]


def row_space(graph: Graph, node: Node) -> RowSpace:
    """The row space of a row op that row_op_reason admits."""
    axes = reduced_axes(graph, node)
    assert axes
    full = tuple(graph.spec(node.inputs[0]).shape)
    groups = int(node.attrs["num_groups"]) if node.op_type == "GroupNormalization" else 0
    return RowSpace(full, axes[0], axes[-1] + 1, groups)


def is_item_space(space: RowSpace) -> bool:
    """A reduction over every axis after the first of a rank-3-or-more tensor (a norm over each
    image or item: GroupNorm with one group, a LayerNorm over H, W and C)."""
    return not space.groups and space.inner == 1 and space.first == 1 and len(space.full) >= 3


def row_head(graph: Graph, nodes: list[Node]) -> Node:
    """The row op that sets a row group's space: the one over the most elements. A group's row ops
    share its space, but for a row op over a broadcast of it (a Softmax of one row per item that
    the group's rows all read: row_reduction's `_fold_broadcast_rows`), which each row recomputes."""
    ops = [n for n in nodes if n.op_type in ROW_OPS]
    return max(ops, key=lambda n: int(np.prod(graph.spec(n.inputs[0]).shape, dtype=np.int64)))


def row_split(graph: Graph, node: Node) -> int:
    """The first reduced axis: dims before it index rows (or row blocks)."""
    return row_space(graph, node).first


def _group_norm_reason(graph: Graph, node: Node) -> str | None:
    x = graph.spec(node.inputs[0]).shape
    if "num_groups" not in node.attrs or len(x) < 2:
        return "GroupNormalization without num_groups or channels"
    groups, channels = int(node.attrs["num_groups"]), x[1]
    if groups <= 0 or channels % groups:
        return f"{channels} channels do not split into {groups} groups"
    for p in node.inputs[1:3]:
        if not p or graph.spec(p).shape not in ((groups,), (channels,)):
            return "scale or bias is neither per group nor per channel"
    return None


def row_op_reason(graph: Graph, node: Node) -> str | None:
    """None if `node` is a reduction a row kernel can compute, else why not."""
    if node.op_type not in ROW_OPS:
        return f"{node.op_type} is not a row reduction"
    x = graph.spec(node.inputs[0])
    if x.dtype not in ("float32", "float16", "bfloat16"):
        return f"input of type {x.dtype}"
    if node.op_type == "GroupNormalization" and (why := _group_norm_reason(graph, node)) is not None:
        return why
    axes = reduced_axes(graph, node)
    if axes is None:
        return "the reduction axes are not constant"
    if not axes or axes != list(range(axes[0], axes[-1] + 1)):
        return f"reduces over axes {axes}: row kernels reduce over one contiguous run of axes"
    space = row_space(graph, node)
    if space.r > MAX_ROW:
        return f"a row of {space.r} elements does not fit one program (limit {MAX_ROW})"
    if space.inner > 1 and not space.groups and TILE // next_pow2(space.r) < MIN_TILED_COLUMNS:
        return (
            f"a reduction over {space.r} elements at stride {space.inner} would read fewer than "
            f"{MIN_TILED_COLUMNS} adjacent columns per program (uncoalesced): the library kernel is faster"
        )
    if node.op_type in ("LayerNormalization", "InstanceNormalization", "GroupNormalization") and (
        len([o for o in node.outputs if o]) > 1
    ):
        return f"the extra outputs of {node.op_type} are used"
    if node.op_type in ("LayerNormalization", "RMSNormalization"):
        normalized = tuple(x.shape[axes[0] :])
        for p in node.inputs[1:3]:
            if p and not _broadcasts_to(graph.spec(p).shape, normalized):
                return "scale or bias does not broadcast to the normalized axes"
    return None


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """`shape` broadcasts to `target` (aligned at the right) without growing its rank."""
    if len(shape) > len(target):
        return False
    return all(d in (1, t) for d, t in zip(reversed(shape), reversed(target), strict=False))


def row_input_reason(shape: tuple[int, ...], out: tuple[int, ...], space: RowSpace) -> str | None:
    """None if an input of `shape` to a node with output shape `out` can be read in `space`."""
    shape, out = tuple(shape), tuple(out)
    if space.groups:
        return None  # every shape that broadcasts to [N, C, *S] has an index (_group_input_expr)
    drop, rank = space.drop, len(space.full)
    if out == drop and len(drop) != rank:
        if _prod(shape) != 1 and shape != drop:
            return f"input of shape {list(shape)} does not line up with the reduced shape {list(drop)}"
        return None
    if shape == drop and len(drop) != rank and (1,) * (rank - len(drop)) + drop != space.keep:
        # In registers it is one value per reduced row; ONNX would broadcast it along other axes.
        return f"the reduced value of shape {list(drop)} broadcasts along axes that were not reduced"
    return None
