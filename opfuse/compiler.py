"""The compile pipeline, one stage a line, and the CompiledModel users hold.

load → fuse → codegen → profile → tune → verify → report (→ benchmark, package: CompiledModel)

Each stage is a function in opfuse/pipeline/stages.py (verification in opfuse/verify/, tuning in
opfuse/tuning/, the report in opfuse/report.py); docs/design.md ("The pipeline as stages") says
what each takes and makes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch

from opfuse.bundle_check import open_bundle
from opfuse.errors import BundleError, ModelError
from opfuse.frontend import rule_registry
from opfuse.passes.precision import COMPUTE_DTYPES
from opfuse.pipeline import stages
from opfuse.pipeline.builder import PlanBuilder
from opfuse.pipeline.context import STAGES, CompileContext, ProgressFn
from opfuse.report import assemble, device_info, manifest, slower_note, tuned_kernels
from opfuse.runtime.bundle import bundle_plan, write_bundle
from opfuse.runtime.executor import Executor
from opfuse.runtime.plan import Plan
from opfuse.verify.reference import random_inputs
from opfuse.verify.rollback import first_run


def _resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device; use device='cpu'")
    if device == "cpu":
        from opfuse.runtime.kernels import ensure_interpreter

        ensure_interpreter()
    return device


class CompiledModel:
    """A fused, verified model ready to run. See DESIGN.md §6."""

    def __init__(
        self,
        plan: Plan,
        device: str,
        report: dict[str, Any],
        manifest: dict[str, Any],
        base_plan: Plan | None = None,
    ) -> None:
        self.plan = plan
        self.base_plan = base_plan
        self.device = device
        self.report = report
        self.manifest = manifest
        self.executor = Executor(plan, device)
        self._graph: Any = None  # GraphRunner once captured; False when capture is not possible
        self.cuda_graph_error: str | None = None

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.plan.inputs]

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.plan.outputs]

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if not self.device.startswith("cuda"):
            return self.executor.run(inputs)
        torch_in = any(isinstance(v, torch.Tensor) for v in inputs.values())
        env = self.executor.prepare_inputs(inputs)
        runner = self._graph_runner(env)
        with torch.no_grad():
            outs = runner.run_tensors(env) if runner is not None else self.executor.run_tensors(env)
        result = {k: v.clone() if runner is not None else v for k, v in outs.items()}
        if torch_in:
            return result
        return {
            k: v.detach().cpu().float().numpy() if v.dtype == torch.bfloat16 else v.detach().cpu().numpy()
            for k, v in result.items()
        }

    def _graph_runner(self, env: dict[str, Any]) -> Any:
        """The plan captured as a CUDA graph, or None where it cannot be (the reason is kept)."""
        if self._graph is None:
            from opfuse.runtime.capture import CaptureBlocked
            from opfuse.runtime.cudagraph import GraphRunner

            try:
                self._graph = GraphRunner(self.executor, env)
            except Exception as exc:  # capture is an optimization: fall back to step-by-step runs
                self._graph = False
                limit = 600 if isinstance(exc, CaptureBlocked) else 200
                self.cuda_graph_error = f"{type(exc).__name__}: {str(exc)[:limit]}"
        return self._graph or None

    def benchmark(self, iters: int = 50, warmup: int = 5, input_sets: int = 3) -> dict[str, Any]:
        """Time before (per-op) and after (fused) with one protocol; fills the report's keys."""
        from opfuse.bench.protocol import measure

        rng = np.random.default_rng()
        feeds = [random_inputs(self.plan.inputs, rng) for _ in range(input_sets)]
        t0 = time.perf_counter()
        if self.base_plan is not None:
            self.report["before"] = measure(Executor(self.base_plan, self.device), feeds, iters, warmup)
        runner = None
        if self.device.startswith("cuda"):
            runner = self._graph_runner(self.executor.prepare_inputs(feeds[0]))
            self.report["after_stepwise"] = measure(self.executor, feeds, iters, warmup)
        self.report["after"] = measure(self.executor, feeds, iters, warmup, runner=runner)
        if self.cuda_graph_error:
            self.report["after"]["cuda_graph_error"] = self.cuda_graph_error
        before = self.report.get("before", {}).get("latency_ms", {}).get("p50")
        after = self.report["after"]["latency_ms"]["p50"]
        self.report["speedup"] = before / after if before and after else None
        self.report.pop("speedup_note", None)
        if before and after and after > before:
            self.report["speedup_note"] = slower_note(
                before,
                after,
                self.report.get("profile", {}).get("convolutions_ms"),
                "channels_last" in self.report.get("fusion", {}).get("passes", {}).get("fired", {}),
            )
        self.report.setdefault("timings_s", {})["benchmark"] = round(time.perf_counter() - t0, 3)
        return self.report

    def save(self, path: str | os.PathLike[str]) -> None:
        write_bundle(path, self.plan, self.manifest, self.report)


