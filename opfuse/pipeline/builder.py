"""PlanBuilder: the fused plan of one compile, made again whenever a stage learns something new."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opfuse.errors import BUG_NOTE, ModelError
from opfuse.fusion.planner import FusionPlan, Group
from opfuse.graph import Graph, TensorSpec
from opfuse.lowering import UnwrittenValue, build_plan
from opfuse.pipeline.context import describe
from opfuse.runtime.plan import Plan
from opfuse.verify.rollback import bisect_bad

if TYPE_CHECKING:
    from opfuse.tuning.orchestrate import TuningResult


@dataclass
class PlanBuilder:
    """Everything that decides the fused plan, in one place: the graph, the groups to fuse, each
    anchor's variant ("template" or "vendor"), tuned launch configs by kernel signature, and the
    groups that must run unfused (`unsafe`: group id -> why). `plan()` makes the plan; a group
    whose codegen raises joins `unsafe` (found by halving the groups), as does one whose kernel
    would read a value no step writes (`lowering.UnwrittenValue`), and the plan is made without
    it. Stages change a builder only through `exclude`, or make a new one (`adopt`)."""

    graph: Graph
    groups: list[Group]
    precision: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    variants: dict[str, str] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    unsafe: dict[str, str] = field(default_factory=dict)

    def plan(self, enabled: Collection[str] | None = None) -> Plan:
        """The fused plan with the variants and configs, of the groups in `enabled` (all when
        None) less the unsafe ones."""
        ids = [g.id for g in self.groups if (enabled is None or g.id in enabled) and g.id not in self.unsafe]
        while True:
            try:
                p = self._build(ids)
                break
            except ModelError:
                raise
            except UnwrittenValue as exc:  # the reading group is known: no search
                self.unsafe[exc.group] = f"planning: {exc}; {BUG_NOTE}"
                ids = [i for i in ids if i != exc.group]
            except Exception as exc:
                p = self._without_faults(ids, exc)
                break
        if self.configs:
            from opfuse.tuning.cache import kernel_signature

            for k in p.kernels.values():
                k.config = dict(self.configs.get(kernel_signature(k), k.config))
        return p

    def _without_faults(self, ids: list[str], exc: Exception) -> Plan:
        """The plan of `ids` less the groups whose code cannot be generated (`exc` raised by the
        plan of them all), found by halving."""
        faults = faulty_groups(ids, self._build)
        if not faults:  # no group fails alone: together, then
            faults = {
                gid: f"generating the kernels of the groups together raised {describe(exc)}" for gid in ids
            }
        self.unsafe.update({gid: f"codegen: {why}" for gid, why in faults.items()})
        return self._build([i for i in ids if i not in self.unsafe])

    def _build(self, ids: list[str]) -> Plan:
        fusion = FusionPlan(self.groups, [])
        return build_plan(
            self.graph, fusion, self.precision, self.inputs, self.outputs, enabled=ids, variants=self.variants
        )

    def exclude(self, unsafe: dict[str, str]) -> None:
        """These groups run unfused from now on, each with why."""
        self.unsafe.update(unsafe)

    def derive(self, **changes: Any) -> PlanBuilder:
        """A builder with `changes` (fields by name) that shares nothing mutable with this one."""
        copied = {
            "groups": list(self.groups),
            "variants": dict(self.variants),
            "configs": dict(self.configs),
            "unsafe": dict(self.unsafe),
        }
        return dataclasses.replace(self, **{**copied, **changes})

    def adopt(self, tuned: TuningResult) -> PlanBuilder:
        """The builder of the tuned plan: tuning's groups, variants and configs; its unsafe groups
        (codegen faults of its candidate plans, kernels that failed in its workers) join these."""
        return self.derive(
            groups=list(tuned.groups),
            variants=dict(tuned.variants),
            configs=dict(tuned.configs),
            unsafe={**self.unsafe, **tuned.codegen_faults, **tuned.unsafe},
        )


def faulty_groups(ids: list[str], build: Callable[[list[str]], Any]) -> dict[str, str]:
    """The groups among `ids` whose code cannot be generated on their own, each with its error,
    found by halving (`build` of a set of groups raises where one of them cannot be generated)."""
    errors: dict[str, str] = {}

    def fails(subset: list[str]) -> bool:
        try:
            build(subset)
        except ModelError:
            raise
        except Exception as exc:
            if len(subset) == 1:
                errors[subset[0]] = f"generating its kernel raised {describe(exc)}"
            return True
        return False

    bad = bisect_bad(ids, fails)
    for gid in bad:  # the bisection may infer a group without building it alone: its error, once
        if gid not in errors:
            fails([gid])
    return {gid: errors.get(gid, "generating its kernel raised (only beside other groups)") for gid in bad}
