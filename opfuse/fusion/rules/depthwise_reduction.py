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

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import group_boundary
from opfuse.fusion.rules.base import Candidate, FusionRule
from opfuse.ir.ops import NHWC_CONV, ROW_OPS, is_depthwise
from opfuse.ir.rows import row_space

DEPTHWISE_REDUCTION_RULE = names.DEPTHWISE_REDUCTION


class DepthwiseReduction(FusionRule):
    def match(self) -> Iterator[Candidate]:
        """Each row group's input that a lone depthwise conv writes (the first one a group takes)."""
        graph, state = self.graph, self.state
        lone_by_output = {g.outputs[0]: g for g in state.lone if g.kind == "conv" and len(g.outputs) == 1}
        self.gone: set[str] = set()
        for rg in state.rows:
            if rg.kind != "rowwise" or rg.prologue or rg.views:
                continue
            head = next(n for n in rg.nodes if n.op_type in ROW_OPS)
            for x in rg.inputs:
                src = lone_by_output.get(x)
                if src is None or src.id in self.gone:
                    continue
                dw = src.nodes[0]
                if dw.op_type != NHWC_CONV or not is_depthwise(graph, dw):
                    continue
                yield Candidate(DEPTHWISE_REDUCTION_RULE, [dw, head], group=rg, data=(src, x))
                if rg.prologue:
                    break  # claimed: one depthwise conv per row kernel

    def check(self, c: Candidate) -> str | None:
        graph, rg = self.graph, c.group
        assert rg is not None
        dw, head = c.nodes
        x = c.data[1]
        space = row_space(graph, head)
        members = {n.id for n in rg.nodes}
        if len(space.full) != 4 or space.groups or (space.first, space.end) not in ((1, 3), (3, 4)):
            return "the row kernel reduces neither over the depthwise conv's pixels nor its channels"
        if tuple(graph.spec(x).shape) != space.full:
            return "the depthwise conv's output is not the row kernel's full-shaped input"
        if x in {o.name for o in graph.outputs} or any(
            u.id not in members for u in graph.consumers().get(x, [])
        ):
            return "the depthwise conv's output is read outside the row kernel too"
        if any(i not in graph.constants for i in dw.inputs[1:3] if i):
            return "the depthwise conv's weight or bias is not a constant"
        return None

    def claim(self, c: Candidate) -> None:
        rg = c.group
        assert rg is not None
        dw = c.nodes[0]
        rg.prologue = [dw]
        rg.inputs, rg.outputs = group_boundary(self.graph, [dw, *rg.nodes])
        rg.rule = f"{rg.rule}+{DEPTHWISE_REDUCTION_RULE}"
        rg.variant = "template"  # against the split form, where tuning measures
        self.gone.add(c.data[0].id)

    def finish(self) -> None:
        self.state.lone[:] = [g for g in self.state.lone if g.id not in self.gone]


RULE = DepthwiseReduction
