"""The fusion planner: the registry's fusion rules, in its order, each claiming its groups.

Every fusion rule is a module whose `RULE` follows one protocol (fusion/rules/base.py: match,
check returning a reason, claim), named by the registry entries whose `impl` is that module
(`opfuse.frontend.rule_registry`). A rule runs when one of its names is on; the rules it applies
inside its own groups (`options`) it reads itself. Each rule reads what the ones before it
claimed: attention and row groups first, then anchors with their epilogues, the rules that join
memory-bound neighbours to those groups, and pointwise groups of what is left. Every refusal is
recorded with its reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from opfuse.errors import BUG_NOTE, describe
from opfuse.frontend import rule_registry as names
from opfuse.fusion.explain import explain_concat_copies, explain_resizes
from opfuse.fusion.groups import Group, without_group_cycles
from opfuse.fusion.rules.base import FusionRule, PlanState, RuleFault, run_rule
from opfuse.graph import Graph
from opfuse.passes.rules import NotFired, node_label

__all__ = ["FUSION_RULES", "FusionPlan", "Group", "LoadedRule", "PlanState", "fusion_rules", "plan_fusion"]


@dataclass
class FusionPlan:
    groups: list[Group]
    not_fused: list[NotFired]
    # Anchors with nothing to fuse but a template of their own: the library kernel runs them unless
    # tuning measures the template faster (tuning adds those to `groups`).
    lone: list[Group] = field(default_factory=list)


@dataclass(frozen=True)
class LoadedRule:
    """A fusion rule as the planner runs it: the registry names it implements (it runs when one of
    them is on), the names it reads inside its own groups, and its class."""

    names: tuple[str, ...]
    options: tuple[str, ...]
    rule: type[FusionRule]


def fusion_rules() -> tuple[LoadedRule, ...]:
    """The registry's fusion rules, in the order of their first entry, each module's `RULE`."""
    by_impl: dict[str, list[str]] = {}
    for r in names.stage_rules(names.FUSION):
        if r.impl:
            by_impl.setdefault(r.impl, []).append(r.name)
    loaded = []
    for impl, rule_names in by_impl.items():
        rule = getattr(importlib.import_module(impl), "RULE", None)
        if not (isinstance(rule, type) and issubclass(rule, FusionRule)):
            raise TypeError(f"{impl}.RULE is not a FusionRule subclass (registry entries {rule_names})")
        loaded.append(LoadedRule(tuple(rule_names), rule.options, rule))
    return tuple(loaded)


FUSION_RULES = fusion_rules()


def plan_fusion(graph: Graph, disabled: set[str] | frozenset[str] = frozenset()) -> FusionPlan:
    """Each fusion rule that is on claims its groups, in order; then the copies and Resizes left
    in the plan are explained."""
    state = PlanState(graph, frozenset(disabled))
    for loaded in fusion_rules():
        if any(state.on(name) for name in loaded.names):
            saved = state.snapshot()
            try:
                run_rule(loaded.rule(state))
            except RuleFault as fault:  # one rule's bug: the plan goes on without that rule's groups
                state = saved
                reason = (
                    f"the {loaded.names[0]} rule raised {describe(fault.cause)}, so what it would "
                    f"have fused runs unfused or in other rules' groups; {BUG_NOTE}"
                )
                state.not_fused.append(NotFired(loaded.names[0], fault.nodes, reason))
    groups, cyclic = without_group_cycles(graph, [*state.fused(), *state.pointwise])
    for g, lost in cyclic:
        kept = len(lost) < len(g.prologue) + len(g.nodes)
        state.not_fused.append(
            NotFired(
                g.rule,
                [node_label(n) for n in lost],
                f"beside the groups fused before it, group {g.id}'s kernel would wait on its own output "
                "through another kernel (each group is convex alone, together they form a cycle); "
                + ("these nodes of its epilogue run unfused" if kept else "its nodes run unfused"),
            )
        )
    if state.on(names.LAYOUT_VIEWS):
        explain_concat_copies(graph, groups, state.not_fused, state.concat_reasons)
    if state.on(names.RESIZE_GATHER):
        explain_resizes(graph, groups, state.not_fused)
    return FusionPlan(groups, state.not_fused, state.lone)
