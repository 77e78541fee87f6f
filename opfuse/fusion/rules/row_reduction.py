"""Plan row groups: a reduction grows to take in its pointwise prologue and epilogue.

Starting from each reduction (in topological order), neighbouring nodes join while they live in
the same row space (codegen.rowwise.RowSpace: the reduced input's shape with the same run of
reduced axes, or the same channel groups for GroupNormalization): pointwise ops whose output is the
full shape or the reduced shape, and further reductions over the same space (LayerNorm written out
has two). A join is refused, with its reason, if it would form a cycle through a node outside the
group or exceed the group's caps. A normalization's full-shaped input may be a Concat
(`concat_select`): the row kernel loads each element of its rows from the Concat input that holds
it, so the Concat joins too (its inputs, of other shapes, are kernel inputs).
"""

from __future__ import annotations

from opfuse.frontend import rule_registry as names
from opfuse.fusion.concat import CONCAT_SELECT_RULE, concat_reason
from opfuse.fusion.groups import Group, group_boundary, merge_refusal
from opfuse.graph import Graph, Node
from opfuse.ir.ops import ROW_OPS
from opfuse.ir.rows import RowSpace, row_input_reason, row_op_reason, row_space
from opfuse.ir.support import pointwise_reason
from opfuse.passes.rules import NotFired, node_label

ROW_RULE = names.ROW_REDUCTION
# Row ops whose full-shaped input a Concat may be: rows of (n, c) or (n, g), each contiguous
# (never strided columns), so the kernel's offsets into the Concat's output are `row * R + cols`.
CONCAT_ANCHORS = ("GroupNormalization", "InstanceNormalization")


def _join_reason(graph: Graph, node: Node, space: RowSpace, concats: bool = False) -> tuple[bool, str | None]:
    """(lives in the row space, why it cannot join anyway): a node outside the space is no
    refusal worth reporting; one inside it that still cannot join is. `concats`: whether a
    Concat of the full shape may join (`concat_select` on, a normalization's space)."""
    if node.op_type == "Concat":
        # A Concat no kernel can select is said so where it stays a copy (planner).
        if (
            not concats
            or tuple(graph.spec(node.outputs[0]).shape) != space.full
            or concat_reason(graph, node)
        ):
            return False, None
        if any(tuple(graph.spec(x).shape) in space.shapes() for x in node.inputs if x):
            return True, "a Concat input has a shape of the row space: the group could compute it"
        return True, None
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


def plan_row_groups(
    graph: Graph, not_fused: list[NotFired], taken: set[str] | None = None, concats: bool = False
) -> list[Group]:
    """Row groups around each reduction. `concats`: a normalization's full-shaped input may be a
    Concat the kernel selects from its inputs (`concat_select`)."""
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
                in_space, why = _join_reason(graph, cand, space, concats and anchor.op_type in CONCAT_ANCHORS)
                if not in_space:
                    continue
                if why is not None:
                    refused.add(cand.id)
                    rule = CONCAT_SELECT_RULE if cand.op_type == "Concat" else ROW_RULE
                    not_fused.append(NotFired(rule, [node_label(anchor), node_label(cand)], why))
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
