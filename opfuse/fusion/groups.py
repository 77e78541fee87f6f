"""Fusion groups and the checks every planner shares (boundary values, cycles, caps)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from opfuse.graph import Graph, Node
from opfuse.passes.rules import node_label

MAX_GROUP_NODES = 32
# Tensors loaded or stored by one kernel: each is a pointer, an index expression and live registers.
MAX_GROUP_TENSORS = 16


@dataclass
class Group:
    id: str
    kind: str  # "pointwise" | "rowwise" | "gemm" | "conv" | "pool" | "chain" | "attention"
    rule: str
    nodes: list[Node]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    full: tuple[int, ...] = ()  # rowwise: the row space (the reduced input's shape)
    split: int = -1  # rowwise: the first reduced axis (dims from it on form one row)
    # Anchor groups: "template" (the anchor's Triton kernel runs the epilogue) or "vendor" (the
    # library kernel, then the epilogue as one kernel right after it).
    variant: str = ""
    note: str = ""
    # attention: the matched pattern the kernel is generated from; chain: where the second anchor
    # stands in `nodes`
    match: Any = None
    # Pointwise: external inputs read through folded Reshape/Transpose ({value: StridedView}) or
    # computed by gather loads from a Resize's input ({value: ResizeGather}), and the layout and
    # Resize nodes that disappear with them.
    views: dict[str, Any] = field(default_factory=dict)
    absorbed: list[Node] = field(default_factory=list)
    # Conv groups: what computes the anchor's input tiles as they are loaded: a per-(image, input
    # channel) scale (squeeze-excitation's x * s), or a depthwise conv or a pool and its
    # activation. Row groups: a depthwise conv computed on the row kernel's tiles.
    prologue: list[Node] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "kind": self.kind,
            "rule": self.rule,
            "nodes": [node_label(n) for n in [*self.prologue, *self.nodes]],
        }
        folded = [node_label(n) for n in self.absorbed if n.op_type != "Resize"]
        if folded:
            d["layout_folded"] = folded
        gathered = [node_label(n) for n in self.absorbed if n.op_type == "Resize"]
        if gathered:
            d["resize_gathered"] = gathered
        if self.variant:
            d["variant"] = self.variant
        if self.note:
            d["note"] = self.note
        return d


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


def creates_cycle(graph: Graph, members: set[str], order: dict[str, int]) -> Node | None:
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


def _quotient_is_acyclic(graph: Graph, groups: list[Group]) -> bool:
    """Whether the plan's steps, each group one step and every other node its own, can be put in
    order: Kahn's algorithm on the graph with each group contracted to one vertex."""
    rep = {n.id: n.id for n in graph.nodes}
    for g in groups:
        for n in (*g.prologue, *g.nodes, *g.absorbed):
            rep[n.id] = f"group:{g.id}"
    producer = {o: n.id for n in graph.nodes for o in n.outputs if o}
    edges: dict[str, set[str]] = {v: set() for v in rep.values()}
    indegree = dict.fromkeys(edges, 0)
    for n in graph.nodes:
        for i in n.inputs:
            p = producer.get(i) if i else None
            if p is None:
                continue
            a, b = rep[p], rep[n.id]
            if a != b and b not in edges[a]:
                edges[a].add(b)
                indegree[b] += 1
    ready = [v for v, d in indegree.items() if d == 0]
    placed = 0
    while ready:
        v = ready.pop()
        placed += 1
        for w in edges[v]:
            indegree[w] -= 1
            if indegree[w] == 0:
                ready.append(w)
    return placed == len(edges)


def without_group_cycles(
    graph: Graph, groups: list[Group]
) -> tuple[list[Group], list[tuple[Group, list[Node]]]]:
    """The groups that can run together, and those left out. Each group is convex on its own (no
    path leaves it and comes back: creates_cycle), yet two can still need each other: A feeds B
    through one node, B feeds A through another (the multi-resolution fuse layers of HRNet, each
    branch's conv epilogue summing the others' outputs). Then no order of kernels exists. The
    groups are taken in plan order; one that would close such a cycle with those taken before it
    keeps the longest head of its nodes that closes none (an anchor and the first ops of its
    epilogue), or is left out. Returned with the kept groups: (the group as planned, the nodes it
    lost). One pass when there is no cycle."""
    if _quotient_is_acyclic(graph, groups):
        return groups, []
    kept: list[Group] = []
    cut: list[tuple[Group, list[Node]]] = []
    for g in groups:
        if _quotient_is_acyclic(graph, [*kept, g]):
            kept.append(g)
            continue
        head = _acyclic_head(graph, kept, g)
        if head is not None:
            kept.append(head)
        cut.append((g, g.nodes[len(head.nodes) :] if head is not None else [*g.prologue, *g.nodes]))
    return kept, cut


def _acyclic_head(graph: Graph, kept: list[Group], g: Group) -> Group | None:
    """The longest head of `g`'s nodes (in graph order, so closed under its own inputs) that
    forms no cycle with `kept`: two nodes at least, nothing folded into it (a head cannot keep
    views or Resizes whose readers it dropped). None where no such head exists."""
    if g.kind not in ("gemm", "conv", "pointwise") or g.views or g.absorbed or g.match is not None:
        return None
    for k in range(len(g.nodes) - 1, 1, -1):
        nodes = g.nodes[:k]
        ins, outs = group_boundary(graph, [*g.prologue, *nodes])
        head = replace(g, nodes=nodes, inputs=ins, outputs=outs)
        if _quotient_is_acyclic(graph, [*kept, head]):
            return head
    return None


def merge_refusal(
    graph: Graph,
    merged: set[str],
    order: dict[str, int],
    max_nodes: int = MAX_GROUP_NODES,
    max_tensors: int = MAX_GROUP_TENSORS,
    fixed_tensors: int = 0,
) -> tuple[str | None, bool]:
    """Why `merged` cannot be one kernel (None if it can), and whether the reason is a cycle (a
    cycle may vanish once the nodes between join; a cap will not). `fixed_tensors` are loads the
    kernel makes anyway (a GEMM's two operands) and do not count against the cap."""
    nodes = [n for n in graph.nodes if n.id in merged]
    ins, outs = group_boundary(graph, nodes)
    if len(merged) > max_nodes:
        return f"would exceed {max_nodes} nodes in one kernel", False
    if len(ins) - fixed_tensors + len(outs) > max_tensors:
        return f"would exceed {max_tensors} tensors loaded or stored by one kernel", False
    through = creates_cycle(graph, merged, order)
    if through is not None:
        return f"merging would create a cycle through {node_label(through)} ({through.op_type})", True
    return None, False
