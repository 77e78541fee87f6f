"""`pointwise`: elementwise ops of one iteration shape in one kernel.

A node joins the groups of its pointwise producers when their iteration shapes agree, the merge
creates no cycle through a node outside the group, and the group stays under the size caps that
keep its live values in registers. Applied inside the groups it forms: `channel_window` (an LRN is
a member like a pointwise op, except that the producer of the input it reads at neighbouring
channels never joins its group), `concat_select` (a Concat is a member that joins no producer's
group: its inputs are loaded), `resize_gather` (a Resize only the group reads is computed by its
loads), `pad_gather` (so is a constant Pad or a Gather by constant indices, through the layout ops
around it) and `layout_views`. One pointwise op alone is one kernel either way: it stays a per-op
kernel. Nodes the row and anchor groups hold are not candidates. Integers and booleans join too
(mask and position-id arithmetic: `ir.ops.MASK_OPS`, exact integer Add/Sub/Mul, Cast, Where),
but an integer value some reader takes as a shape, axes or sizes stays an op.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opfuse.frontend import rule_registry as names
from opfuse.fusion.concat import LONE_COPY_REASON, concat_reason
from opfuse.fusion.groups import Group, group_boundary, merge_refusal
from opfuse.fusion.layout_fold import fold_layout
from opfuse.fusion.pad_gather import plan_pad_gathers
from opfuse.fusion.resize import plan_resize_gathers, resize_alone, resize_reason
from opfuse.fusion.rules.base import QUIET, Candidate, FusionRule
from opfuse.graph import Graph, Node
from opfuse.ir.index_map import IndexMap
from opfuse.ir.ops import FLOAT_TYPES, MASK_OPS, POINTWISE_OPS, WINDOW_OPS, window_input
from opfuse.ir.resize import ResizeGather
from opfuse.ir.support import pointwise_reason, window_reason
from opfuse.passes.rules import NotFired, node_label

POINTWISE_RULE = names.POINTWISE
WINDOW_RULE = names.CHANNEL_WINDOW
CONCAT_SELECT_RULE = names.CONCAT_SELECT
RESIZE_RULE = names.RESIZE_GATHER
PAD_RULE = names.PAD_GATHER
LAYOUT_RULE = names.LAYOUT_VIEWS


# Ops whose inputs past the first are data, as the first is (elementwise ops and lookups); any
# other op reads its later inputs as shapes, axes, sizes or pads, and ConstantOfShape and Range
# read even the first so.
_DATA_INPUTS = frozenset({"Gather", "GatherElements", "GatherND", "Where", "ScatterElements", "ScatterND"})
_SHAPE_FIRST = frozenset({"ConstantOfShape", "Range"})


def _read_as_shape(graph: Graph, node: Node) -> bool:
    """Whether some reader takes the node's (integer) output as a shape, axes or sizes rather
    than as data: such a value must not become a kernel's output on the device."""
    out = node.outputs[0]
    for u in graph.consumers().get(out, []):
        for pos, x in enumerate(u.inputs):
            if x != out:
                continue
            if u.op_type in _SHAPE_FIRST:
                return True
            elementwise = u.op_type in POINTWISE_OPS or u.op_type in MASK_OPS or u.op_type in _DATA_INPUTS
            if pos > 0 and not elementwise:
                return True
    return False


