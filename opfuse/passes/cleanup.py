"""Cleanup rules: inference-time no-ops go away before planning."""

from __future__ import annotations

from typing import Any

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node
from opfuse.passes.rules import Rule

NOOP_OPS = ("Identity", "Dropout")


def replace_uses(graph: Graph, old: str, new: str) -> None:
    for n in graph.nodes:
        n.inputs = [new if x == old else x for x in n.inputs]


def _match_noop(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type not in NOOP_OPS:
        return None
    return {"nodes": [node]}


def _check_noop(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if node.op_type == "Dropout" and len([o for o in node.outputs if o]) > 1:
        return "the Dropout mask output is used"
    graph_outputs = {o.name for o in graph.outputs}
    if node.outputs[0] in graph_outputs and (
        node.inputs[0] in graph_outputs or node.inputs[0] not in graph.producers()
    ):
        return "its output is a graph output fed directly by a graph input or another output"
    return None


def _rewrite_noop(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    src, dst = node.inputs[0], node.outputs[0]
    graph.nodes.remove(node)
    graph_outputs = {o.name for o in graph.outputs}
    if dst in graph_outputs:
        # Keep the graph output's name: make the producer write it directly.
        producer = graph.producers()[src]
        producer.outputs = [dst if o == src else o for o in producer.outputs]
        replace_uses(graph, src, dst)
    else:
        replace_uses(graph, dst, src)


eliminate_noops = Rule(
    names.ELIMINATE_NOOPS,
    _match_noop,
    _check_noop,
    _rewrite_noop,
)
