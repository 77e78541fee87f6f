"""The fusion planner: row groups around reductions first, then pointwise groups.

Pointwise: a node joins the groups of its pointwise producers when their iteration shapes agree,
the merge creates no cycle through a node outside the group, and the group stays under the size
caps that keep its live values in registers. A window op (LRN) is a member like a pointwise op,
except that the producer of the input it reads at neighbouring channels never joins its group. A
Concat is a member that joins no producer's group (`concat_select`: its inputs are loaded).
Every refusal is recorded with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.fusion.anchors import (
    CHAIN_RULE,
    CONCAT_RULE,
    CONV_RULE,
    DEPTHWISE_REDUCTION_RULE,
    DEPTHWISE_RULE,
    GEMM_RULE,
    PAD_RULE,
    POOL_PROLOGUE_RULE,
    POOL_RULE,
    POOLED_GEMM_RULE,
    chain_gemv_groups,
    concat_epilogues,
    depthwise_reductions,
    plan_anchor_groups,
    pooled_gemms,
    window_prologues,
)
from opfuse.fusion.attention import ATTENTION_RULE, plan_attention_groups
from opfuse.fusion.concat import CONCAT_SELECT_RULE, LONE_COPY_REASON, concat_reason
from opfuse.fusion.groups import Group, group_boundary, merge_refusal
from opfuse.fusion.resize import RESIZE_RULE, plan_resize_gathers, resize_reason
from opfuse.fusion.rowwise import ROW_RULE, plan_row_groups
from opfuse.fusion.views import VIEW_THROUGH, input_view
from opfuse.graph import Graph, Node
from opfuse.ir.ops import ROW_OPS, WINDOW_OPS, window_input
from opfuse.ir.queries import contiguous_strides
from opfuse.ir.rows import row_space
from opfuse.ir.support import pointwise_reason, window_reason
from opfuse.ir.views import StridedView
from opfuse.passes.rules import NotFired, node_label

POINTWISE_RULE = names.POINTWISE
WINDOW_RULE = names.CHANNEL_WINDOW
LAYOUT_RULE = names.LAYOUT_VIEWS
RULES = (
    ATTENTION_RULE,
    ROW_RULE,
    GEMM_RULE,
    CONV_RULE,
    CHAIN_RULE,
    DEPTHWISE_RULE,
    POOL_PROLOGUE_RULE,
    PAD_RULE,
    DEPTHWISE_REDUCTION_RULE,
    CONCAT_RULE,
    POOLED_GEMM_RULE,
    POINTWISE_RULE,
    WINDOW_RULE,
    CONCAT_SELECT_RULE,
    RESIZE_RULE,
    LAYOUT_RULE,
)

__all__ = [
    "ATTENTION_RULE",
    "CHAIN_RULE",
    "CONCAT_RULE",
    "CONCAT_SELECT_RULE",
    "CONV_RULE",
    "DEPTHWISE_REDUCTION_RULE",
    "DEPTHWISE_RULE",
    "GEMM_RULE",
    "PAD_RULE",
    "POINTWISE_RULE",
    "POOLED_GEMM_RULE",
    "POOL_PROLOGUE_RULE",
    "POOL_RULE",
    "RESIZE_RULE",
    "ROW_RULE",
    "RULES",
    "WINDOW_RULE",
    "FusionPlan",
    "Group",
    "plan_fusion",
]


@dataclass
class FusionPlan:
    groups: list[Group]
    not_fused: list[NotFired]
    # Anchors with nothing to fuse but a template of their own: the library kernel runs them unless
    # tuning measures the template faster (compiler._tune adds those to `groups`).
    lone: list[Group] = field(default_factory=list)


@dataclass
class PlanState:
    """What the fusion rules share while they claim nodes, in the order they run: each rule reads
    what the ones before it claimed and adds its groups (or grows theirs)."""

    graph: Graph
    disabled: frozenset[str]
    not_fused: list[NotFired] = field(default_factory=list)
    # Attention, then row groups (rules after them may add a prologue or take one away).
    rows: list[Group] = field(default_factory=list)
    anchors: list[Group] = field(default_factory=list)  # GEMM, conv and pool groups
    lone: list[Group] = field(default_factory=list)
    pointwise: list[Group] = field(default_factory=list)
    # Nodes the row kernels (and attention) hold: no anchor takes them.
    in_rows: set[str] = field(default_factory=set)
    # Concats `concat_select` matched but did not take (id -> why), said where they stay copies.
    concat_reasons: dict[str, str] = field(default_factory=dict)

    def on(self, name: str) -> bool:
        return names.enabled(name, self.disabled)

    def fused(self) -> list[Group]:
        return [*self.rows, *self.anchors]


@dataclass(frozen=True)
class FusionRule:
    """A planner rule: the registry names it implements (it runs when one of them is on), and the
    claim that adds its groups to the plan. `options`: registry names the claim reads itself (a
    rule applied inside another's groups)."""

    names: tuple[str, ...]
    claim: Callable[[PlanState], None]
    options: tuple[str, ...] = ()


def _attention(state: PlanState) -> None:
    attention, matches = plan_attention_groups(state.graph, state.not_fused)
    for g in attention:
        g.match = matches[g.id]
    state.rows = attention
    state.in_rows = {n.id for g in attention for n in g.nodes}


def _rows(state: PlanState) -> None:
    graph = state.graph
    row_groups = plan_row_groups(graph, state.not_fused, state.in_rows, state.on(CONCAT_SELECT_RULE))
    claimed_by_rows: set[str] = set(state.in_rows) | {n.id for g in row_groups for n in g.nodes}
    for g in row_groups:
        if any(n.op_type == "Concat" for n in g.nodes):
            _select_row_concat(graph, g, claimed_by_rows, state.not_fused, state.disabled)
    if state.on(LAYOUT_RULE):
        for g in row_groups:
            _fold_row_layout(graph, g, claimed_by_rows)
    state.in_rows |= {n.id for g in row_groups for n in [*g.nodes, *g.absorbed]}
    state.rows = state.rows + row_groups


def _anchors(state: PlanState) -> None:
    state.anchors = plan_anchor_groups(
        state.graph, set(state.in_rows), state.not_fused, state.disabled, state.lone
    )


def _window_prologues(state: PlanState) -> None:
    state.anchors = window_prologues(state.graph, state.anchors, state.lone, state.not_fused, state.disabled)


def _gemv_chains(state: PlanState) -> None:
    state.anchors = chain_gemv_groups(state.graph, state.anchors, state.not_fused)


def _depthwise_reductions(state: PlanState) -> None:
    depthwise_reductions(state.graph, state.rows, state.lone, state.not_fused)


def _concat_epilogues(state: PlanState) -> None:
    held = state.in_rows | {n.id for g in state.anchors for n in [*g.prologue, *g.nodes, *g.absorbed]}
    concat_epilogues(state.graph, state.anchors, state.lone, state.not_fused, held)


def _pooled_gemms(state: PlanState) -> None:
    pooled_gemms(state.graph, state.rows, state.anchors, state.lone, state.not_fused)


def _pointwise(state: PlanState) -> None:
    graph, not_fused, concat_reasons = state.graph, state.not_fused, state.concat_reasons
    in_rows = state.in_rows | {n.id for g in state.fused() for n in [*g.prologue, *g.nodes, *g.absorbed]}
    order = {n.id: i for i, n in enumerate(graph.nodes)}
    producers = graph.producers()
    eligible: dict[str, bool] = {}
    for n in graph.nodes:
        if n.id in in_rows:
            eligible[n.id] = False
            continue
        if n.op_type == "Concat":
            reason = None if not state.on(CONCAT_SELECT_RULE) else concat_reason(graph, n)
            eligible[n.id] = state.on(CONCAT_SELECT_RULE) and reason is None
            if reason is not None:
                concat_reasons[n.id] = reason
            continue
        if n.op_type in WINDOW_OPS:
            if not state.on(WINDOW_RULE):
                eligible[n.id] = False
                continue
            reason = window_reason(graph, n)
            eligible[n.id] = reason is None
            if reason is not None:
                not_fused.append(NotFired(WINDOW_RULE, [node_label(n)], reason))
            continue
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
        # A Concat loads its inputs (at offsets of their own): no producer joins its group.
        for x in [] if n.op_type == "Concat" else n.inputs:
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
            reason, _ = merge_refusal(graph, merged, order)
            if reason is None:
                reason = _window_refusal(graph, merged, producers)
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
    groups: list[Group] = state.fused()
    claimed = {n.id for g in groups for n in g.nodes}
    count = 0
    for ids in members:
        if not ids:
            continue
        nodes = [n for n in graph.nodes if n.id in ids]
        ins, outs = group_boundary(graph, nodes)
        gathers: dict[str, Any] = {}
        gathered: list[Node] = []
        lone_concat = len(nodes) == 1 and nodes[0].op_type == "Concat"
        if state.on(RESIZE_RULE):
            iteration = tuple(graph.spec(outs[0]).shape)
            # An LRN loads its input at neighbouring channels from memory: a resized value it
            # reads that way is written by the Resize, not gathered.
            windowed = {window_input(n) for n in nodes if n.op_type in WINDOW_OPS}
            # What only Concats read is loaded at its own offsets, so gathered at its own shape.
            selected = {x for n in nodes if n.op_type == "Concat" for x in n.inputs if x} - {
                x for n in nodes if n.op_type != "Concat" for x in n.inputs if x
            }
            gathers, gathered = plan_resize_gathers(
                graph,
                set(ids),
                [x for x in ins if x not in windowed],
                iteration,
                claimed,
                not_fused,
                state.on(LAYOUT_RULE),
                selected,
            )
        if len(nodes) == 1 and not gathers and nodes[0].op_type not in WINDOW_OPS and not lone_concat:
            continue  # one pointwise op is one kernel either way: it runs as a per-op kernel
        parts = [POINTWISE_RULE] if any(n.op_type != "Concat" for n in nodes) else []
        parts += [CONCAT_SELECT_RULE] if any(n.op_type == "Concat" for n in nodes) else []
        parts += [RESIZE_RULE] if gathers else []
        group = Group(
            f"g{count}", "pointwise", "+".join(parts), nodes, ins, outs, views=gathers, absorbed=gathered
        )
        taken = set(claimed)
        if state.on(LAYOUT_RULE):
            _fold_layout(graph, group, taken)
        if lone_concat and not group.views:
            concat_reasons[nodes[0].id] = LONE_COPY_REASON
            continue  # a copy of plain tensors is one launch either way: it stays the copy
        claimed |= taken
        groups.append(group)
        count += 1
    state.pointwise = groups[len(state.fused()) :]


# The planner's rules in the order they claim nodes (the registry's order where they are listed
# once each; the anchor rules share one pass over the graph, and their groups one numbering).
FUSION_RULES: tuple[FusionRule, ...] = (
    FusionRule((ATTENTION_RULE,), _attention),
    FusionRule((ROW_RULE,), _rows, options=(CONCAT_SELECT_RULE, RESIZE_RULE, LAYOUT_RULE)),
    FusionRule((GEMM_RULE, CONV_RULE, POOL_RULE), _anchors, options=(PAD_RULE, LAYOUT_RULE)),
    FusionRule((DEPTHWISE_RULE, POOL_PROLOGUE_RULE), _window_prologues),
    FusionRule((CHAIN_RULE,), _gemv_chains),
    FusionRule((DEPTHWISE_REDUCTION_RULE,), _depthwise_reductions),
    FusionRule((CONCAT_RULE,), _concat_epilogues),
    FusionRule((POOLED_GEMM_RULE,), _pooled_gemms),
    FusionRule(
        (POINTWISE_RULE,), _pointwise, options=(WINDOW_RULE, CONCAT_SELECT_RULE, RESIZE_RULE, LAYOUT_RULE)
    ),
)


def plan_fusion(graph: Graph, disabled: set[str] | frozenset[str] = frozenset()) -> FusionPlan:
    """Each fusion rule that is on claims its groups, in order; then the copies and Resizes left
    in the plan are explained."""
    state = PlanState(graph, frozenset(disabled))
    for rule in FUSION_RULES:
        if any(state.on(name) for name in rule.names):
            rule.claim(state)
    groups = [*state.fused(), *state.pointwise]
    if state.on(LAYOUT_RULE):
        _explain_concat_copies(graph, groups, state.not_fused, state.concat_reasons)
    if state.on(RESIZE_RULE):
        _explain_resizes(graph, groups, state.not_fused)
    return FusionPlan(groups, state.not_fused, state.lone)


def _window_refusal(graph: Graph, merged: set[str], producers: dict[str, Node]) -> str | None:
    """Why a group cannot hold both a window op and the producer of the value it reads at
    neighbouring channels (None if it does not): the neighbours are loaded from memory, so that
    value must be written by another kernel before this one runs."""
    for n in graph.nodes:
        if n.id in merged and n.op_type in WINDOW_OPS:
            p = producers.get(window_input(n))
            if p is not None and p.id in merged:
                return (
                    f"{n.op_type} reads its input at neighbouring channels, so that input is loaded "
                    "from memory, not computed in the same kernel"
                )
    return None


def _explain_resizes(graph: Graph, groups: list[Group], not_fused: list[NotFired]) -> None:
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


def _explain_concat_copies(
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


def _select_row_concat(
    graph: Graph,
    group: Group,
    claimed: set[str],
    not_fused: list[NotFired],
    disabled: set[str] | frozenset[str],
) -> None:
    """A row group holding a Concat (`concat_select`: a normalization's input) reads the Concat's
    inputs as a pointwise kernel would: Resizes only it reads by gather loads (`resize_gather`),
    values behind layout ops from the buffer behind them (`layout_views`)."""
    ids = {n.id for n in group.nodes}
    selected = {x for n in group.nodes if n.op_type == "Concat" for x in n.inputs if x} - {
        x for n in group.nodes if n.op_type != "Concat" for x in n.inputs if x
    }
    parts = [group.rule, CONCAT_SELECT_RULE]
    if RESIZE_RULE not in disabled:
        values = [x for x in group.inputs if x in selected]
        gathers, gathered = plan_resize_gathers(
            graph, ids, values, (), claimed, not_fused, LAYOUT_RULE not in disabled, selected
        )
        group.views.update(gathers)
        group.absorbed += gathered
        parts += [RESIZE_RULE] if gathers else []
    if LAYOUT_RULE not in disabled:
        _fold_layout(graph, group, claimed, lambda x, view: x in selected)
    group.rule = "+".join(parts)


def _fold_row_layout(graph: Graph, group: Group, claimed: set[str]) -> None:
    """A row kernel's full-shaped input reached through layout ops that keep each row contiguous
    (a seq-first attention output transposed back to batch-first before its residual LayerNorm)
    is read from the buffer behind them: rows at their strides, each row as it lies."""
    space = row_space(graph, next(n for n in group.nodes if n.op_type in ROW_OPS))
    if space.inner > 1 or space.groups:
        return  # rows strided or grouped: their own addressing
    full = tuple(group.full)
    k = len(full) - 1 if group.split is None else group.split
    if not full or k <= 0 or int(np.prod(full[k:], dtype=np.int64)) <= 1:
        return
    trailing = contiguous_strides(full)[k:]
    _fold_layout(
        graph,
        group,
        claimed,
        # Full-shaped, and each row lying contiguously, as the kernel reads it.
        lambda x, view: tuple(graph.spec(x).shape) == full and tuple(view.strides[k:]) == trailing,
    )


def _fold_layout(
    graph: Graph,
    group: Group,
    claimed: set[str],
    accepts: Callable[[str, StridedView], bool] = lambda x, view: True,
) -> None:
    """Read inputs produced by Reshape/Transpose, and outputs of a Split, straight from the buffer
    behind them (where `accepts` the view, for kernels that address only some views).

    A Split or Slice output (the gate and up halves of a merged projection, say) is a strided view
    of its input; a kernel handed the view would first copy it into a contiguous buffer, so the
    group reads the input at the output's offset instead. Layout nodes whose outputs others read
    too stay in the plan for them (views launch nothing); the rest are the group's own and leave
    the plan."""
    readers = frozenset(n.id for n in group.nodes)
    for x in list(group.inputs):
        if x in graph.constants or x in group.views:
            continue
        view = input_view(graph, x, allow_scale=False, readers=readers)
        own = view.owned()
        # Through a node another group holds (a merged conv's Split, whose parts that group
        # stores as buffers of their own) the buffer behind would be one nobody writes.
        if not view.nodes or any(n.id in claimed for n in view.nodes) or view.base in graph.constants:
            continue
        if any(n.op_type not in VIEW_THROUGH for n in view.nodes) or not accepts(x, view):
            continue
        group.views[x] = view
        group.absorbed += own
        claimed |= {n.id for n in own}
