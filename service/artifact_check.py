"""A worker's bundle is checked as `opfuse.load` checks it before the API stores it: every kernel
rendered again from its spec and compared with the shipped source, plan.json's kernel records and
steps against what the specs imply (opfuse.bundle_check).

The check runs as `python -m opfuse.bundle_check` in a process of its own: it renders kernels with
opfuse's templates, which the API does not import (docs/design.md, "Layering"), and a bundle that
makes it fail or hang takes down only that process. A worker key is not trusted with users'
machines: a bundle carrying code opfuse did not generate is refused (422), its job fails saying
so, and nothing is stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from service.check_budget import CheckBudget

CHECK_TIMEOUT_SECONDS = 300.0


class ArtifactCheckError(RuntimeError):
    """The check itself could not run (not the bundle's fault)."""


def artifact_problem(path: Path, size: int, limit: int, budget: CheckBudget) -> str | None:
    """Why the bundle at `path` (`size` bytes as uploaded) is refused, or None when it checks.
    `limit`: the most bytes its members may unpack to, together. The check parses the bundle's
    model.onnx, so it holds the check budget for the bundle's size while it runs."""
    command = [sys.executable, "-m", "opfuse.bundle_check", str(path), "--limit", str(limit)]
    with budget.hold(size):
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=CHECK_TIMEOUT_SECONDS, check=False
            )
        except subprocess.TimeoutExpired:
            return f"checking it took over {CHECK_TIMEOUT_SECONDS:.0f} s"
    lines = done.stdout.strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if lines else None
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict) or "ok" not in verdict:
        if done.returncode < 0:  # killed (out of memory): the bundle's doing
            return "checking it ran out of memory"
        raise ArtifactCheckError(f"the bundle check exited {done.returncode}: {done.stderr[-500:]}")
    return None if verdict["ok"] is True else str(verdict.get("problem", "it does not check"))[:1000]


def refusal(problem: str) -> str:
    """The job's error when its bundle was refused."""
    return (
        f"the worker's bundle was refused: {problem}. No bundle was stored; submit the job again "
        "(if it happens again, tell the service's operator: a worker runs another opfuse version "
        "or was tampered with)"
    )
