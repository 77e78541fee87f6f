"""Static memory plan: the outputs of generated kernels share one arena, placed by liveness.

Every kernel output gets a fixed offset in one buffer, chosen at load time from the plan's step
order: two buffers may share bytes only if their lifetimes do not overlap. Lifetimes are
conservative about aliasing: a per-op step (a torch kernel) may return a view of its input
(Reshape, Transpose, Slice, ...), so a buffer read by an op step lives as long as that step's
outputs do, transitively. Graph outputs are never placed in the arena.

Placement is greedy by size (largest first, lowest offset that fits beside every buffer it is live
with), the usual heuristic for static tensor arenas; it is exact for chains and close to the
lower bound (the most bytes live at once) on the graphs opfuse sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opfuse.runtime.plan import Plan
from opfuse.runtime.tensors import torch_dtype

ALIGN = 256  # bytes: every buffer starts on a boundary the widest vector loads like


@dataclass
class MemoryPlan:
    offsets: dict[str, int] = field(default_factory=dict)  # value -> byte offset in the arena
    nbytes: dict[str, int] = field(default_factory=dict)
    arena_bytes: int = 0
    # Without reuse: the sum of every placed buffer; with perfect reuse: the most bytes live at once.
    unshared_bytes: int = 0
    max_live_bytes: int = 0

    def to_json(self) -> dict[str, int]:
        return {
            "arena_bytes": self.arena_bytes,
            "unshared_bytes": self.unshared_bytes,
            "max_live_bytes": self.max_live_bytes,
            "buffers": len(self.offsets),
        }


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_memory(plan: Plan) -> MemoryPlan:
    graph_outputs = {o.name for o in plan.outputs}
    born: dict[str, int] = {}
    for i, s in enumerate(plan.steps):
        if s.kind == "kernel":
            for o in s.outputs:
                if o and o not in graph_outputs:
                    born[o] = i
    # Last use, extended through op steps (whose outputs may be views of their inputs), walking the
    # steps backwards so an output's extended end is known before its inputs are visited.
    end: dict[str, int] = {o: len(plan.steps) for o in graph_outputs}  # read after the last step
    for i in range(len(plan.steps) - 1, -1, -1):
        s = plan.steps[i]
        out_end = max((end.get(o, i) for o in s.outputs if o), default=i) if s.kind == "op" else i
        for x in s.inputs:
            if x:
                end[x] = max(end.get(x, i), out_end, i)
    mp = MemoryPlan()
    intervals: list[tuple[str, int, int, int]] = []
    for name, b in born.items():
        spec = plan.values[name]
        size = _align(max(1, spec.numel * torch_dtype(spec.dtype).itemsize))
        intervals.append((name, b, end.get(name, b), size))
        mp.nbytes[name] = size
    mp.unshared_bytes = sum(size for *_, size in intervals)
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
    for name, b, e, size in sorted(intervals, key=lambda t: (-t[3], t[1])):
        busy = sorted((off, off + sz) for s0, e0, off, sz in placed if s0 <= e and b <= e0)
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        placed.append((b, e, offset, size))
        mp.offsets[name] = offset
        mp.arena_bytes = max(mp.arena_bytes, offset + size)
    for i in range(len(plan.steps)):
        live = sum(size for _, b, e, size in intervals if b <= i <= e)
        mp.max_live_bytes = max(mp.max_live_bytes, live)
    return mp
