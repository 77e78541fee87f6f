"""Group connected pointwise nodes into kernels, greedily in topological order.

A node joins the groups of its pointwise producers when their iteration shapes agree, the merge
creates no cycle through a node outside the group, and the group stays under the size caps that
keep its live values in registers. Every refusal is recorded with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opfuse.codegen.pointwise import pointwise_reason
from opfuse.graph import Graph, Node
from opfuse.passes.rules import NotFired, node_label

POINTWISE_RULE = "pointwise"
MAX_GROUP_NODES = 32
# Tensors loaded or stored by one kernel: each is a pointer, an index expression and live registers.
MAX_GROUP_TENSORS = 16


@dataclass
class Group:
    id: str
    kind: str
    rule: str
    nodes: list[Node]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "rule": self.rule,
            "nodes": [node_label(n) for n in self.nodes],
        }


@dataclass
class FusionPlan:
    groups: list[Group]
    not_fused: list[NotFired]


def group_boundary(graph: Graph, nodes: list[Node]) -> tuple[list[str], list[str]]:
    """External inputs (in first-use order) and the values a group must write."""
    produced = {o for n in nodes for o in n.outputs if o}
    inputs: list[str] = []
    for n in nodes:
        for x in n.inputs:
            if x and x not in produced and x not in inputs:
                inputs.append(x)
    member_ids = {n.id for n in nodes}
    consumers = graph.consumers()
    graph_outputs = {o.name for o in graph.outputs}
    outputs = [
        o
        for n in nodes
        for o in n.outputs
        if o and (o in graph_outputs or any(c.id not in member_ids for c in consumers.get(o, [])))
    ]
    return inputs, outputs


def _creates_cycle(graph: Graph, members: set[str], order: dict[str, int]) -> Node | None:
    """A node outside `members` that is both fed by and feeds the group, if any."""
    consumers = graph.consumers()
    by_id = {n.id: n for n in graph.nodes}
    last = max(order[m] for m in members)
    frontier = [
        c for m in members for o in by_id[m].outputs if o for c in consumers.get(o, []) if c.id not in members
    ]
    seen: set[str] = set()
    while frontier:
        n = frontier.pop()
        if n.id in seen or order[n.id] > last:
            continue
        seen.add(n.id)
        for o in n.outputs:
            for c in consumers.get(o, []) if o else []:
                if c.id in members:
                    return n
                frontier.append(c)
    return None


def plan_fusion(graph: Graph, disabled: set[str] | frozenset[str] = frozenset()) -> FusionPlan:
    not_fused: list[NotFired] = []
    if POINTWISE_RULE in disabled:
        return FusionPlan([], not_fused)
    order = {n.id: i for i, n in enumerate(graph.nodes)}
    producers = graph.producers()
    eligible: dict[str, bool] = {}
    for n in graph.nodes:
        reason = pointwise_reason(graph, n)
        eligible[n.id] = reason is None
        if reason is not None and not reason.endswith("generates code for"):
            not_fused.append(NotFired(POINTWISE_RULE, [node_label(n)], reason))
    group_of: dict[str, int] = {}
    members: list[set[str]] = []
    for n in graph.nodes:
        if not eligible[n.id]:
            continue
        mine = {n.id}
        shape = graph.spec(n.outputs[0]).shape
        candidates: list[int] = []
        for x in n.inputs:
            p = producers.get(x) if x else None
            if p is None or not eligible.get(p.id) or p.id not in group_of:
                continue
            if graph.spec(p.outputs[0]).shape != shape:
                not_fused.append(
                    NotFired(
                        POINTWISE_RULE,
                        [node_label(p), node_label(n)],
                        "different iteration shapes (a broadcast result is larger than its input)",
                    )
                )
                continue
            if group_of[p.id] not in candidates:
                candidates.append(group_of[p.id])
        for gi in candidates:
            merged = mine | members[gi]
            by_id = {m.id: m for m in graph.nodes if m.id in merged}
            ins, outs = group_boundary(graph, list(by_id.values()))
            reason = None
            if len(merged) > MAX_GROUP_NODES:
                reason = f"would exceed {MAX_GROUP_NODES} nodes in one kernel"
            elif len(ins) + len(outs) > MAX_GROUP_TENSORS:
                reason = f"would exceed {MAX_GROUP_TENSORS} tensors loaded or stored by one kernel"
            else:
                through = _creates_cycle(graph, merged, order)
                if through is not None:
                    reason = f"merging would create a cycle through {node_label(through)} ({through.op_type})"
            if reason is not None:
                labels = [*[node_label(m) for m in graph.nodes if m.id in members[gi]][:3], node_label(n)]
                not_fused.append(NotFired(POINTWISE_RULE, labels, reason))
                continue
            mine = merged
            members[gi] = set()
        idx = len(members)
        members.append(mine)
        for m in mine:
            group_of[m] = idx
    groups: list[Group] = []
    for ids in members:
        if not ids:
            continue
        nodes = [n for n in graph.nodes if n.id in ids]
        if len(nodes) == 1:
            continue  # one pointwise op is one kernel either way: it runs as a per-op kernel
        ins, outs = group_boundary(graph, nodes)
        groups.append(Group(f"g{len(groups)}", "pointwise", POINTWISE_RULE, nodes, ins, outs))
    return FusionPlan(groups, not_fused)
