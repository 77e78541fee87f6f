"""The stages of a compile, each a function of what the earlier ones made (docs/design.md, "The
pipeline as stages"): load, plan_groups, the plans (codegen), profile, tune, then verification
(opfuse/verify/rollback.py) and the report (opfuse/report.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from opfuse.errors import ModelError
from opfuse.frontend.load import load_and_specialize
from opfuse.fusion.groups import Group
from opfuse.fusion.planner import FusionPlan, plan_fusion
from opfuse.graph import Graph, TensorSpec, graph_from_onnx
from opfuse.lowering import build_plan
from opfuse.passes.pipeline import optimize_onnx, run_passes
from opfuse.passes.precision import apply_precision
from opfuse.pipeline.builder import PlanBuilder
from opfuse.pipeline.context import BUG_NOTE, describe
from opfuse.report import group_times
from opfuse.runtime.executor import Executor, device_lost
from opfuse.runtime.ops import SUPPORTED_OPS
from opfuse.runtime.plan import Plan
from opfuse.tuning import orchestrate
from opfuse.tuning.orchestrate import TuningResult
from opfuse.verify.compare import DEFAULT_TOLERANCES, WIDE_RANGE
from opfuse.verify.rollback import Verifier

DEFAULT_TUNE_BUDGET_S = 60.0
# Fewer kernels than this compile in the compiler's own process: starting workers costs more.
PARALLEL_COMPILE_MIN_KERNELS = 8


@dataclass
class Loaded:
    """The model, checked, specialized and rewritten. `graph`: after the passes, at the compile's
    precision (what fusion plans); `base_graph`: as uploaded at the same precision (the "before":
    one per-op kernel per node); `reference_graph`: float32, unfused (the fallback reference)."""

    original: onnx.ModelProto
    graph: Graph
    base_graph: Graph
    reference_graph: Graph
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    passes: Any  # the passes' record: fired, not_fired
    optimizer_status: str


@dataclass
class Fused:
    """The fusion plan, and faults of the planner that no group owns (for fusion.not_fused)."""

    fusion: FusionPlan
    fault_notes: list[dict[str, Any]]


@dataclass
class Timed:
    """A plan that ran, its per-step times (ms) on `feeds`, and its warm executor."""

    plan: Plan
    device: str
    feeds: dict[str, np.ndarray]
    times: list[float]
    executor: Executor


def load(
    model: str | os.PathLike[str] | bytes | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None,
    precision: str,
    device: str,
    disabled: set[str],
) -> Loaded:
    """Load and check, specialize shapes, fold constants (onnxscript), run the rewrite passes and
    cast to the compile's precision."""
    original, specialized = load_and_specialize(model, input_shapes, SUPPORTED_OPS)
    optimized, optimizer_status = optimize_onnx(specialized)
    graph = graph_from_onnx(optimized)
    inputs, outputs = list(graph.inputs), list(graph.outputs)
    base_graph = graph.copy()
    reference_graph = graph.copy()
    passes = run_passes(graph, disabled, precision, device)
    graph.disabled = set(disabled)  # codegen's own switches (split_k)
    cast: dict[int, Any] = {}  # the two graphs share weight arrays: each is cast once
    apply_precision(graph, precision, cast)
    apply_precision(base_graph, precision, cast)
    return Loaded(original, graph, base_graph, reference_graph, inputs, outputs, passes, optimizer_status)


def plan_groups(graph: Graph, disabled: set[str]) -> Fused:
    """Which nodes share a kernel. A fault of the planner leaves the model unfused rather than
    not compiled (a not_fused note says so)."""
    try:
        return Fused(plan_fusion(graph, disabled), [])
    except ModelError:
        raise
    except Exception as exc:
        reason = f"planning fusion raised {describe(exc)}, so every node runs unfused; {BUG_NOTE}"
        return Fused(FusionPlan([], []), [{"rule": "fusion_planner", "nodes": [], "reason": reason}])


def unfused_plan(graph: Graph, precision: str, loaded: Loaded) -> Plan:
    """One per-op kernel per node of `graph`: the "before", or the fallback reference."""
    return build_plan(graph, FusionPlan([], []), precision, loaded.inputs, loaded.outputs)


