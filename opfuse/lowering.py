"""Lower a planned graph to an execution plan: fused groups become kernel steps, the rest op steps."""

from __future__ import annotations

import heapq
from collections.abc import Collection

from opfuse.codegen.registry import TEMPLATES, bias_to_epilogue, split_of, template_only
from opfuse.codegen.source import fixed_header
from opfuse.codegen.spec import Part, render_part
from opfuse.fusion.groups import group_boundary
from opfuse.fusion.planner import FusionPlan, Group
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import NHWC_POOLS
from opfuse.passes.rules import node_label
from opfuse.runtime.plan import KernelInfo, Plan, Step


def _topological(steps: list[Step], rank: list[int], available: set[str]) -> list[Step]:
    """Order steps so every input is produced first; ties keep the original node order."""
    producer = {o: i for i, s in enumerate(steps) for o in s.outputs if o}
    deps = [{producer[x] for x in s.inputs if x and x in producer and x not in available} for s in steps]
    users: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(i)
    pending = [len(d) for d in deps]
    ready = [(rank[i], i) for i, d in enumerate(deps) if not d]
    heapq.heapify(ready)
    out: list[Step] = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(steps[i])
        for u in users.get(i, []):
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, (rank[u], u))
    if len(out) != len(steps):
        raise RuntimeError("fusion produced a cyclic plan; this is a bug in the planner")
    return out


class UnwrittenValue(RuntimeError):
    """A kernel of the plan reads a value no step writes: the group that computes it keeps it
    inside its kernel (a Split its conv stores as parts, a layout op folded away) while this
    group was planned to read it from memory. A planner bug, found before anything runs: the
    reading group (`group`) runs unfused."""

    def __init__(self, group: str, kernel: str, value: str) -> None:
        super().__init__(f"kernel {kernel} of group {group} reads {value}, which no step of the plan writes")
        self.group, self.value = group, value


def _check_written(steps: list[Step], available: set[str]) -> None:
    """Every input of every step is a model input, a constant or an earlier step's output."""
    written = set(available)
    for s in steps:
        for x in s.inputs:
            if x and x not in written:
                if s.kind == "kernel":
                    raise UnwrittenValue(s.group, s.kernel, x)
                raise RuntimeError(f"step {s.label or s.node} reads {x}, which no step of the plan writes")
        written.update(o for o in s.outputs if o)


def _op_step(n: Node, group: str = "") -> Step:
    """A node run by its per-op torch kernel."""
    return Step(
        "op",
        list(n.inputs),
        list(n.outputs),
        op_type=n.op_type,
        attrs=dict(n.attrs),
        node=n.id,
        label=node_label(n),
        group=group,
    )


def _drop_unread_views(steps: list[Step], outputs: set[str]) -> list[Step]:
    """Leave out view steps nothing reads any more: a Split whose outputs the kernels now read
    in place, from the buffer behind it."""
    live = set(outputs)
    keep: list[Step] = []
    for s in reversed(steps):
        if s.kind == "op" and s.launches == 0 and not any(o in live for o in s.outputs if o):
            continue
        keep.append(s)
        live.update(x for x in s.inputs if x)
    return keep[::-1]


def build_plan(
    graph: Graph,
    fusion: FusionPlan,
    precision: str,
    declared_inputs: list[TensorSpec],
    declared_outputs: list[TensorSpec],
    enabled: Collection[str] | None = None,
    variants: dict[str, str] | None = None,
) -> Plan:
    """The plan with the groups in `enabled` fused (all groups when None)."""
    variants = variants or {}
    on: list[Group] = [g for g in fusion.groups if enabled is None or g.id in enabled]
    in_group = {n.id: g for g in on for n in [*g.prologue, *g.nodes, *g.absorbed]}
    steps: list[Step] = []
    rank: list[int] = []
    kernels: dict[str, KernelInfo] = {}
    order = {n.id: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if n.id in in_group:
            continue
        steps.append(_op_step(n))
        rank.append(order[n.id])

    def add_kernel(part: Part, g: Group, nodes: list[Node]) -> None:
        # Every kernel is its part rendered by the template registry; the bundle carries the
        # part as the kernel's spec, so that a loader renders the source again itself.
        src, spec = render_part(f"k{len(kernels)}", part, graph, precision)
        kernels[src.id] = KernelInfo(
            src.id, src.kind, g.id, src.inputs, src.outputs, src.config, fixed_header(src.source), spec
        )
        label = ", ".join(node_label(n) for n in nodes)
        steps.append(
            Step("kernel", list(src.inputs), list(src.outputs), kernel=src.id, group=g.id, label=label)
        )
        # (a conv's bias moved into its epilogue, bias_to_epilogue, is an Add that is no graph node)
        rank.append(max(order[n.id] for n in nodes if n.id in order))

    for g in on:
        vendor = variants.get(g.id, g.variant) == "vendor" and not (
            g.variant == "template" and template_only(g)
        )
        split = split_of(g) if vendor else None
        if split is not None:
            # The alternative measured against the one kernel where that is not the library's:
            # the template's split form, its steps as without the prologue rule.
            for piece in split.pieces(graph):
                if piece.kind is None:  # the library's per-op steps
                    for n in piece.nodes:
                        steps.append(_op_step(n, g.id))
                        rank.append(order[n.id])
                    continue
                ins, outs = group_boundary(graph, piece.nodes)
                part = Part(
                    g.id,
                    piece.kind,
                    piece.nodes,
                    ins,
                    outs,
                    piece.full,
                    piece.split,
                    piece.match,
                    piece.views,
                )
                add_kernel(part, g, piece.nodes)
            continue
        template = TEMPLATES.get(g.kind, TEMPLATES["pointwise"])
        if vendor and template.library:
            # The vendor GEMM as a per-op step, its epilogue as one pointwise kernel right after it.
            anchor, epilogue = g.nodes[0], g.nodes[1:]
            # Folded layout ops and an input scale run as their own ops before the library kernel,
            # a Concat the template writes in place as its own op after the epilogue.
            # A pool on the output tile (pool_tail) runs as the library's pool after the epilogue.
            concat = [n for n in epilogue if n.op_type == "Concat"]
            tail = [n for n in epilogue if n.op_type in NHWC_POOLS.values()]
            epilogue = [n for n in epilogue if n.op_type != "Concat" and n not in tail]
            anchor, epilogue = bias_to_epilogue(graph, anchor, epilogue)
            for n in [*g.absorbed, *g.prologue, anchor, *concat]:
                steps.append(_op_step(n, g.id))
                rank.append(order[n.id])
            if epilogue:  # else a prologue-only group: nothing after the library kernel
                ins, outs = group_boundary(graph, epilogue)
                add_kernel(Part(g.id, "pointwise", epilogue, ins, outs), g, g.nodes)
            for n in tail:
                steps.append(_op_step(n, g.id))
                rank.append(order[n.id])
            continue
        kind = g.kind if g.kind in TEMPLATES else "pointwise"
        part = Part(g.id, kind, g.nodes, g.inputs, g.outputs, g.full, g.split, g.match, g.views, g.prologue)
        add_kernel(part, g, [*g.prologue, *g.nodes])  # labelled as the report names the group
    available = {s.name for s in graph.inputs} | set(graph.constants)
    ordered = _drop_unread_views(_topological(steps, rank, available), {o.name for o in declared_outputs})
    _check_written(ordered, available)
    return Plan(
        precision=precision,
        inputs=declared_inputs,
        outputs=declared_outputs,
        values=dict(graph.values),
        steps=ordered,
        kernels=kernels,
        constants=dict(graph.constants),
    )
