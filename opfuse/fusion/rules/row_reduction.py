"""`row_reduction`: a reduction grows to take in its pointwise prologue and epilogue.

Starting from each reduction (in topological order), neighbouring nodes join while they live in
the same row space (codegen.rowwise.RowSpace: the reduced input's shape with the same run of
reduced axes, or the same channel groups for GroupNormalization): pointwise ops whose output is the
full shape or the reduced shape, and further reductions over the same space (LayerNorm written out
has two). A join is refused, with its reason, if it would form a cycle through a node outside the
group or exceed the group's caps. A normalization's full-shaped input may be a Concat
(`concat_select`): the row kernel loads each element of its rows from the Concat input that holds
it, so the Concat joins too (its inputs, of other shapes, are kernel inputs), and reads them as a
pointwise kernel would (`resize_gather`, `layout_views`). A row kernel's full-shaped input behind
layout ops that keep each row contiguous is read from the buffer behind them (`layout_views`).

A row group whose rows are a broadcast of another group's (the same reduced axes and row length,
size 1 on some row axes of the other), which only that group reads, joins it: every row of the
bigger group recomputes the row of the smaller it reads, where a kernel of its own wrote them for
all (MobileViT V2's Softmax of the query per patch, which each channel's weighted sum reads).
`ir.rows.row_head` names the row op whose space is the group's.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.fusion.concat import concat_reason
from opfuse.fusion.groups import Group, group_boundary, merge_refusal
from opfuse.fusion.layout_fold import fold_layout
from opfuse.fusion.pad_gather import plan_pad_gathers
from opfuse.fusion.resize import plan_resize_gathers
from opfuse.fusion.rules.base import Candidate, FusionRule
from opfuse.graph import Graph, Node
from opfuse.ir.ops import POINTWISE_OPS, ROW_OPS
from opfuse.ir.queries import contiguous_strides
from opfuse.ir.rows import RowSpace, row_head, row_input_reason, row_op_reason, row_space
from opfuse.ir.support import pointwise_reason
from opfuse.passes.rules import NotFired, node_label

ROW_RULE = names.ROW_REDUCTION
CONCAT_SELECT_RULE = names.CONCAT_SELECT
RESIZE_RULE = names.RESIZE_GATHER
LAYOUT_RULE = names.LAYOUT_VIEWS
PAD_RULE = names.PAD_GATHER


def _whole_rows(space: RowSpace) -> bool:
    """Rows that lie contiguous in the full shape (GroupNorm's (n, g) groups, InstanceNorm's and
    a LayerNorm's trailing axes; not a row kernel over strided columns), so the kernel's offsets
    into a Concat's output, its full-shaped input, are `row * R + cols`."""
    return space.inner == 1


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


class RowReduction(FusionRule):
    """Row groups around each reduction, in graph order. `concat_select` on: a normalization's
    full-shaped input may be a Concat the kernel selects from its inputs."""

    options = (CONCAT_SELECT_RULE, RESIZE_RULE, LAYOUT_RULE)

    def match(self) -> Iterator[Candidate]:
        graph = self.graph
        self.order = {n.id: i for i, n in enumerate(graph.nodes)}
        self.producers = graph.producers()
        self.consumers = graph.consumers()
        self.concats = self.state.on(CONCAT_SELECT_RULE)
        self.groups: list[Group] = []
        # Nodes attention and the row groups so far hold (the row groups' are added as they form).
        self.assigned = set(self.state.in_rows)
        for anchor in graph.nodes:
            if anchor.op_type in ROW_OPS and anchor.id not in self.assigned:
                yield Candidate(ROW_RULE, [anchor])

    def check(self, c: Candidate) -> str | None:
        return row_op_reason(self.graph, c.nodes[0])

    def claim(self, c: Candidate) -> None:
        graph, order, not_fused = self.graph, self.order, self.state.not_fused
        assigned = self.assigned
        anchor = c.nodes[0]
        space = row_space(graph, anchor)
        members = {anchor.id}
        refused: set[str] = set()
        # A cycle may vanish once the nodes between join, so those refusals are retried.
        pending: dict[str, str] = {}
        changed = True
        while changed:
            changed = False
            neighbours = self._neighbours(members)
            for cand in sorted({n.id: n for n in neighbours}.values(), key=lambda n: order[n.id]):
                if cand.id in members or cand.id in assigned or cand.id in refused:
                    continue
                in_space, why = _join_reason(
                    graph,
                    cand,
                    space,
                    self.concats and _whole_rows(space),
                )
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
        self.groups.append(
            Group(
                f"r{len(self.groups)}",
                "rowwise",
                ROW_RULE,
                nodes,
                ins,
                outs,
                full=space.full,
                split=space.first,
            )
        )

    def _neighbours(self, members: set[str]) -> list[Node]:
        """The producers, consumers and siblings of the group's nodes (siblings: other readers of
        the same activation, which load it once from this kernel)."""
        graph, producers, consumers = self.graph, self.producers, self.consumers
        neighbours: list[Node] = []
        for m in [n for n in graph.nodes if n.id in members]:
            neighbours += [producers[x] for x in m.inputs if x and x in producers]
            neighbours += [u for o in m.outputs if o for u in consumers.get(o, [])]
            neighbours += [
                u for x in m.inputs if x and x not in graph.constants for u in consumers.get(x, [])
            ]
        return neighbours

    def finish(self) -> None:
        """A row group over a broadcast of another's space joins it; a row group's Concat is
        selected; its inputs behind layout ops are read as views."""
        state, graph = self.state, self.graph
        self.groups = _fold_broadcast_rows(graph, self.groups, self.order, self.consumers)
        claimed_by_rows = set(self.assigned)
        for g in self.groups:
            if any(n.op_type == "Concat" for n in g.nodes):
                _select_row_concat(graph, g, claimed_by_rows, state.not_fused, state.disabled)
            else:
                if state.on(RESIZE_RULE):
                    _gather_row_resizes(graph, g, claimed_by_rows, state.not_fused, state.on(LAYOUT_RULE))
                if state.on(PAD_RULE):
                    _gather_row_pads(graph, g, claimed_by_rows)
        if state.on(LAYOUT_RULE):
            for g in self.groups:
                _fold_row_layout(graph, g, claimed_by_rows)
        state.in_rows |= {n.id for g in self.groups for n in [*g.nodes, *g.absorbed]}
        state.rows = state.rows + self.groups


def _fold_broadcast_rows(
    graph: Graph, groups: list[Group], order: dict[str, int], consumers: dict[str, list[Node]]
) -> list[Group]:
    """A row group whose rows are a broadcast of another's (the same reduced axes and row length,
    size 1 on some of the other's row axes), read by that group alone, joins it: each of its rows
    recomputes the smaller group's row it reads. MobileViT V2's separable attention takes one
    Softmax of the query per patch, then every channel's row weighs its keys by it: the Softmax
    of that row is computed again in each channel's row, where a kernel wrote it for them all.
    Strided rows too (the reduced axes not last): ResNeSt's split attention takes a Softmax over
    the radix of each channel's weights [B, radix, C, 1, 1], then sums the radix of
    [B, radix, C, H, W] weighed by them."""
    out = {o.name for o in graph.outputs}
    by_node = {n.id: g for g in groups for n in g.nodes}
    gone: set[str] = set()
    for small in groups:
        if small.views or small.prologue or small.absorbed or any(o in out for o in small.outputs):
            continue
        users = [u for o in small.outputs for u in consumers.get(o, [])]
        if any(u.op_type not in POINTWISE_OPS and u.op_type not in ROW_OPS for u in users):
            continue  # read other than by broadcasting (a Concat's part: its own rows)
        readers = [by_node.get(u.id) for u in users]
        big = readers[0] if readers else None
        if (
            big is None
            or any(g is not big for g in readers)
            or big is small
            or big.id in gone
            or big.views
            or big.prologue
        ):
            continue
        mine, theirs = (
            row_space(graph, row_head(graph, small.nodes)),
            row_space(graph, row_head(graph, big.nodes)),
        )
        if mine.groups or theirs.groups:
            continue  # grouped rows: their own addressing
        if (mine.first, mine.end, mine.r) != (theirs.first, theirs.end, theirs.r) or len(mine.full) != len(
            theirs.full
        ):
            continue
        if (
            any(a not in (b, 1) for a, b in zip(mine.full, theirs.full, strict=True))
            or mine.full == theirs.full
        ):
            continue
        members = {n.id for n in [*small.nodes, *big.nodes]}
        if merge_refusal(graph, members, order)[0] is not None:
            continue
        big.nodes = [n for n in graph.nodes if n.id in members]
        big.inputs, big.outputs = group_boundary(graph, big.nodes)
        by_node.update({n.id: big for n in small.nodes})
        gone.add(small.id)
    return [g for g in groups if g.id not in gone]


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
        fold_layout(graph, group, claimed, lambda x, view: x in selected)
    group.rule = "+".join(parts)


def _gather_row_resizes(
    graph: Graph, group: Group, claimed: set[str], not_fused: list[NotFired], fold: bool
) -> None:
    """A full-shaped input of the row kernel that is a Resize only it reads (GhostNetV2's
    upsampled attention, scaling the features that squeeze-excitation then pools) is gathered
    from the Resize's input by the kernel's loads (`resize_gather`), as a pointwise kernel would."""
    full = tuple(group.full)
    values = [x for x in group.inputs if x not in graph.constants and tuple(graph.spec(x).shape) == full]
    if not values or row_space(graph, row_head(graph, group.nodes)).groups:
        return  # a grouped row (GroupNorm's) addresses its elements its own way
    ids = {n.id for n in group.nodes}
    gathers, gathered = plan_resize_gathers(graph, ids, values, full, claimed, not_fused, fold)
    if gathers:
        group.views.update(gathers)
        group.absorbed += gathered
        group.rule = f"{group.rule}+{RESIZE_RULE}"


def _gather_row_pads(graph: Graph, group: Group, claimed: set[str]) -> None:
    """A full-shaped input of the row kernel behind a constant Pad or a Gather by constant
    indices and the layout ops around them, each read by nothing else (TinyViT pads its feature
    map to whole windows, then cuts it into windows for the attention's LayerNorm), is loaded
    through that chain by the kernel (`pad_gather`), as a pointwise kernel would."""
    full = tuple(group.full)
    values = [
        x
        for x in group.inputs
        if x not in graph.constants and x not in group.views and tuple(graph.spec(x).shape) == full
    ]
    if not values or group.prologue or row_space(graph, row_head(graph, group.nodes)).groups:
        return  # a grouped row (GroupNorm's) addresses its elements its own way
    maps, chain = plan_pad_gathers(graph, {n.id for n in group.nodes}, values, claimed, gathers=True)
    if maps:
        claimed.update(n.id for n in chain)
        group.views.update(maps)
        group.absorbed += chain
        group.rule = f"{group.rule}+{PAD_RULE}"


def _fold_row_layout(graph: Graph, group: Group, claimed: set[str]) -> None:
    """A row kernel's full-shaped input reached through layout ops that keep each row in one run
    of equal steps is read from the buffer behind them: rows at their strides, each row as it
    lies (a seq-first attention output transposed back to batch-first before its residual
    LayerNorm: contiguous rows; the real parts of FNet's Fourier transform, every other value of
    its [..., 2] pairs: a row at a step of 2), where the runtime would first copy the view."""
    space = row_space(graph, row_head(graph, group.nodes))
    if space.inner > 1 or space.groups:
        return  # rows strided or grouped: their own addressing
    full = tuple(group.full)
    k = len(full) - 1 if group.split is None else group.split
    if not full or k <= 0 or int(np.prod(full[k:], dtype=np.int64)) <= 1:
        return
    trailing = contiguous_strides(full)[k:]
    fold_layout(
        graph,
        group,
        claimed,
        # Full-shaped, and each row one run at the step of its last dim, as the kernel reads it.
        lambda x, view: (
            tuple(graph.spec(x).shape) == full
            and view.strides[-1] >= 1
            and tuple(view.strides[k:]) == tuple(view.strides[-1] * t for t in trailing)
        ),
    )


RULE = RowReduction
