"""Graph rewrites before planning: cleanup, constant folding, BatchNormalization folding.

Each rule is data (`Rule`): a name users can disable per job, a matcher, a check that says why it
did not fire, and a rewrite. `run_passes` applies them in order and records what did not fire.
"""

from __future__ import annotations

from opfuse.passes.pipeline import PassResult, optimize_onnx, run_passes

__all__ = ["PassResult", "optimize_onnx", "run_passes"]
