"""What the plan leaves as copies and Resizes, said once the rules are done: a Concat left in the
plan is a copy (`layout_views`, `concat_select` say why), a Resize the library's op
(`resize_gather`)."""

from __future__ import annotations

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group
from opfuse.fusion.resize import resize_reason
from opfuse.graph import Graph
from opfuse.passes.rules import NotFired, node_label

RESIZE_RULE = names.RESIZE_GATHER
CONCAT_SELECT_RULE = names.CONCAT_SELECT
LAYOUT_RULE = names.LAYOUT_VIEWS


def explain_resizes(graph: Graph, groups: list[Group], not_fused: list[NotFired]) -> None:
    """A Resize left in the plan runs as its own op (the library's): say why no kernel computes
    it, where `resize_gather` has not. (Each Resize the gather can compute is in a group: read
    by one kernel, gathered by it; else a gather kernel of its own.)"""
    in_groups = {n.id for g in groups for n in [*g.prologue, *g.nodes, *g.absorbed]}
    said = {label for r in not_fused if r.rule == RESIZE_RULE for label in r.nodes}
    for n in graph.nodes:
        if n.op_type != "Resize" or n.id in in_groups or node_label(n) in said:
            continue
        reason = resize_reason(graph, n) or "no kernel took it"
        not_fused.append(NotFired(RESIZE_RULE, [node_label(n)], reason))


def explain_concat_copies(
    graph: Graph, groups: list[Group], not_fused: list[NotFired], selection: dict[str, str]
) -> None:
    """A Concat left in the plan is a copy of its inputs (one kernel): say so, and why no view
    replaces it, as for the other layout ops, and why no kernel selects it (`selection`: id ->
    why `concat_select` did not fire)."""
    in_groups = {n.id for g in groups for n in [*g.prologue, *g.nodes, *g.absorbed]}
    for n in graph.nodes:
        if n.op_type != "Concat" or n.id in in_groups:
            continue
        if n.id in selection:
            not_fused.append(NotFired(CONCAT_SELECT_RULE, [node_label(n)], selection[n.id]))
        axis = int(n.attrs.get("axis", 0))
        not_fused.append(
            NotFired(
                LAYOUT_RULE,
                [node_label(n)],
                f"Concat of {len([x for x in n.inputs if x])} inputs along axis {axis} runs as a copy: "
                "the kernels that produce them each write a buffer of their own, and none writes "
                "into its slice of the concatenated one",
            )
        )
