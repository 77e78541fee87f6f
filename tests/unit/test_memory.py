"""The static memory plan: kernel outputs share one arena without ever overlapping while live."""

from __future__ import annotations

import numpy as np

import opfuse
from opfuse.runtime.memory import plan_memory
from tests.builders import TEST_DEVICE, residual_mlp
from tests.unit.test_fusion import ort_run
from tests.unit.test_layout import conv_net


def _lifetimes(plan: opfuse.runtime.plan.Plan) -> dict[str, tuple[int, int]]:
    """Independent of the planner: birth at the producing kernel, death at the last read of the
    value or of anything an op step derived from it (transitively), graph outputs never die."""
    outputs = {o.name for o in plan.outputs}
    derived: dict[str, set[str]] = {}
    for s in plan.steps:
        if s.kind == "op":
            for x in s.inputs:
                if x:
                    derived.setdefault(x, set()).update(o for o in s.outputs if o)
    spans = {}
    for i, s in enumerate(plan.steps):
        if s.kind != "kernel":
            continue
        for o in s.outputs:
            family, todo = {o}, [o]
            while todo:
                for d in derived.get(todo.pop(), ()):
                    if d not in family:
                        family.add(d)
                        todo.append(d)
            reads = [j for j, t in enumerate(plan.steps) for x in t.inputs if x in family]
            end = len(plan.steps) if family & outputs else max(reads, default=i)
            spans[o] = (i, end)
    return spans


def test_arena_reuses_memory_and_never_overlaps_live_buffers() -> None:
    for model, shapes in (
        (residual_mlp(hidden=32, ffn=64), {"x": [4, 32]}),
        (conv_net(), {"x": [2, 3, 8, 8]}),
    ):
        cm = opfuse.compile(model, shapes, device=TEST_DEVICE)
        mp = plan_memory(cm.plan)
        scratch = cm.report["memory"]["scratch_bytes"]  # split-K's, beside the arena: convs only
        assert cm.report["memory"] == {**mp.to_json(), "scratch_bytes": scratch}
        assert (scratch > 0) == any("USES_SCRATCH = True" in k.source for k in cm.plan.kernels.values())
        spans = _lifetimes(cm.plan)
        outputs = {o.name for o in cm.plan.outputs}
        assert set(mp.offsets) == set(spans) - outputs
        placed = sorted(mp.offsets)
        for a in placed:
            for b in placed:
                if a >= b:
                    continue
                (sa, ea), (sb, eb) = spans[a], spans[b]
                live_together = sa <= eb and sb <= ea
                apart = (
                    mp.offsets[a] + mp.nbytes[a] <= mp.offsets[b]
                    or mp.offsets[b] + mp.nbytes[b] <= mp.offsets[a]
                )
                assert apart or not live_together, (a, b)
        assert mp.max_live_bytes <= mp.arena_bytes <= mp.unshared_bytes


def test_outputs_survive_the_next_run() -> None:
    model = residual_mlp(hidden=32, ffn=64)
    cm = opfuse.compile(model, {"x": [4, 32]}, device=TEST_DEVICE)
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((4, 32)).astype(np.float32)} for _ in range(2)]
    first = cm.run(feeds[0])["y"].copy()
    kept = cm.run(feeds[0])["y"]
    cm.run(feeds[1])  # must not overwrite what the previous call returned
    np.testing.assert_allclose(kept, first)
    for f in feeds:
        np.testing.assert_allclose(cm.run(f)["y"], ort_run(model, f)[0], rtol=1e-4, atol=1e-5)