def compile(
    model: str | os.PathLike[str] | bytes | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    precision: str = "fp32",
    device: str | None = None,
    *,
    fusion_disable: Sequence[str] = (),
    rtol: float | None = None,
    atol: float | None = None,
    verify: bool = True,
    progress: ProgressFn | None = None,
    tune_budget_s: float | None = None,
) -> CompiledModel:
    """Compile an ONNX model into a fused, verified plan (DESIGN.md §6).

    `tune_budget_s` bounds GPU tuning (default: $OPFUSE_TUNE_BUDGET_S, else 60 s); 0 turns tuning
    off: default launch configs and the generated template for every anchor.
    """
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision must be one of {sorted(COMPUTE_DTYPES)}, got {precision!r}")
    rule_registry.check_disable(fusion_disable)  # a misspelt rule name is an error, not ignored
    device = _resolve_device(device)
    compile_pool = None
    if device.startswith("cuda"):
        from opfuse.tuning.pool import CompilePool

        # Started by _compile once the plan shows it will be used; closed however compile ends.
        compile_pool = CompilePool(device)
    try:
        return _compile(
            model,
            input_shapes,
            precision,
            device,
            fusion_disable=fusion_disable,
            rtol=rtol,
            atol=atol,
            verify=verify,
            progress=progress,
            tune_budget_s=tune_budget_s,
            compile_pool=compile_pool,
        )
    finally:
        if compile_pool is not None:
            compile_pool.close()


def _compile(
    model: str | os.PathLike[str] | bytes | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None,
    precision: str,
    device: str,
    *,
    fusion_disable: Sequence[str],
    rtol: float | None,
    atol: float | None,
    verify: bool,
    progress: ProgressFn | None,
    tune_budget_s: float | None,
    compile_pool: Any,
) -> CompiledModel:
    """Load the model, plan its fusion groups, generate the fused plan, profile the unfused plan,
    tune, and verify the fused plan against the reference (rolling back groups that fail), then
    assemble the report. `ctx` reports each stage to `progress` as it starts and times it."""
    ctx, disabled, rng = CompileContext(progress), set(fusion_disable), np.random.default_rng()
    with ctx.stage("loading", 0.0, "load"):
        loaded = stages.load(model, input_shapes, precision, device, disabled)
    with ctx.stage("fusing", 0.3, "fuse"):
        fused = stages.plan_groups(loaded.graph, disabled)
    with ctx.stage("codegen", 0.4, "codegen"):
        base_plan = stages.unfused_plan(loaded.base_graph, precision, loaded)
        builder = PlanBuilder(
            loaded.graph, list(fused.fusion.groups), precision, loaded.inputs, loaded.outputs
        )
        plan = builder.plan()
    budget_s = stages.tuning_budget(device, tune_budget_s, plan)
    cache = stages.start_compile_workers(compile_pool, plan, budget_s)
    verifier = stages.start_verifier(loaded, precision, device, rtol, atol, rng) if verify else None
    with ctx.stage("profiling", 0.5, "profile"):
        before = stages.profile(base_plan, device, random_inputs(loaded.inputs, rng))
    with ctx.stage("tuning", 0.55, "tune"):
        tuned = stages.tune(builder, plan, fused.fusion.lone, before, budget_s, cache, compile_pool)
        builder = builder.adopt(tuned)
        plan = builder.plan() if tuned.rebuild else plan
    with ctx.stage("verifying", 0.6, "verify"):
        plan, first = first_run(builder, plan, device, before.feeds)
        verification = stages.unverified()
        if verifier is not None:
            plan, verification = verifier.verify_with_rollback(builder, plan)
    tuned_kernels(plan, tuned.record)
    after = stages.profile(plan, device, before.feeds, warm=first if first.plan is plan else None)
    report = assemble(
        loaded, fused, builder, before, after, verification, tuned.record, ctx.timings, disabled
    )
    info = manifest(loaded.original, precision, device_info(device), loaded.inputs, loaded.outputs)
    return CompiledModel(plan, device, report, info, base_plan=base_plan)


def load(path: str | os.PathLike[str], device: str | None = None) -> CompiledModel:
    """Load a bundle written by CompiledModel.save. Its kernels are rendered again from their specs
    and run only as rendered here (opfuse.bundle_check): a bundle whose kernels or plan were
    altered is a BundleError, its shipped code never runs."""
    device = _resolve_device(device)
    checked = open_bundle(path)
    plan = bundle_plan(checked.plan, checked.constants, checked.sources)
    manifest, report = checked.manifest, checked.report
    target = manifest.get("target", {})
    here = device_info(device)
    if (
        target.get("device") == "cuda"
        and here["kind"] == "cuda"
        and target.get("capability") != here["capability"]
    ):
        raise BundleError(
            f"the bundle was compiled for a GPU of compute capability {target.get('capability')} "
            f"({target.get('gpu_name')}), but this one is {here['capability']} ({here['name']}); "
            "compile the model again on this GPU"
        )
    return CompiledModel(plan, device, report, manifest)


__all__ = ["STAGES", "CompiledModel", "ModelError", "compile", "load"]
