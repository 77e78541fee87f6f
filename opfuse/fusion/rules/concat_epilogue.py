"""`concat_epilogue`: a conv kernel writes the channel Concat its output feeds, in place.

A channel Concat (NHWC, the last axis) whose input is the one output of a conv group, read by
nothing else, joins that group: the kernel stores its result at its channel offset of the
Concat's output and copies the Concat's other inputs into theirs (a block of channels per
program), reading inputs that come through Slice/Transpose from the buffer behind them. The
Concat's copy kernel is gone, and the conv's result is written once, where it belongs:
ShuffleNet's blocks end this way (the branch conv beside the half passed through). Where several
inputs are conv outputs, the last conv in the graph takes the Concat; the others' outputs are
copied like any other input. A lone conv (nothing else to fuse) that takes a Concat joins the
anchor groups.
"""

from __future__ import annotations

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import group_boundary
from opfuse.fusion.rules.base import Candidate, FusionRule
from opfuse.fusion.views import VIEW_THROUGH, input_view
from opfuse.ir.ops import NHWC_CONV

CONCAT_RULE = names.CONCAT_EPILOGUE
# Inputs of a Concat copied by the conv kernel that absorbs it: each is a loop of loads and stores.
CONCAT_MAX_COPIED = 8


class ConcatEpilogue(FusionRule):
    def match(self) -> Iterator[Candidate]:
        """Each channel Concat (4-D, the last axis) that some template NHWC conv group's one
        output feeds alone, with the last such conv in the graph."""
        graph, state = self.graph, self.state
        consumers = graph.consumers()
        graph_outputs = {o.name for o in graph.outputs}
        order = {n.id: i for i, n in enumerate(graph.nodes)}
        by_output = {g.outputs[0]: g for g in [*state.anchors, *state.lone] if len(g.outputs) == 1}
        # Nodes other groups hold, row groups' prologues too (a Concat that gemm_reduction's
        # operand prologue reads in parts): never taken, and views never fold them.
        self.claimed = state.held()
        for cat in graph.nodes:
            if cat.op_type != "Concat" or cat.id in self.claimed:
                continue
            out = graph.spec(cat.outputs[0]).shape
            if len(out) != 4 or int(cat.attrs.get("axis", 0)) % 4 != 3:
                continue
            owners = [
                by_output[x]
                for x in cat.inputs
                if x in by_output
                and by_output[x].kind == "conv"
                and by_output[x].variant == "template"
                and by_output[x].nodes[0].op_type == NHWC_CONV
                and x not in graph_outputs
                and [u.id for u in consumers.get(x, [])] == [cat.id]
                and cat.inputs.count(x) == 1
            ]
            if owners:
                g = max(owners, key=lambda grp: max(order[n.id] for n in grp.nodes))
                yield Candidate(CONCAT_RULE, [g.nodes[0], cat], group=g)

    def check(self, c: Candidate) -> str | None:
        assert c.group is not None
        others = [x for x in c.nodes[1].inputs if x and x != c.group.outputs[0]]
        if len(others) > CONCAT_MAX_COPIED:
            return f"{len(others)} other inputs to copy (over {CONCAT_MAX_COPIED})"
        if any(x in self.graph.constants for x in others):
            return "a constant input: the library's Concat copies it"
        return None

    def claim(self, c: Candidate) -> None:
        graph, g, cat, claimed, state = self.graph, c.group, c.nodes[1], self.claimed, self.state
        assert g is not None
        members = frozenset({cat.id})
        for x in [x for x in cat.inputs if x and x != g.outputs[0]]:
            view = input_view(graph, x, allow_scale=False, readers=members)
            own = view.owned()
            if (
                not view.nodes
                or view.base in graph.constants
                or any(n.op_type not in VIEW_THROUGH for n in view.nodes)
                or any(n.id in claimed for n in view.nodes)
                or len(view.shape) != 4
            ):
                continue
            g.views[x] = view
            g.absorbed += own
            claimed |= {n.id for n in own}
        if any(g is x for x in state.lone):
            state.lone[:] = [x for x in state.lone if x is not g]
            g.note = ""
            state.anchors.append(g)
        g.nodes.append(cat)
        claimed.add(cat.id)
        g.inputs, g.outputs = group_boundary(graph, [*g.prologue, *g.nodes])
        g.rule = f"{g.rule}+{CONCAT_RULE}"


RULE = ConcatEpilogue
