"""Per-op cost of a plan: time, bytes moved, FLOPs, arithmetic intensity, memory- or compute-bound."""

from __future__ import annotations

from opfuse.profile.costs import profile_steps, step_cost

__all__ = ["profile_steps", "step_cost"]