def tuning_budget(device: str, tune_budget_s: float | None, plan: Plan) -> float:
    """Seconds of tuning; 0 where it does not run. On the CPU (the interpreter: its times are no
    speed claim) tuning runs only when asked for with an explicit budget, to exercise it where
    there is no GPU (tests)."""
    explicit = tune_budget_s is not None
    if tune_budget_s is None:
        tune_budget_s = float(os.environ.get("OPFUSE_TUNE_BUDGET_S", DEFAULT_TUNE_BUDGET_S))
    tuned = (device.startswith("cuda") or explicit) and bool(plan.kernels) and tune_budget_s > 0
    return tune_budget_s if tuned else 0.0


def start_compile_workers(compile_pool: Any, plan: Plan, budget_s: float) -> Any:
    """The tuning cache where tuning runs (else None). The kernel-compile workers import torch and
    start their CUDA contexts while the unfused plan is profiled; a warm compile (every config
    cached) or a small untuned plan starts none."""
    cache = None
    if budget_s > 0:
        from opfuse.tuning.cache import TuningCache

        cache = TuningCache()
    compiles = (
        not cache.covers([plan]) if cache is not None else len(plan.kernels) >= PARALLEL_COMPILE_MIN_KERNELS
    )
    if compile_pool is not None and compiles:
        compile_pool.start()
    return cache


def start_verifier(
    loaded: Loaded, precision: str, device: str, rtol: float | None, atol: float | None, rng: Any
) -> Verifier:
    """The reference outputs of the first trials (onnxruntime on the CPU) are computed in the
    background while the GPU profiles and tunes: they do not depend on the plan."""
    d_rtol, d_atol = DEFAULT_TOLERANCES[precision]
    tol = (rtol if rtol is not None else d_rtol, atol if atol is not None else d_atol)
    fallback = unfused_plan(loaded.reference_graph, "fp32", loaded)
    return Verifier(
        loaded.original, loaded.inputs, device, tol, rng, fallback, precision in WIDE_RANGE, background=True
    )


def unverified() -> dict[str, Any]:
    """report["verification"] of a compile with verification off."""
    return {"passed": None, "reference": None, "outputs": {}, "rolled_back": []}


def profile(plan: Plan, device: str, feeds: dict[str, np.ndarray], warm: Executor | None = None) -> Timed:
    """Per-step times of `plan` on `feeds`, after a warm-up run (first-call costs stay out of the
    profile) unless `warm` is its executor that ran already."""
    executor = warm
    if executor is None:
        executor = Executor(plan, device)
        executor.run(feeds)
    return Timed(plan, device, feeds, executor.time_steps(feeds), executor)


def tune(
    builder: PlanBuilder,
    plan: Plan,
    lone: list[Group],
    before: Timed,
    budget_s: float,
    cache: Any,
    compile_pool: Any,
) -> TuningResult:
    """Tuning, or on the GPU with tuning off the parallel compile of a large plan, or nothing. A
    fault of tuning as a whole leaves every kernel untuned, as with it off."""
    untouched = TuningResult({}, list(builder.groups), dict(builder.variants), dict(builder.configs), {}, {})
    if budget_s > 0:
        group_ms = group_times(before.plan, before.times, builder.groups)
        try:
            return orchestrate.tune(
                builder, plan, lone, before.device, before.feeds, budget_s, group_ms, compile_pool, cache
            )
        except ModelError:
            raise
        except Exception as exc:
            if device_lost(exc):
                raise  # the device runs nothing after it: fail here, not at the next upload
            if compile_pool is not None:
                compile_pool.close()
            untouched.record = {
                "error": f"tuning raised {describe(exc)}; every kernel runs at its default launch "
                f"config, untuned (verified as usual); {BUG_NOTE}"
            }
            return untouched  # rebuilt: the configs tuning wrote into `plan` are not kept
    if compile_pool is not None and len(plan.kernels) >= PARALLEL_COMPILE_MIN_KERNELS:
        return orchestrate.precompile_untuned(builder, plan, compile_pool)
    untouched.rebuild = False
    return untouched
