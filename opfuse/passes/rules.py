"""The rewrite-rule protocol every graph pass follows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
class Rule:
    name: str
    # The anchor node a rule looks at; returns None when the node is not a candidate at all.
    match: Callable[[Graph, Node], dict[str, Any] | None]
    # Given a match, returns None to fire or a human-readable reason not to.
    check: Callable[[Graph, Node, dict[str, Any]], str | None]
    rewrite: Callable[[Graph, Node, dict[str, Any]], None]
    doc: str = ""


@dataclass
class RuleLog:
    fired: dict[str, int] = field(default_factory=dict)
    not_fired: list[NotFired] = field(default_factory=list)


def node_label(node: Node) -> str:
    """How a node is named in reports: its model name, or op type and our id when it has none."""
    return node.name or f"{node.op_type}#{node.id}"


def apply_rules(graph: Graph, rules: list[Rule], disabled: set[str], log: RuleLog) -> None:
    for rule in rules:
        if rule.name in disabled:
            continue
        for node in list(graph.nodes):
            if node not in graph.nodes:
                continue  # removed by an earlier rewrite
            m = rule.match(graph, node)
            if m is None:
                continue
            reason = rule.check(graph, node, m)
            if reason is not None:
                labels = [node_label(n) for n in m.get("nodes", [node])]
                log.not_fired.append(NotFired(rule.name, labels, reason))
                continue
            rule.rewrite(graph, node, m)
            log.fired[rule.name] = log.fired.get(rule.name, 0) + 1
