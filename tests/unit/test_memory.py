"""The static memory plan: kernel outputs share one arena without ever overlapping while live."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

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


def test_a_kernel_handed_a_value_unlike_its_spec_is_not_launched(tmp_path: Any, monkeypatch: Any) -> None:
    """Every kernel input is held to the plan's shape and type before the launch: a smaller
    tensor (what a kernel would read past) or another type raises KernelInputMismatch, naming the
    step, and the kernel's output is left as it was; the right value launches. With
    OPFUSE_TRACE_LAUNCHES each launch appends its module and the address range of every input
    and output to the file."""
    import torch

    from opfuse.runtime.executor import Executor, KernelInputMismatch
    from opfuse.runtime.tensors import torch_dtype

    trace = tmp_path / "launches.txt"
    monkeypatch.setenv("OPFUSE_TRACE_LAUNCHES", str(trace))
    cm = opfuse.compile(residual_mlp(hidden=32, ffn=64), {"x": [4, 32]}, device=TEST_DEVICE)
    ex = Executor(cm.plan, TEST_DEVICE)
    feeds = {"x": np.random.default_rng(5).standard_normal((4, 32)).astype(np.float32)}
    with torch.no_grad():
        env = ex.run_tensors(ex.prepare_inputs(feeds), keep_all=True)
    i, step = next((i, s) for i, s in enumerate(cm.plan.steps) if s.kind == "kernel")
    name = cm.plan.kernels[step.kernel].inputs[0]
    right = env[name].clone()
    want = {o: env[o].clone() for o in step.outputs}
    for wrong in (
        right.reshape(-1)[:-1].clone(),
        right.to(torch.float64 if right.is_floating_point() else torch.float32),
    ):
        run_env = {**env, name: wrong}
        for o in step.outputs:
            run_env[o] = torch.full_like(env[o], 7)
        with pytest.raises(KernelInputMismatch, match=rf"step {i} .*input {name!r} is .*generated for"):
            ex._run_step(i, step, run_env)
        assert all(bool((run_env[o] == 7).all()) for o in step.outputs)
    lines_before = len(trace.read_text().splitlines())
    run_env = {**env, name: right}
    with torch.no_grad():
        ex._run_step(i, step, run_env)
    for o in step.outputs:
        assert run_env[o].dtype == torch_dtype(cm.plan.values[o].dtype)
        torch.testing.assert_close(run_env[o], want[o], rtol=0, atol=0)
    lines = trace.read_text().splitlines()
    assert len(lines) == lines_before + 1
    ptr = right.data_ptr()
    assert (
        f" step {i} {step.kernel} k_" in lines[-1]
        and f"{name}={ptr:#x}+{right.numel() * right.element_size()}" in lines[-1]
    )
