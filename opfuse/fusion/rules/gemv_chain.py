"""`gemv_chain`: two memory-bound 1x1 convolutions of 1x1 maps back to back in one kernel.

Conv groups of two GEMVs, the first's output read only by the second (squeeze-excitation's MLP),
either of them a conv alone (ResNeSt's split attention: the second GEMV's output goes to a softmax
over the radix, no epilogue), become one "chain" group: two anchors in one kernel, which the rule "never two compute-bound
anchors" allows (their arithmetic intensity is the batch size, far below the ridge point).
docs/design.md ("Adding a fusion rule") walks through this file as the example of a rule.
"""

from __future__ import annotations

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group, group_boundary
from opfuse.fusion.rules.base import Candidate, FusionRule
from opfuse.graph import Graph, Node
from opfuse.ir.ops import CONV_OPS, NHWC_CONV, has_shortcut

CHAIN_RULE = names.GEMV_CHAIN
# Every program along the second product's columns computes the whole hidden vector, reading the
# first weight again (from L2): only for a small first weight and a hidden vector that fits one
# register tile beside the accumulator.
CHAIN_MAX_FIRST_WEIGHT = 65536  # elements
CHAIN_MAX_HIDDEN = 256
CHAIN_MAX_ROWS = 256  # beyond this batch the products are no longer GEMVs


class GemvChain(FusionRule):
    def match(self) -> Iterator[Candidate]:
        """Each conv group whose input is the only output of another, both plain GEMVs; a conv
        alone (state.lone) is a group of one here."""
        graph = self.graph
        groups = [*self.state.anchors, *(g for g in self.state.lone if g.kind == "conv")]
        consumers = graph.consumers()
        outputs = {o.name for o in graph.outputs}
        by_output = {o: g for g in groups for o in g.outputs}
        self.merged: dict[str, Group] = {}  # the second GEMV's group id -> the chain
        self.drop: set[str] = set()
        for g2 in groups:
            second = g2.nodes[0]
            g1 = by_output.get(second.inputs[0])
            if g1 is None or {g1.id, g2.id} & self.drop or not _simple(graph, g1) or not _simple(graph, g2):
                continue
            h = second.inputs[0]
            if g1.outputs != [h] or h in outputs or [c.id for c in consumers.get(h, [])] != [second.id]:
                continue
            yield Candidate(CHAIN_RULE, [g1.nodes[0], second], group=g2, data=g1)

    def check(self, c: Candidate) -> str | None:
        first = c.nodes[0]
        rows = self.graph.spec(first.inputs[0]).shape[0]
        w1 = self.graph.constants[first.inputs[1]]
        if w1.shape[0] > CHAIN_MAX_HIDDEN:
            return f"the hidden vector has {w1.shape[0]} channels (over {CHAIN_MAX_HIDDEN} held in registers)"
        if w1.size > CHAIN_MAX_FIRST_WEIGHT:
            return (
                f"the first weight has {w1.size} elements (over {CHAIN_MAX_FIRST_WEIGHT}), which every "
                "program of the second product would read again"
            )
        if rows > CHAIN_MAX_ROWS:
            return f"{rows} rows: the products are GEMMs, not memory-bound GEMVs"
        return None

    def claim(self, c: Candidate) -> None:
        g1, g2 = c.data, c.group
        assert g2 is not None
        nodes = [*g1.nodes, *g2.nodes]
        ins, outs = group_boundary(self.graph, nodes)
        self.merged[g2.id] = Group(
            "s" + g1.id[1:], "chain", CHAIN_RULE, nodes, ins, outs, variant="template", match=len(g1.nodes)
        )
        self.drop |= {g1.id, g2.id}

    def finish(self) -> None:
        """The chain stands where the second GEMV's group stood (after the anchor groups where
        that was a conv alone); the first's group is gone."""
        groups, state = self.state.anchors, self.state
        state.anchors = [
            self.merged.get(g.id, g) for g in groups if g.id not in self.drop or g.id in self.merged
        ]
        state.anchors += [self.merged[g.id] for g in state.lone if g.id in self.merged]
        state.lone = [g for g in state.lone if g.id not in self.drop]


def gemv(graph: Graph, node: Node) -> bool:
    """A 1x1 convolution of a 1x1 map by a constant weight: a GEMV over channels. NCHW or NHWC
    alike: a [N, C, 1, 1] tensor lies in memory as [N, 1, 1, C] does, and so do the weights."""
    if node.op_type not in CONV_OPS or int(node.attrs.get("group", 1)) != 1 or has_shortcut(node):
        return False
    x, y = graph.spec(node.inputs[0]).shape, graph.spec(node.outputs[0]).shape
    w = graph.constants.get(node.inputs[1])
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    spatial = slice(1, 3) if node.op_type == NHWC_CONV else slice(2, 4)
    return (
        len(x) == 4
        and x[spatial] == (1, 1)
        and y[spatial] == (1, 1)
        and w is not None
        and w.shape[spatial] == (1, 1)
        and (not bias or bias in graph.constants)
    )


def _simple(graph: Graph, g: Group) -> bool:
    """A template conv group of a GEMV whose epilogue reads the accumulator and one-element
    constants only."""
    if g.kind != "conv" or g.variant != "template" or g.prologue or g.views or not gemv(graph, g.nodes[0]):
        return False
    anchor = g.nodes[0]
    own = {anchor.inputs[0], anchor.inputs[1], *anchor.inputs[2:]}
    return all(x in own or (x in graph.constants and graph.constants[x].size == 1) for x in g.inputs)


RULE = GemvChain
