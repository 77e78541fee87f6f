"""The protocol every graph pass follows, and the log of what each did and why it did not.

A pass is a name from the rule registry (`opfuse.frontend.rule_registry`, which holds its stage,
doc line, prerequisites and switch) and `apply(graph, ctx)`. Two kinds implement it:

- `Rule`: a rewrite anchored at one node, in three parts: `match` (is this node a candidate?),
  `check` (None to fire, else the reason it does not, which goes into the report) and `rewrite`.
  `apply` offers it every node of the graph in order.
- `GraphRule`: a rewrite that must see the whole graph at once to decide (the channels-last
  region, the projections of one input); its function records what fired and why candidates
  did not in the same log.

`run_passes` (passes/pipeline.py) applies the pipeline's passes in order, skipping those the job
turned off (`fusion.disable`) or whose prerequisites it turned off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opfuse.frontend.rule_registry import RULES
from opfuse.graph import Graph, Node


@dataclass
class NotFired:
    """A rule matched a candidate but did not fire; the reason goes into the report."""

    rule: str
    nodes: list[str]
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "nodes": self.nodes, "reason": self.reason}


@dataclass
class RuleLog:
    fired: dict[str, int] = field(default_factory=dict)
    not_fired: list[NotFired] = field(default_factory=list)

    def fire(self, rule: str, times: int = 1) -> None:
        self.fired[rule] = self.fired.get(rule, 0) + times


@dataclass
class PassContext:
    """What a pass may read besides the graph: the job's switches and target, and the log."""

    disabled: frozenset[str] = frozenset()
    precision: str = "fp32"
    device: str = "cpu"
    log: RuleLog = field(default_factory=RuleLog)


class Pass(Protocol):
    name: str

    @property
    def doc(self) -> str: ...

    def apply(self, graph: Graph, ctx: PassContext) -> None: ...


def node_label(node: Node) -> str:
    """How a node is named in reports: its model name, or op type and our id when it has none."""
    return node.name or f"{node.op_type}#{node.id}"


@dataclass
class Rule:
    name: str
    # The anchor node a rule looks at; returns None when the node is not a candidate at all.
    match: Callable[[Graph, Node], dict[str, Any] | None]
    # Given a match, returns None to fire or a human-readable reason not to.
    check: Callable[[Graph, Node, dict[str, Any]], str | None]
    rewrite: Callable[[Graph, Node, dict[str, Any]], None]

    @property
    def doc(self) -> str:
        return RULES[self.name].doc

    def apply(self, graph: Graph, ctx: PassContext) -> None:
        alive = {id(n) for n in graph.nodes}  # by identity: a list scan per node was quadratic
        for node in list(graph.nodes):
            if id(node) not in alive:
                continue  # removed by an earlier rewrite
            m = self.match(graph, node)
            if m is None:
                continue
            reason = self.check(graph, node, m)
            if reason is not None:
                labels = [node_label(n) for n in m.get("nodes", [node])]
                ctx.log.not_fired.append(NotFired(self.name, labels, reason))
                continue
            self.rewrite(graph, node, m)
            alive = {id(n) for n in graph.nodes}
            ctx.log.fire(self.name)


@dataclass
class GraphRule:
    name: str
    run: Callable[[Graph, PassContext], None]
    # Registry names the function reads from `ctx.disabled` itself (a switch inside the pass).
    options: tuple[str, ...] = ()

    @property
    def doc(self) -> str:
        return RULES[self.name].doc

    def apply(self, graph: Graph, ctx: PassContext) -> None:
        self.run(graph, ctx)


def apply_rules(graph: Graph, rules: list[Rule], disabled: set[str], log: RuleLog) -> None:
    """The rules not in `disabled`, in order, each over the whole graph."""
    ctx = PassContext(frozenset(disabled), log=log)
    for rule in rules:
        if rule.name not in disabled:
            rule.apply(graph, ctx)
