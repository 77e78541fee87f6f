"""The protocol every fusion rule follows, and the plan state the rules share.

A fusion rule is a module of `opfuse.fusion.rules` (or any importable module) whose `RULE` is a
`FusionRule` subclass, named by the registry entries whose `impl` is that module
(`opfuse.frontend.rule_registry`: name, stage, doc line, prerequisites, switch). `plan_fusion`
runs the rules in the registry's order, each one that has a name switched on, in four steps:

- `match()`: the candidates, one at a time (a generator: it sees what the claims before it took);
- `check(c)`: None to claim the candidate, else why not: the reason goes into the report under
  `c.rule` with the candidate's nodes (`QUIET`, the empty reason, refuses without a word: the
  candidate was not one after all);
- `claim(c)`: the candidate's nodes join a group (a new one, or one another rule made);
- `finish()`: what the rule does once its candidates are done (drop the groups it merged away).

A rule object lives for one `plan_fusion` call: what it keeps between its steps is its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from opfuse.errors import ModelError
from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group, group_boundary
from opfuse.graph import Graph, Node
from opfuse.ir.rows import row_head
from opfuse.ir.views import StridedView
from opfuse.passes.rules import NotFired, node_label

QUIET = ""  # a check's refusal that the report does not show


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
    # Anchors with nothing to fuse but a template of their own (tuning may measure them faster).
    lone: list[Group] = field(default_factory=list)
    pointwise: list[Group] = field(default_factory=list)
    # Nodes the row kernels (and attention) hold: no anchor takes them.
    in_rows: set[str] = field(default_factory=set)
    # Concats `concat_select` matched but did not take (id -> why), said where they stay copies.
    concat_reasons: dict[str, str] = field(default_factory=dict)

    def on(self, name: str) -> bool:
        return names.enabled(name, self.disabled)

    def snapshot(self) -> PlanState:
        """A copy to go back to if a rule fails half-way: the groups and their lists copied (a
        group in two lists stays one group), the graph and its nodes shared (rules only read them)."""
        memo: dict[int, Group] = {}

        def copy(g: Group) -> Group:
            if id(g) not in memo:
                memo[id(g)] = dataclasses.replace(
                    g,
                    nodes=list(g.nodes),
                    inputs=list(g.inputs),
                    outputs=list(g.outputs),
                    views=dict(g.views),
                    absorbed=list(g.absorbed),
                    prologue=list(g.prologue),
                )
            return memo[id(g)]

        return PlanState(
            self.graph,
            self.disabled,
            list(self.not_fused),
            [copy(g) for g in self.rows],
            [copy(g) for g in self.anchors],
            [copy(g) for g in self.lone],
            [copy(g) for g in self.pointwise],
            set(self.in_rows),
            dict(self.concat_reasons),
        )

    def fused(self) -> list[Group]:
        return [*self.rows, *self.anchors]

    def read(self) -> set[str]:
        """The values the row and anchor groups planned so far read: their inputs, and the buffers
        behind the views and gathers they load instead of an input (`Group.views`)."""
        return {x for g in self.fused() for x in [*g.inputs, *(v.base for v in g.views.values())] if x}

    def held(self) -> set[str]:
        """The nodes the row and anchor groups hold (their prologues and folded views too)."""
        return self.in_rows | {n.id for g in self.fused() for n in [*g.prologue, *g.nodes, *g.absorbed]}


@dataclass
class Candidate:
    """What `match` found: the rule a refusal is reported under, the nodes it names, and what
    `check` and `claim` need (the anchor group, or the rule's own record)."""

    rule: str
    nodes: list[Node]
    group: Group | None = None
    data: Any = None

    def labels(self) -> list[str]:
        return [node_label(n) for n in self.nodes]


class FusionRule:
    """Subclass it, set `options` and write `match`, `check` and `claim` (see the module docstring)."""

    # Registry names the rule reads itself, inside its own groups (`state.on(...)`).
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, state: PlanState) -> None:
        self.state = state
        self.graph = state.graph

    def match(self) -> Iterator[Candidate]:
        raise NotImplementedError

    def check(self, c: Candidate) -> str | None:
        return None

    def claim(self, c: Candidate) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        return None

    def refuse(self, rule: str, nodes: list[Node], reason: str) -> None:
        """Say why something the rule looked at inside a claim does not join."""
        self.state.not_fused.append(NotFired(rule, [node_label(n) for n in nodes], reason))


