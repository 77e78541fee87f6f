"""`attention`: MatMul → [scale, mask] → Softmax → MatMul in one flash-attention kernel.

The pattern (fusion/attention.py) starts at the first MatMul; Q, K and V are read through their
head-split layout ops and the output written through the head merge, so those ops leave the plan
with the score matrix. Refused where the pattern holds something the kernel does not compute, or
where one kernel would form a cycle through a node outside it.
"""

from __future__ import annotations

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.attention import match_attention
from opfuse.fusion.groups import Group, creates_cycle
from opfuse.fusion.rules.base import QUIET, Candidate, FusionRule
from opfuse.ir.queries import UseDef
from opfuse.ir.views import AttentionMatch
from opfuse.passes.rules import node_label


class Attention(FusionRule):
    def match(self) -> Iterator[Candidate]:
        self.order = {n.id: i for i, n in enumerate(self.graph.nodes)}
        self.taken: set[str] = set()
        use = UseDef(self.graph)  # the graph does not change while attention is matched
        for n in self.graph.nodes:
            if n.op_type != "MatMul" or n.id in self.taken:
                continue
            m = match_attention(self.graph, n, use)
            if m is not None:
                yield Candidate(names.ATTENTION, [n], data=m)

    def check(self, c: Candidate) -> str | None:
        m = c.data
        if isinstance(m, str):
            return m  # attention, but not one the kernel computes
        ids = {x.id for x in m.nodes}
        if ids & self.taken:
            return QUIET
        through = creates_cycle(self.graph, ids, self.order)
        if through is not None:
            return f"fusing would create a cycle through {node_label(through)}"
        return None

    def claim(self, c: Candidate) -> None:
        m: AttentionMatch = c.data
        ids = {x.id for x in m.nodes}
        nodes = [x for x in self.graph.nodes if x.id in ids]
        inputs = m.inputs()
        gid = f"a{len(self.state.rows)}"
        group = Group(gid, "attention", names.ATTENTION, nodes, inputs, [m.out.base])
        group.match = m
        self.state.rows.append(group)
        self.taken |= ids

    def finish(self) -> None:
        self.state.in_rows = {n.id for g in self.state.rows for n in g.nodes}


RULE = Attention
