"""Every compute node explained: what the final plan left unfused, and why.

The rules record their own refusals as they plan (`fusion.not_fused`). A node that no rule looked
at, or that a rule looked at and passed over without a word, would run as a library kernel with
nothing in the report to say so. `explain_unfused` runs once on the final plan, after tuning and
verification have had their say, and adds an entry for each compute node (a node that launches a
kernel: not a view, not a constant folded away) that is not inside a fused group and is named by
no entry yet. It also gives the plan's fused coverage: the share of compute nodes inside fused
groups.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node
from opfuse.ir.ops import AVERAGE_POOL_NHWC, CONV_OPS, MAX_POOL_NHWC
from opfuse.ir.support import pointwise_reason
from opfuse.passes.rules import node_label
from opfuse.runtime.ops import VIEW_OPS
from opfuse.runtime.plan import Plan

# The rule that would have taken an anchor op, had there been anything to fuse with it.
_ANCHOR_RULES = {
    "MatMul": names.GEMM_EPILOGUE,
    "Gemm": names.GEMM_EPILOGUE,
    MAX_POOL_NHWC: names.POOL_EPILOGUE,
    AVERAGE_POOL_NHWC: names.POOL_EPILOGUE,
}
NO_RULE = "none"
POINTWISE_RULE = names.POINTWISE


def _anchor_rule(op_type: str) -> str | None:
    if op_type in CONV_OPS:
        return names.CONV_EPILOGUE
    return _ANCHOR_RULES.get(op_type)


def _reason(
    graph: Graph, node: Node, unfused: set[str], consumers: dict[str, list[Node]], disabled: Collection[str]
) -> tuple[str, str]:
    """(rule, reason) for a compute node that runs alone and that no entry names."""
    rule = _anchor_rule(node.op_type)
    if rule is None and pointwise_reason(graph, node) is None:
        rule = POINTWISE_RULE
    if rule is not None and rule in disabled:
        return rule, f"the {rule} rule is disabled (fusion.disable); the library kernel runs {node.op_type}"
    after = [c for o in node.outputs if o for c in consumers.get(o, [])]
    fused_after = [node_label(c) for c in after if c.id not in unfused and c.op_type not in VIEW_OPS]
    if rule == POINTWISE_RULE:
        return rule, (
            f"a lone {node.op_type}: no producer or consumer it can share a kernel with "
            "(they are views, anchors, graph inputs or outputs, or fused into other kernels)"
        )
    if rule is not None:
        why = f"a lone {node.op_type}: nothing to fuse with it"
        if fused_after:
            why += f" (its consumers {fused_after} are fused into other kernels)"
        return rule, f"{why}; the library kernel runs it, unless tuning measures its template faster"
    return (
        NO_RULE,
        f"no rule takes {node.op_type} here ({pointwise_reason(graph, node)}); the library kernel runs it",
    )


def explain_unfused(
    graph: Graph, plan: Plan, not_fused: list[dict[str, Any]], disabled: Collection[str] = ()
) -> dict[str, Any]:
    """Append to `not_fused` an entry ({"rule", "nodes", "reason"}) for each compute node of `graph`
    that `plan` runs outside a fused group and that no entry names yet; return the fused coverage
    {"compute_nodes", "fused", "share"}. `disabled`: the rules the caller turned off (fusion.disable).

    A node runs outside a fused group where the plan has an op step of its own that launches a
    kernel and belongs to no group (a vendor-variant group's library step belongs to its group)."""
    by_id = {n.id: n for n in graph.nodes}
    unfused = [
        by_id[s.node] for s in plan.steps if s.kind == "op" and not s.group and s.launches and s.node in by_id
    ]
    unfused_ids = {n.id for n in unfused}
    named = {label for entry in not_fused for label in entry.get("nodes", [])}
    consumers = graph.consumers()
    for node in unfused:
        label = node_label(node)
        if label in named:
            continue
        rule, reason = _reason(graph, node, unfused_ids, consumers, disabled)
        not_fused.append({"rule": rule, "nodes": [label], "reason": reason})
        named.add(label)
    compute = sum(1 for n in graph.nodes if n.op_type not in VIEW_OPS)
    fused = compute - len(unfused_ids)
    return {"compute_nodes": compute, "fused": fused, "share": round(fused / compute, 4) if compute else 1.0}
