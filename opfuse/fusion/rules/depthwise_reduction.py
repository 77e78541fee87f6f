"""`depthwise_reduction`: a depthwise conv computed on the tiles of the row kernel that reduces
its output.

A depthwise conv (NHWC) read only by a row kernel that reduces over the conv's pixels
(squeeze-excitation's pooling, with the activation between) or over its channels (ConvNeXt's
LayerNorm after its 7x7 depthwise conv) is computed on that kernel's tiles: the depthwise conv and
the reduction in one launch, and the conv's output never written. Such a conv has nothing else to
fuse (a lone anchor, which runs as the library kernel without this rule); tuning times the group
against that split form.
"""

from __future__ import annotations

from opfuse.frontend import rule_registry as names
from opfuse.fusion.rules.base import Candidate, RowPrologueRule
from opfuse.graph import Node
from opfuse.ir.ops import NHWC_CONV, is_depthwise
from opfuse.ir.rows import row_space

DEPTHWISE_REDUCTION_RULE = names.DEPTHWISE_REDUCTION


class DepthwiseReduction(RowPrologueRule):
    rule = DEPTHWISE_REDUCTION_RULE
    kind = "conv"

    def takes(self, anchor: Node) -> bool:
        return anchor.op_type == NHWC_CONV and is_depthwise(self.graph, anchor)

    def check(self, c: Candidate) -> str | None:
        graph, rg = self.graph, c.group
        assert rg is not None
        dw, head = c.nodes
        x = c.data[1]
        space = row_space(graph, head)
        if len(space.full) != 4 or space.groups or (space.first, space.end) not in ((1, 3), (3, 4)):
            return "the row kernel reduces neither over the depthwise conv's pixels nor its channels"
        if tuple(graph.spec(x).shape) != space.full:
            return "the depthwise conv's output is not the row kernel's full-shaped input"
        if self.read_outside(x, rg):
            return "the depthwise conv's output is read outside the row kernel too"
        if any(i not in graph.constants for i in dw.inputs[1:3] if i):
            return "the depthwise conv's weight or bias is not a constant"
        return None


RULE = DepthwiseReduction