class RowPrologueRule(FusionRule):
    """A lone anchor computed on the tiles of the row kernel that reads its output: the anchor
    becomes the row group's prologue, its output never written, and the group is timed against the
    split form (the library's kernel, then the row kernel). Subclasses set `rule` and `kinds` (the
    lone groups' kinds they consider) and write `takes` (which lone anchors of those) and `check`.
    One anchor per row kernel. (depthwise_reduction.py, gemm_reduction.py)"""

    rule: ClassVar[str]
    kinds: ClassVar[tuple[str, ...]]

    # Whether the row kernel may read its other full-shaped inputs through folded layout ops
    # (StridedView) while it computes the anchor on its tiles.
    strided_rows: ClassVar[bool] = False
    # Whether the anchor's output may reach the row kernel through a view that reads it in order
    # (`StridedView.reads_in_order`: a reshape, or layout ops composing to one): the kernel's
    # tile is then the view's.
    through_reshapes: ClassVar[bool] = False

    def takes(self, anchor: Node) -> bool:
        return True

    def _plain(self, rg: Group) -> bool:
        """A row group this rule may add its anchor to: no prologue yet, and no views, or (where
        the rule's kernel reads rows through them) only strided views of its rows, no Concat."""
        if rg.kind != "rowwise" or rg.prologue:
            return False
        if not rg.views:
            return True
        return (
            self.strided_rows
            and all(isinstance(v, StridedView) for v in rg.views.values())
            and not any(n.op_type == "Concat" for n in rg.nodes)
        )

    def match(self) -> Iterator[Candidate]:
        """Each row group's input that a lone anchor of one of `kinds` writes (the first one a group takes):
        the candidate's nodes are the anchor and the row kernel's first row op, its data (the
        lone group, the value)."""
        lone_by_output = {
            g.outputs[0]: g for g in self.state.lone if g.kind in self.kinds and len(g.outputs) == 1
        }
        # The graph does not change while the rules plan: its use-def maps, once per rule.
        self.producers, self.consumers = self.graph.producers(), self.graph.consumers()
        self.gone: set[str] = set()
        for rg in self.state.rows:
            if not self._plain(rg):
                continue
            head = row_head(self.graph, rg.nodes)
            for x in rg.inputs:
                src = lone_by_output.get(x)
                view = rg.views.get(x)
                if src is None and self.through_reshapes and isinstance(view, StridedView):
                    base = lone_by_output.get(view.base)
                    if base is not None and view.reads_in_order(self.graph.spec(view.base).numel):
                        src = base
                if src is None or src.id in self.gone or not self.takes(src.nodes[0]):
                    continue
                yield Candidate(self.rule, [src.nodes[0], head], group=rg, data=(src, x))
                if rg.prologue:
                    break  # claimed: one anchor per row kernel

    def read_outside(self, x: str, rg: Group) -> bool:
        """Whether anything but the row kernel reads `x` (a graph output counts)."""
        members = {n.id for n in rg.nodes}
        graph = self.graph
        return x in {o.name for o in graph.outputs} or any(
            u.id not in members for u in self.consumers.get(x, [])
        )

    def claim(self, c: Candidate) -> None:
        rg = c.group
        assert rg is not None
        anchor = c.nodes[0]
        rg.prologue = [anchor]
        rg.inputs, rg.outputs = group_boundary(self.graph, [anchor, *rg.nodes])
        rg.rule = f"{rg.rule}+{self.rule}"
        rg.variant = "template"  # against the split form, where tuning measures
        self.gone.add(c.data[0].id)

    def finish(self) -> None:
        self.state.lone[:] = [g for g in self.state.lone if g.id not in self.gone]


class RuleFault(Exception):
    """A fusion rule raised (an opfuse bug): the candidate it was on, for the report."""

    def __init__(self, nodes: list[str], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.nodes, self.cause = nodes, cause


def run_rule(rule: FusionRule) -> None:
    """Every candidate of `rule`, checked, then claimed or its refusal recorded; then `finish`.
    An exception other than a ModelError (the model's own fault) comes out as a RuleFault naming
    the candidate's nodes."""
    current: list[str] = []
    try:
        for c in rule.match():
            current = c.labels()
            reason = rule.check(c)
            if reason is None:
                rule.claim(c)
            elif reason != QUIET:
                rule.state.not_fused.append(NotFired(c.rule, c.labels(), reason))
            current = []
        rule.finish()
    except ModelError:
        raise
    except Exception as exc:
        raise RuleFault(current, exc) from exc
