"""The planner: which nodes share a kernel, and why others do not."""

from __future__ import annotations

from opfuse.fusion.planner import FusionPlan, Group, plan_fusion

__all__ = ["FusionPlan", "Group", "plan_fusion"]
