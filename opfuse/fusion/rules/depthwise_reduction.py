"""`depthwise_reduction`: a depthwise conv (or a pool) computed on the tiles of the row kernel
that reduces its output.

A depthwise conv (NHWC) read only by a row kernel that reduces over the conv's pixels
(squeeze-excitation's pooling, with the activation between) or over its channels (ConvNeXt's
LayerNorm after its 7x7 depthwise conv) is computed on that kernel's tiles: the depthwise conv and
the reduction in one launch, and the conv's output never written. Such a conv has nothing else to
fuse (a lone anchor, which runs as the library kernel without this rule); tuning times the group
against that split form. A conv whose input is a channel Concat that only it reads (RDNet's dense
features, the Concat of every earlier block's output) reads each channel from the Concat input that
holds it: the Concat, a copy of its own otherwise, joins the prologue (`concat_select` on).

A row kernel over each image (a one-group GroupNorm, which the channels-last pass writes as a
LayerNorm over H, W and C: one row per image) takes such a conv as well, and an NHWC max or
average pool in its place, a window op with no weights (`PoolTaps`: the maximum, or the average
divided as the pool's own kernel divides): PoolFormer's token mixer `pool(y) - y`, scaled and
added to the residual stream, runs in the kernel of the norm after it. Not a pool on a strided
tile (a mean over the pixels of a pool is rare enough to leave written).
"""

from __future__ import annotations

from opfuse.frontend import rule_registry as names
from opfuse.fusion.concat import concat_reason
from opfuse.fusion.groups import group_boundary
from opfuse.fusion.rules.base import Candidate, RowPrologueRule
from opfuse.fusion.views import VIEW_THROUGH
from opfuse.graph import Node
from opfuse.ir.ops import NHWC_CONV, NHWC_POOLS, is_depthwise
from opfuse.ir.rows import row_space
from opfuse.ir.support import pool_reason

MAX_PARTS = 16  # Concat inputs a tap is loaded from: a masked load each

DEPTHWISE_REDUCTION_RULE = names.DEPTHWISE_REDUCTION


class DepthwiseReduction(RowPrologueRule):
    rule = DEPTHWISE_REDUCTION_RULE
    kinds = ("conv", "pool")

    def takes(self, anchor: Node) -> bool:
        if anchor.op_type in NHWC_POOLS.values():
            return pool_reason(self.graph, anchor) is None
        return anchor.op_type == NHWC_CONV and is_depthwise(self.graph, anchor)

    def check(self, c: Candidate) -> str | None:
        graph, rg = self.graph, c.group
        assert rg is not None
        dw, head = c.nodes
        x = c.data[1]
        space = row_space(graph, head)
        pool = dw.op_type in NHWC_POOLS.values()
        layouts = ((3, 4), (1, 4)) if pool else ((1, 3), (3, 4), (1, 4))
        if len(space.full) != 4 or space.groups or (space.first, space.end) not in layouts:
            if pool and (space.first, space.end) == (1, 3):
                return "the row kernel reduces over the pool's pixels (a pool of a pool)"
            return "the row kernel reduces over neither the window's pixels, its channels nor each image"
        what = "pool" if pool else "depthwise conv"
        if tuple(graph.spec(x).shape) != space.full:
            return f"the {what}'s output is not the row kernel's full-shaped input"
        if self.read_outside(x, rg):
            return f"the {what}'s output is read outside the row kernel too"
        if not pool and any(i not in graph.constants for i in dw.inputs[1:3] if i):
            return "the depthwise conv's weight or bias is not a constant"
        return None

    def claim(self, c: Candidate) -> None:
        super().claim(c)
        rg = c.group
        assert rg is not None
        concat = self._channel_concat(c.nodes[0])
        if concat is not None:
            rg.prologue = [concat, *rg.prologue]
            rg.inputs, rg.outputs = group_boundary(self.graph, [*rg.prologue, *rg.nodes])
            rg.rule = f"{rg.rule}+{names.CONCAT_SELECT}"

    def _channel_concat(self, dw: Node) -> Node | None:
        """The channel Concat (NHWC, axis 3) the conv reads, where only the conv reads it and no
        group holds it; else None."""
        graph, state = self.graph, self.state
        if not state.on(names.CONCAT_SELECT):
            return None
        producers, held = self.producers, state.held()
        concat = producers.get(dw.inputs[0])
        if concat is None or concat.op_type != "Concat" or concat.id in held:  # written in place
            return None
        out = concat.outputs[0]
        if out in {o.name for o in graph.outputs} or [u.id for u in self.consumers.get(out, [])] != [dw.id]:
            return None
        parts = [x for x in concat.inputs if x]
        shape = graph.spec(out).shape
        if len(shape) != 4 or int(concat.attrs.get("axis", 0)) % 4 != 3 or len(parts) > MAX_PARTS:
            return None
        if concat_reason(graph, concat) is not None or any(x in graph.constants for x in parts):
            return None
        for x in parts:
            p = producers.get(x)
            if p is None or (p.op_type in VIEW_THROUGH and p.id not in held):
                return None  # a graph input, or a view: a copy to make contiguous before the launch
        return concat


RULE = DepthwiseReduction
