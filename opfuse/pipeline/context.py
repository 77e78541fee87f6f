"""What the stages of one compile share: progress for clients, timings for the report, fault notes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from opfuse.errors import BUG_NOTE, describe

ProgressFn = Callable[[str, float], None]

# The stages in the order they run, as reported to the worker protocol (DESIGN.md §3, Job.stage).
# opfuse.compile runs the first six; benchmarking and packaging belong to whoever benchmarks and
# saves the bundle (workers/pipeline.py).
STAGES = ("loading", "fusing", "codegen", "profiling", "tuning", "verifying", "benchmarking", "packaging")

__all__ = ["BUG_NOTE", "STAGES", "CompileContext", "ProgressFn", "describe"]


class CompileContext:
    """Enters the stages of one compile in STAGES order: `with ctx.stage("fusing", 0.3, "fuse"):`
    tells `progress` (stage name, overall fraction) and adds the stage's wall time to
    `timings[timing]` (report["timings_s"]; several stages may share one key)."""

    def __init__(self, progress: ProgressFn | None = None) -> None:
        self.progress: ProgressFn = progress or (lambda stage, fraction: None)
        self.timings: dict[str, float] = {}
        self.entered: list[str] = []

    @contextlib.contextmanager
    def stage(self, name: str, fraction: float, timing: str | None = None) -> Iterator[None]:
        if name not in STAGES:
            raise ValueError(f"unknown compile stage {name!r}; the stages are {', '.join(STAGES)}")
        if self.entered and STAGES.index(name) < STAGES.index(self.entered[-1]):
            raise RuntimeError(f"compile stage {name!r} entered after {self.entered[-1]!r}: see STAGES")
        self.entered.append(name)
        self.progress(name, fraction)
        t = time.perf_counter()
        yield
        if timing is not None:
            self.timings[timing] = self.timings.get(timing, 0.0) + time.perf_counter() - t