class Pointwise(FusionRule):
    options = (WINDOW_RULE, CONCAT_SELECT_RULE, RESIZE_RULE, PAD_RULE, LAYOUT_RULE)

    def match(self) -> Iterator[Candidate]:
        """Every node no row or anchor group holds, in graph order: each one a kernel could compute
        is eligible; `finish` forms the groups."""
        self.eligible: dict[str, bool] = {}
        held = self.state.held()
        for n in self.graph.nodes:
            if n.id not in held:
                yield Candidate(WINDOW_RULE if n.op_type in WINDOW_OPS else POINTWISE_RULE, [n])

    def check(self, c: Candidate) -> str | None:
        graph, state, n = self.graph, self.state, c.nodes[0]
        if n.op_type == "Concat":
            if not state.on(CONCAT_SELECT_RULE):
                return QUIET
            reason = concat_reason(graph, n)
            if reason is not None:
                state.concat_reasons[n.id] = reason  # said where the Concat stays a copy
                return QUIET
            return None
        if n.op_type in WINDOW_OPS:
            return window_reason(graph, n) if state.on(WINDOW_RULE) else QUIET
        reason = pointwise_reason(graph, n, integers=True)
        if reason is not None and reason.endswith("generates code for"):
            return QUIET  # not an elementwise op at all
        if reason is None and graph.spec(n.outputs[0]).dtype not in FLOAT_TYPES and _read_as_shape(graph, n):
            return "an integer value read as a shape, axes or sizes: it stays on the host's side of the plan"
        return reason

    def claim(self, c: Candidate) -> None:
        self.eligible[c.nodes[0].id] = True

    def finish(self) -> None:
        members = self._merge()
        self._groups(members)

    def _merge(self) -> list[set[str]]:
        """Eligible nodes joined with their producers' groups, in graph order (emptied sets are
        groups merged into a later one)."""
        graph, not_fused, eligible = self.graph, self.state.not_fused, self.eligible
        order = {n.id: i for i, n in enumerate(graph.nodes)}
        producers = graph.producers()
        group_of: dict[str, int] = {}
        members: list[set[str]] = []
        for n in graph.nodes:
            if not eligible.get(n.id):
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
        return members

    def _groups(self, members: list[set[str]]) -> None:
        """The merged sets as groups (Resizes gathered, layout folded); one op alone stays a per-op
        kernel, and a Concat alone of plain tensors the copy."""
        graph, state, not_fused = self.graph, self.state, self.state.not_fused
        groups: list[Group] = state.fused()
        claimed = {n.id for g in groups for n in g.nodes}
        producers, consumers = graph.producers(), graph.consumers()  # the graph is fixed here
        count = 0
        for ids in members:
            if not ids:
                continue
            nodes = [n for n in graph.nodes if n.id in ids]
            ins, outs = group_boundary(graph, nodes)
            gathers: dict[str, Any] = {}
            gathered: list[Node] = []
            lone_concat = len(nodes) == 1 and nodes[0].op_type == "Concat"
            # An LRN loads its input at neighbouring channels from memory: a value it reads that
            # way is written by its producer, not gathered (nor is a Pad's, below).
            windowed = {window_input(n) for n in nodes if n.op_type in WINDOW_OPS}
            concat_reads = {x for n in nodes if n.op_type == "Concat" for x in n.inputs if x}
            if state.on(RESIZE_RULE):
                iteration = tuple(graph.spec(outs[0]).shape)
                # What only Concats read is loaded at its own offsets, so gathered at its own shape.
                selected = concat_reads - {x for n in nodes if n.op_type != "Concat" for x in n.inputs if x}
                gathers, gathered = plan_resize_gathers(
                    graph,
                    set(ids),
                    [x for x in ins if x not in windowed],
                    iteration,
                    claimed,  # the gathered nodes are added
                    not_fused,
                    state.on(LAYOUT_RULE),
                    selected,
                    producers=producers,
                    consumers=consumers,
                )
            if state.on(PAD_RULE):
                # An index map is loaded at its value's own offsets: the kernel's, or those a
                # Concat's selection computes for each of its inputs.
                pads, padded = plan_pad_gathers(
                    graph,
                    set(ids),
                    [x for x in ins if x not in windowed and x not in gathers],
                    claimed,
                    producers,
                    consumers,
                    gathers=True,
                )
                claimed.update(n.id for n in padded)
                gathers = {**gathers, **pads}
                gathered = [*gathered, *padded]
            if len(nodes) == 1 and not gathers and nodes[0].op_type not in WINDOW_OPS and not lone_concat:
                continue  # one pointwise op is one kernel either way: it runs as a per-op kernel
            parts = [POINTWISE_RULE] if any(n.op_type != "Concat" for n in nodes) else []
            parts += [CONCAT_SELECT_RULE] if any(n.op_type == "Concat" for n in nodes) else []
            parts += [RESIZE_RULE] if any(isinstance(v, ResizeGather) for v in gathers.values()) else []
            parts += [PAD_RULE] if any(isinstance(v, IndexMap) for v in gathers.values()) else []
            group = Group(
                f"g{count}", "pointwise", "+".join(parts), nodes, ins, outs, views=gathers, absorbed=gathered
            )
            taken = set(claimed)
            if state.on(LAYOUT_RULE):
                fold_layout(graph, group, taken)
            if lone_concat and not group.views:
                state.concat_reasons[nodes[0].id] = LONE_COPY_REASON
                continue  # a copy of plain tensors is one launch either way: it stays the copy
            claimed |= taken
            groups.append(group)
            count += 1
        if state.on(RESIZE_RULE):
            held = claimed | {n.id for g in groups for n in [*g.prologue, *g.nodes, *g.absorbed]}
            groups += self._lone_resizes(held, count)
        state.pointwise = groups[len(state.fused()) :]

    def _lone_resizes(self, claimed: set[str], count: int) -> list[Group]:
        """Each Resize no kernel gathers, where the gather can compute it, as a kernel of its own
        (its output's gather, written): one launch where the library's resize is a gather, a
        weighing and a sum per axis with float32 copies around them."""
        graph, out = self.graph, list[Group]()
        for n in graph.nodes:
            if n.op_type != "Resize" or n.id in claimed or resize_reason(graph, n) is not None:
                continue
            gather, folded = resize_alone(graph, n, claimed, self.state.on(LAYOUT_RULE))
            claimed.add(n.id)
            x, y = n.inputs[0], n.outputs[0]
            out.append(
                Group(
                    f"g{count + len(out)}",
                    "pointwise",
                    RESIZE_RULE,
                    [n],
                    [x],
                    [y],
                    views={x: gather},
                    absorbed=folded,
                )
            )
        return out


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


RULE = Pointwise
