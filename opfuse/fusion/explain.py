"""What the plan leaves as copies and Resizes, said once the rules are done: a Concat left in the
plan is a copy (`layout_views`, `concat_select` say why), a Resize its own op (`resize_gather`)."""

from __future__ import annotations

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group
from opfuse.fusion.resize import resize_reason
from opfuse.graph import Graph
from opfuse.ir.ops import WINDOW_OPS, window_input
from opfuse.passes.rules import NotFired, node_label

RESIZE_RULE = names.RESIZE_GATHER
CONCAT_SELECT_RULE = names.CONCAT_SELECT
LAYOUT_RULE = names.LAYOUT_VIEWS


def explain_resizes(graph: Graph, groups: list[Group], not_fused: list[NotFired]) -> None:
    """A Resize left in the plan runs as its own op: say why, where `resize_gather` has not."""
    in_groups = {n.id for g in groups for n in [*g.prologue, *g.nodes, *g.absorbed]}
    said = {label for r in not_fused if r.rule == RESIZE_RULE for label in r.nodes}
    graph_outputs = {o.name for o in graph.outputs}
    consumers = graph.consumers()
    for n in graph.nodes:
        if n.op_type != "Resize" or n.id in in_groups or node_label(n) in said:
            continue
        reason = resize_reason(graph, n)
        windowed = [
            c
            for c in consumers.get(n.outputs[0], [])
            if c.op_type in WINDOW_OPS and window_input(c) == n.outputs[0]
        ]
        if reason is None and windowed:
            reason = f"{windowed[0].op_type} reads its output at neighbouring channels, loaded from memory"
        elif reason is None:
            readers = sorted({c.op_type for c in consumers.get(n.outputs[0], [])})
            reason = (
                "its output is a graph output"
                if n.outputs[0] in graph_outputs
                else f"its output is read by {', '.join(readers)}, not only by one generated pointwise kernel"
            )
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
