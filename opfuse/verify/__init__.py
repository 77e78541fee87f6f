"""Verification: reference outputs, tolerances per precision, bisection and rollback of bad groups."""

from __future__ import annotations

from opfuse.verify.compare import DEFAULT_TOLERANCES, OutputCheck, compare_outputs
from opfuse.verify.reference import OnnxRuntimeReference, random_inputs

__all__ = ["DEFAULT_TOLERANCES", "OnnxRuntimeReference", "OutputCheck", "compare_outputs", "random_inputs"]
