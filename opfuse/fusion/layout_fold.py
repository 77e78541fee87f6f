"""`layout_views` inside a group: inputs behind Reshape/Transpose/Slice/Split read as strides of
the buffer behind them (the row and pointwise rules apply it to their groups)."""

from __future__ import annotations

from collections.abc import Callable

from opfuse.fusion.groups import Group
from opfuse.fusion.views import VIEW_THROUGH, input_view
from opfuse.graph import Graph
from opfuse.ir.views import StridedView


def fold_layout(
    graph: Graph,
    group: Group,
    claimed: set[str],
    accepts: Callable[[str, StridedView], bool] = lambda x, view: True,
) -> None:
    """Read inputs produced by Reshape/Transpose, and outputs of a Split, straight from the buffer
    behind them (where `accepts` the view, for kernels that address only some views).

    A Split or Slice output (the gate and up halves of a merged projection, say) is a strided view
    of its input; a kernel handed the view would first copy it into a contiguous buffer, so the
    group reads the input at the output's offset instead. Layout nodes whose outputs others read
    too stay in the plan for them (views launch nothing); the rest are the group's own and leave
    the plan."""
    readers = frozenset(n.id for n in group.nodes)
    for x in list(group.inputs):
        if x in graph.constants or x in group.views:
            continue
        view = input_view(graph, x, allow_scale=False, readers=readers)
        own = view.owned()
        # Through a node another group holds (a merged conv's Split, whose parts that group
        # stores as buffers of their own) the buffer behind would be one nobody writes.
        if not view.nodes or any(n.id in claimed for n in view.nodes) or view.base in graph.constants:
            continue
        if any(n.op_type not in VIEW_THROUGH for n in view.nodes) or not accepts(x, view):
            continue
        group.views[x] = view
        group.absorbed += own
        claimed |= {n.id for n in own}
