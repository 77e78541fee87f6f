"""Plan row groups: a reduction grows to take in its pointwise prologue and epilogue.

Starting from each reduction (in topological order), neighbouring nodes join while they live in
the same row space (codegen.rowwise.RowSpace: the reduced input's shape with the same run of
reduced axes, or the same channel groups for GroupNormalization): pointwise ops whose output is the
full shape or the reduced shape, and further reductions over the same space (LayerNorm written out
has two). A join is refused, with its reason, if it would form a cycle through a node outside the
group or exceed the group's caps.
"""

from __future__ import annotations

from opfuse.codegen.pointwise import pointwise_reason
from opfuse.codegen.rowwise import ROW_OPS, RowSpace, row_input_reason, row_op_reason, row_space
from opfuse.fusion.groups import Group, group_boundary, merge_refusal
from opfuse.graph import Graph, Node
from opfuse.passes.rules import NotFired, node_label

ROW_RULE = "row_reduction"


def _join_reason(graph: Graph, node: Node, space: RowSpace) -> tuple[bool, str | None]:
    """(lives in the row space, why it cannot join anyway): a node outside the space is no
    refusal worth reporting; one inside it that still cannot join is."""
    if node.op_type in ROW_OPS:
        return row_op_reason(graph, node) is None and row_space(graph, node) == space, None
    if pointwise_reason(graph, node) is not None:
        return False, None
    out = tuple(graph.spec(node.outputs[0]).shape)
    if out not in space.shapes():
        return False, None
    # Every input must be readable in the row space as ONNX broadcasts it to the output.
    for x in node.inputs:
        why = row_input_reason(graph.spec(x).shape, out, space) if x else None
        if why is not None:
            return True, why
    return True, None


def plan_row_groups(graph: Graph, not_fused: list[NotFired], taken: set[str] | None = None) -> list[Group]:
    order = {n.id: i for i, n in enumerate(graph.nodes)}
    producers = graph.producers()
    consumers = graph.consumers()
    assigned: set[str] = set(taken or ())
    groups: list[Group] = []
    for anchor in graph.nodes:
        if anchor.op_type not in ROW_OPS or anchor.id in assigned:
            continue
        reason = row_op_reason(graph, anchor)
        if reason is not None:
            not_fused.append(NotFired(ROW_RULE, [node_label(anchor)], reason))
            continue
        space = row_space(graph, anchor)
        members = {anchor.id}
        refused: set[str] = set()
        # A cycle may vanish once the nodes between join, so those refusals are retried.
        pending: dict[str, str] = {}
        changed = True
        while changed:
            changed = False
            by_id = {n.id: n for n in graph.nodes if n.id in members}
            neighbours: list[Node] = []
            for m in by_id.values():
                neighbours += [producers[x] for x in m.inputs if x and x in producers]
                neighbours += [c for o in m.outputs if o for c in consumers.get(o, [])]
                # Siblings: other readers of the same activation load it once from this kernel.
                neighbours += [
                    c for x in m.inputs if x and x not in graph.constants for c in consumers.get(x, [])
                ]
            for cand in sorted({n.id: n for n in neighbours}.values(), key=lambda n: order[n.id]):
                if cand.id in members or cand.id in assigned or cand.id in refused:
                    continue
                in_space, why = _join_reason(graph, cand, space)
                if not in_space:
                    continue
                if why is not None:
                    refused.add(cand.id)
                    not_fused.append(NotFired(ROW_RULE, [node_label(anchor), node_label(cand)], why))
                    continue
                merged = members | {cand.id}
                why, is_cycle = merge_refusal(graph, merged, order)
                if why is not None and is_cycle:
                    pending[cand.id] = why
                    continue
                if why is not None:
                    refused.add(cand.id)
                    not_fused.append(NotFired(ROW_RULE, [node_label(anchor), node_label(cand)], why))
                    continue
                members = merged
                pending.pop(cand.id, None)
                changed = True
        by_label = {n.id: n for n in graph.nodes}
        for cid, why in pending.items():
            if cid not in members:
                not_fused.append(NotFired(ROW_RULE, [node_label(anchor), node_label(by_label[cid])], why))
        nodes = [n for n in graph.nodes if n.id in members]
        ins, outs = group_boundary(graph, nodes)
        assigned |= members
        groups.append(
            Group(
                f"r{len(groups)}", "rowwise", ROW_RULE, nodes, ins, outs, full=space.full, split=space.first
            )
        )
    return groups
