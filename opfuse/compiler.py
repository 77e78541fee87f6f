"""The compile pipeline, top to bottom, and the CompiledModel users hold.

load → specialize → passes → plan → codegen → verify (→ benchmark on request) → bundle
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch

from opfuse.errors import BundleError, ModelError
from opfuse.frontend import rule_registry
from opfuse.frontend.inspect import default_opset
from opfuse.frontend.load import load_and_specialize
from opfuse.fusion.coverage import explain_unfused
from opfuse.fusion.planner import FusionPlan, plan_fusion
from opfuse.graph import graph_from_onnx
from opfuse.ir.ops import CONV_OPS
from opfuse.lowering import build_plan, split_form, template_only
from opfuse.passes.pipeline import optimize_onnx, run_passes
from opfuse.passes.precision import COMPUTE_DTYPES, apply_precision
from opfuse.passes.rules import node_label
from opfuse.profile.costs import profile_steps, roofline
from opfuse.runtime.bundle import BUNDLE_FORMAT, BUNDLE_VERSION, read_bundle, write_bundle
from opfuse.runtime.executor import Executor
from opfuse.runtime.ops import SUPPORTED_OPS
from opfuse.runtime.plan import Plan
from opfuse.verify.compare import DEFAULT_TOLERANCES, WIDE_RANGE, OutputCheck, compare_outputs
from opfuse.verify.reference import OnnxRuntimeReference, random_inputs

# Stage names, as reported to the worker protocol (DESIGN.md §3, Job.stage).
STAGES = ("loading", "profiling", "fusing", "codegen", "tuning", "verifying", "benchmarking", "packaging")
VERIFY_TRIALS = 2

ProgressFn = Callable[[str, float], None]


DEFAULT_TUNE_BUDGET_S = 60.0
# Fewer kernels than this compile in the compiler's own process: starting workers costs more.
PARALLEL_COMPILE_MIN_KERNELS = 8


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


def device_info(device: str) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__}
    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        cap = torch.cuda.get_device_capability(idx)
        info.update(
            kind="cuda",
            name=torch.cuda.get_device_name(idx),
            capability=f"{cap[0]}.{cap[1]}",
            cuda=torch.version.cuda,
        )
    else:
        info.update(
            kind="cpu-interpreter",
            name=platform.processor() or platform.machine(),
            capability=None,
            cuda=None,
        )
    return info


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
            from opfuse.runtime.cudagraph import GraphRunner

            try:
                self._graph = GraphRunner(self.executor, env)
            except Exception as exc:  # capture is an optimization: fall back to step-by-step runs
                self._graph = False
                self.cuda_graph_error = f"{type(exc).__name__}: {str(exc)[:200]}"
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
    report_progress = progress or (lambda stage, frac: None)
    timings: dict[str, float] = {}
    disabled = set(fusion_disable)

    t = time.perf_counter()
    report_progress("loading", 0.0)
    original, specialized = load_and_specialize(model, input_shapes, SUPPORTED_OPS)
    optimized, optimizer_status = optimize_onnx(specialized)
    graph = graph_from_onnx(optimized)
    declared_inputs, declared_outputs = list(graph.inputs), list(graph.outputs)
    # The "before": the model as uploaded, one per-op kernel per node, in the same precision.
    original_graph = graph.copy()
    reference_graph = graph.copy()  # float32, unfused: the fallback reference
    passes = run_passes(graph, disabled, precision, device)
    graph.disabled = set(disabled)  # codegen's own switches (split_k)
    cast: dict[int, Any] = {}  # the two graphs share weight arrays: each is cast once
    apply_precision(graph, precision, cast)
    apply_precision(original_graph, precision, cast)
    timings["load"] = time.perf_counter() - t

    t = time.perf_counter()
    report_progress("fusing", 0.3)
    # Groups that must run unfused, each with why: its codegen, kernel compile, tuning or first run
    # raised, or its kernel failed in a worker. The compile goes on without them.
    unsafe: dict[str, str] = {}
    fault_notes: list[dict[str, Any]] = []  # faults no group owns (the planner's): for not_fused
    try:
        fusion = plan_fusion(graph, disabled)
    except ModelError:
        raise
    except Exception as exc:  # a planner fault: the model runs unfused rather than not at all
        fusion = FusionPlan([], [])
        fault_notes.append(
            {
                "rule": "fusion_planner",
                "nodes": [],
                "reason": f"planning fusion raised {_describe(exc)}, so every node runs unfused; {BUG_NOTE}",
            }
        )
    timings["fuse"] = time.perf_counter() - t

    t = time.perf_counter()
    report_progress("codegen", 0.4)
    base_plan = build_plan(original_graph, FusionPlan([], []), precision, declared_inputs, declared_outputs)
    variants: dict[str, str] = {}
    configs: dict[str, dict[str, Any]] = {}  # kernel signature -> tuned launch config

    def build(enabled: list[str]) -> Plan:
        return build_plan(
            graph, fusion, precision, declared_inputs, declared_outputs, enabled=enabled, variants=variants
        )

    def make_plan(enabled: list[str] | None = None) -> Plan:
        """The fused plan with the tuned variants and configs (all groups fused when None), less
        the unsafe groups. A group whose codegen raises becomes one (found by halving the groups)."""
        ids = [g.id for g in fusion.groups if (enabled is None or g.id in enabled) and g.id not in unsafe]
        try:
            p = build(ids)
        except ModelError:
            raise
        except Exception as exc:
            faults = _faulty_groups(ids, build)
            if not faults:  # no group fails alone: together, then
                faults = {
                    gid: f"generating the kernels of the groups together raised {_describe(exc)}"
                    for gid in ids
                }
            unsafe.update({gid: f"codegen: {why}" for gid, why in faults.items()})
            p = build([i for i in ids if i not in unsafe])
        if configs:
            from opfuse.tune import kernel_signature

            for k in p.kernels.values():
                k.config = dict(configs.get(kernel_signature(k), k.config))
        return p

    plan = make_plan()
    timings["codegen"] = time.perf_counter() - t

    explicit_budget = tune_budget_s is not None
    if tune_budget_s is None:
        tune_budget_s = float(os.environ.get("OPFUSE_TUNE_BUDGET_S", DEFAULT_TUNE_BUDGET_S))
    # On the CPU (the interpreter: its times are no speed claim) tuning runs only when asked for
    # with an explicit budget, to exercise it where there is no GPU (tests).
    tuned = (device.startswith("cuda") or explicit_budget) and bool(plan.kernels) and tune_budget_s > 0
    cache = None
    if tuned:
        from opfuse.tune import TuningCache

        cache = TuningCache()
    compiles = (
        not cache.covers([plan]) if cache is not None else len(plan.kernels) >= PARALLEL_COMPILE_MIN_KERNELS
    )
    if compile_pool is not None and compiles:
        # The kernel-compile workers import torch and start their CUDA contexts while the
        # unfused plan is profiled. A warm compile (every config cached) or a small untuned plan
        # starts none here.
        compile_pool.start()

    rng = np.random.default_rng()
    verifier = None
    if verify:
        # The reference outputs of the first trials (onnxruntime on the CPU) are computed in the
        # background while the GPU profiles and tunes: they do not depend on the plan.
        d_rtol, d_atol = DEFAULT_TOLERANCES[precision]
        tol = (rtol if rtol is not None else d_rtol, atol if atol is not None else d_atol)
        fallback = build_plan(reference_graph, FusionPlan([], []), "fp32", declared_inputs, declared_outputs)
        verifier = _Verifier(
            original, declared_inputs, device, tol, rng, fallback, precision in WIDE_RANGE, background=True
        )
    t = time.perf_counter()
    report_progress("profiling", 0.5)
    profile_feeds = random_inputs(declared_inputs, rng)
    base_executor = Executor(base_plan, device)
    base_executor.run(profile_feeds)  # warm-up: first-call costs stay out of the profile
    before_times = base_executor.time_steps(profile_feeds)
    timings["profile"] = time.perf_counter() - t

    t = time.perf_counter()
    tuning: dict[str, Any] = {}
    if tuned:
        report_progress("tuning", 0.55)
        groups, lone = list(fusion.groups), list(fusion.lone)
        try:
            tuning = _tune(
                graph,
                fusion,
                plan,
                make_plan,
                variants,
                configs,
                device,
                profile_feeds,
                tune_budget_s,
                _group_times(base_plan, before_times, fusion),
                compile_pool,
                cache,
            )
        except ModelError:
            raise
        except Exception as exc:  # a fault of tuning as a whole: every kernel untuned, as with it off
            fusion.groups[:], fusion.lone = groups, lone
            variants.clear()
            configs.clear()
            tuning = {
                "error": f"tuning raised {_describe(exc)}; every kernel runs at its default launch "
                f"config, untuned (verified as usual); {BUG_NOTE}"
            }
            if compile_pool is not None:
                compile_pool.close()
        unsafe.update(tuning.get("unsafe", {}))
        plan = make_plan()
    elif compile_pool is not None and len(plan.kernels) >= PARALLEL_COMPILE_MIN_KERNELS:
        from opfuse.tune import config_key, kernel_signature, precompile

        report_progress("tuning", 0.55)
        pre = precompile([plan], None, compile_pool)  # the untuned plan's kernels, in parallel
        compile_pool.close()
        tuning = {"compile_failed": {}, "unsafe_groups": [], "refit": {}}
        for kid, k in plan.kernels.items():
            sig = kernel_signature(k)
            if sig in pre.refit:  # its start config failed; it runs at the first that compiled
                configs[sig] = dict(k.config)
                tuning["refit"][kid] = {"config": k.config, "start_failed": pre.refit[sig][1]}
            timing = pre.failed.get((sig, config_key(k.config)))
            if timing is not None:  # never run in this process what failed or crashed in a worker
                tuning["compile_failed"][kid] = timing.error
                unsafe.setdefault(k.group, f"its generated kernel failed in a compile worker: {timing.error}")
        if unsafe:
            tuning["unsafe_groups"] = sorted(unsafe)
        if pre.start_error:
            tuning["error"] = (
                f"{pre.start_error}; the kernels were not compiled ahead (each compiles at its first run "
                "here). Check that `python -m opfuse.tuning.pool` starts on this host: it must import "
                "opfuse, torch and triton"
            )
        if unsafe or pre.refit:
            plan = make_plan()
    timings["tune"] = time.perf_counter() - t

    t = time.perf_counter()
    report_progress("verifying", 0.6)
    # The first run of the fused plan here: a group whose kernel fails to compile or to run is
    # left unfused, and the plan runs again without it.
    plan, first = _first_run(plan, device, profile_feeds, make_plan, unsafe)
    verification: dict[str, Any] = {"passed": None, "reference": None, "outputs": {}, "rolled_back": []}
    if verifier is not None:
        plan, verification = verifier.verify_with_rollback(
            graph, fusion, plan, precision, declared_inputs, declared_outputs, make_plan
        )
    timings["verify"] = time.perf_counter() - t

    if tuned:
        tuned_kernels(plan, tuning)
    if first.plan is plan:  # it ran once already: warm
        executor = first
    else:
        executor = Executor(plan, device)
        executor.run(profile_feeds)
    after_times = executor.time_steps(profile_feeds)
    before_profile = profile_steps(base_plan, before_times, device=device)
    after_profile = profile_steps(plan, after_times, device=device)
    group_time_before = _group_times(base_plan, before_times, fusion)
    kernel_time_after: dict[str, float] = {}
    for step, t_ms in zip(plan.steps, after_times, strict=False):
        if step.group:  # a vendor-variant group is its library step plus its epilogue kernel
            kernel_time_after[step.group] = round(kernel_time_after.get(step.group, 0.0) + t_ms, 6)
    rolled = set(verification["rolled_back"])
    fused_groups = [g for g in fusion.groups if g.id not in rolled and g.id not in unsafe]
    conv_ms = _conv_times(base_plan, before_times, plan, after_times, fused_groups)
    kernel_of_group = {k.group: k.id for k in plan.kernels.values()}
    groups_json = []
    for g in fused_groups:
        d = g.to_json()
        d.update(
            kernel=kernel_of_group.get(g.id),
            bytes_saved_est=_bytes_saved(plan, g),
            time_ms_before=group_time_before.get(g.id),
            time_ms_after=kernel_time_after.get(g.id),
        )
        if g.id in variants:
            d["variant"] = variants[g.id]
        groups_json.append(d)
    not_fused = [nf.to_json() for nf in passes.not_fired + fusion.not_fused] + fault_notes
    by_id = {g.id: g for g in fusion.groups}
    for gid in sorted(unsafe):
        grp = by_id.get(gid)
        if grp is None:  # a group of a candidate plan that is not in this one (nothing of it runs)
            continue
        not_fused.append(
            {
                "rule": grp.rule,
                "nodes": [node_label(n) for n in [*grp.prologue, *grp.nodes]],
                "reason": f"{unsafe[gid]}; its nodes run unfused",
            }
        )
    for gid in sorted(rolled):
        grp = by_id.get(gid)
        if grp is None:
            continue
        not_fused.append(
            {
                "rule": grp.rule,
                "nodes": next(n.get("nodes") for n in [grp.to_json()]),
                "reason": "rolled back: the fused kernel failed verification",
            }
        )

    info = device_info(device)
    report: dict[str, Any] = {
        "device": {k: info[k] for k in ("kind", "name", "capability", "torch", "triton")},
        "precision": precision,
        "kernels": {"before": base_plan.launches, "after": plan.launches},
        "compute_nodes": sum(1 for s in base_plan.steps if s.launches),
        "speedup": None,
        "peers": {},
        "verification": verification,
        "fusion": {
            "groups": groups_json,
            "not_fused": not_fused,
            "passes": {"fired": passes.fired, "onnx_optimizer": optimizer_status},
        },
        "profile": {
            "roofline": roofline(precision, device),
            "ops": before_profile,
            "after": after_profile,
            **({"convolutions_ms": conv_ms} if conv_ms else {}),
            "timing": "cuda-synchronized wall time per step"
            if info["kind"] == "cuda"
            else "cpu wall time per step (interpreter: not a speed claim)",
        },
        "tuning": tuning,
        "memory": {**executor.memory.to_json(), "scratch_bytes": executor.scratch_bytes()},
        "timings_s": {k: round(v, 4) for k, v in timings.items()},
    }
    report["fusion"]["coverage"] = explain_unfused(graph, plan, report["fusion"]["not_fused"], disabled)
    manifest = _manifest(original, precision, info, declared_inputs, declared_outputs)
    report_progress("packaging", 0.95)
    return CompiledModel(plan, device, report, manifest, base_plan=base_plan)


def load(path: str | os.PathLike[str], device: str | None = None) -> CompiledModel:
    """Load a bundle written by CompiledModel.save. Only load bundles you trust: they hold code."""
    device = _resolve_device(device)
    plan, manifest, report = read_bundle(path)
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


class _UnfusedReference:
    """The fallback reference where onnxruntime cannot run a model: opfuse's unfused per-op plan
    in float32 on the CPU (independent of every fusion, though not of opfuse's op kernels)."""

    name = "opfuse-unfused-fp32-cpu"

    def __init__(self, plan: Plan, why: str) -> None:
        self.executor = Executor(plan, "cpu")
        self.why = why

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.executor.run(feeds).items()}


class _Verifier:
    def __init__(
        self,
        original: onnx.ModelProto,
        inputs: list[Any],
        device: str,
        tol: tuple[float, float],
        rng: np.random.Generator,
        fallback: Plan,
        scale_free: bool = False,
        background: bool = False,
    ) -> None:
        """`background`: the first trials' reference outputs are computed in a thread (onnxruntime
        releases the GIL), ready when the first check needs them."""
        self.scale_free = scale_free  # see compare_outputs
        # Output name -> the rtol it is held to where the unfused plan itself misses the
        # reference at this precision (precision_bound); empty: every output at self.tol.
        self.bound: dict[str, float] = {}
        self.baseline: dict[str, OutputCheck] = {}
        self.inputs = inputs
        self.device = device
        self.tol = tol
        self.rng = rng
        self.reference: Any = None
        # (feeds, reference outputs) computed ahead: the first check's trials.
        self.ready: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        feeds = [random_inputs(inputs, rng) for _ in range(VERIFY_TRIALS)]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if background:
            self._thread = threading.Thread(
                target=self._prepare, args=(original, fallback, feeds), daemon=True
            )
            self._thread.start()
        else:
            self._prepare(original, fallback, feeds)

    def _prepare(self, original: onnx.ModelProto, fallback: Plan, feeds: list[dict[str, np.ndarray]]) -> None:
        try:
            try:
                self.reference = OnnxRuntimeReference(original)
                # The first run also shows whether onnxruntime takes the model: it may load but
                # not run it (types, opsets).
                self.ready = [(f, self.reference.run(f)) for f in feeds]
            except Exception as exc:  # onnxruntime cannot run every valid model (newest opsets, bf16)
                self.ready = []
                self.reference = _UnfusedReference(
                    fallback, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                )
        except BaseException as exc:  # raised again where the check waits for it
            self._error = exc

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def check(self, plan: Plan) -> tuple[bool, dict[str, OutputCheck]]:
        """Fresh random inputs for every check; the worst result per output is kept."""
        self._wait()
        worst: dict[str, OutputCheck] = {}
        executor = Executor(plan, self.device)
        for _ in range(VERIFY_TRIALS):
            if self.ready:
                feeds, ref = self.ready.pop()
            else:
                feeds = random_inputs(self.inputs, self.rng)
                ref = self.reference.run(feeds)
            out = executor.run(feeds)
            for name, r in ref.items():
                rtol = self.bound.get(name, self.tol[0])
                c = compare_outputs(np.asarray(out[name]), r, rtol, self.tol[1], scale_free=self.scale_free)
                if name not in worst or (not c.passed) or c.rel_l2_err > worst[name].rel_l2_err:
                    if name in worst and not worst[name].passed and c.passed:
                        continue
                    worst[name] = c
        return all(c.passed for c in worst.values()), worst

    def verify_with_rollback(
        self,
        graph: Any,
        fusion: FusionPlan,
        plan: Plan,
        precision: str,
        inputs: list[Any],
        outputs: list[Any],
        make_plan: Callable[[list[str] | None], Plan],
    ) -> tuple[Plan, dict[str, Any]]:
        ok, checks = self.check(plan)
        rolled: list[str] = []
        note = ""
        if not ok:
            # Is fusion to blame? The unfused plan (one library op per node) at the same precision
            # is checked the same way: where it misses too, the miss is the precision's.
            if fusion.groups:
                base = build_plan(graph, FusionPlan([], []), precision, inputs, outputs)
                base_ok, base_checks = self.check(base)
            else:
                base_ok, base_checks = ok, checks
            if not base_ok:
                bound, why = precision_bound(base_checks, self.tol[0])
                if not bound:
                    return plan, self._json(
                        False,
                        checks,
                        rolled,
                        f"the unfused plan in {precision} also differs from the reference ({why}), so "
                        "no fusion is to blame: the model is too sensitive for this precision (try fp32 "
                        "or tf32, or a looser rtol), or an op is wrong",
                    )
                self.bound, self.baseline = bound, base_checks
                note = (
                    f"the unfused plan in {precision} differs from the reference by more than rtol "
                    f"{self.tol[0]:g} ({why}): that is this precision's own error on this model, not "
                    f"fusion's. Each such output is held to {PRECISION_BOUND_FACTOR:g}x the unfused "
                    "plan's relative L2 error instead (outputs.*.baseline_rel_l2_err)"
                )
                ok, checks = self.check(plan) if fusion.groups else (True, checks)
        if not ok and fusion.groups:
            ids = [g.id for g in fusion.groups]

            def fails(subset: list[str]) -> bool:
                try:
                    return not self.check(make_plan(subset))[0]
                except ModelError:
                    raise
                except Exception:  # a fused kernel that raises fails verification too
                    return True

            rolled = _bisect_bad(ids, fails)
            plan = make_plan([i for i in ids if i not in rolled])
            ok, checks = self.check(plan)
        return plan, self._json(ok, checks, rolled, note)

    def _json(
        self, ok: bool, checks: dict[str, OutputCheck], rolled: list[str], note: str = ""
    ) -> dict[str, Any]:
        d: dict[str, Any] = {
            "passed": ok,
            "reference": self.reference.name,
            "outputs": {k: self._output_json(k, v) for k, v in checks.items()},
            "rolled_back": rolled,
            "trials": VERIFY_TRIALS,
        }
        if note:
            d["note"] = note
        if self.bound:
            d["basis"] = "unfused_precision"
        if isinstance(self.reference, _UnfusedReference):
            d["reference_note"] = f"onnxruntime could not run the model ({self.reference.why})"
        return d

    def _output_json(self, name: str, check: OutputCheck) -> dict[str, Any]:
        d = check.to_json()
        if name in self.bound:
            d["baseline_rel_l2_err"] = self.baseline[name].rel_l2_err
        return d


def _tune(
    graph: Any,
    fusion: FusionPlan,
    plan: Plan,
    make_plan: Callable[[list[str] | None], Plan],
    variants: dict[str, str],
    configs: dict[str, dict[str, Any]],
    device: str,
    feeds: dict[str, Any],
    budget_s: float,
    group_ms: dict[str, float] | None = None,
    compiler: Any = None,
    cache: Any = None,
) -> dict[str, Any]:
    """Launch configs for every kernel, then template vs vendor per anchor group, by measurement.

    Kernels are tuned where the time is first: in order of their group's time in the unfused
    profile (`group_ms`), so a spent budget leaves only the cheap kernels at their defaults."""
    from opfuse.tune import (
        NO_WORKER,
        Precompiled,
        TuningCache,
        config_key,
        kernel_signature,
        precompile,
        tune_kernel_configs,
        unsafe_reasons,
        variant_group_times,
    )
    from opfuse.tuning.pool import CompilePool, TuningPool

    cache = cache or TuningCache()
    record: dict[str, Any] = {"kernels": {}, "variants": {}}
    # Anchors with nothing to fuse join as template candidates; those whose library kernel is
    # measured faster leave again below (they run as plain library ops, as without tuning).
    lone, fusion.lone = list(fusion.lone), []
    lone_ids = {g.id for g in lone}
    if lone:
        fusion.groups.extend(lone)
        plan = make_plan(None)
    # Groups timed against an alternative: their split form, or else the library's kernel (none
    # for a template-only group: merged sibling convs, whose template alone writes the Split's
    # parts, and a conv summing a shortcut, which the library has not).
    split_groups = {g.id: form for g in fusion.groups if (form := split_form(g)) is not None}
    anchors = [
        g.id
        for g in fusion.groups
        if g.variant == "template"
        and (g.id in split_groups or (g.kind in ("gemm", "conv", "pool") and not template_only(g)))
    ]
    # A variant choice is cached under its template kernel's signature: compiling the same model
    # again (or one with the same layers) skips the vendor plan and its timing altogether.
    template_kernel = {k.group: k for k in plan.kernels.values()}
    variant_key = {
        # A split-form choice is keyed apart: its "vendor" is two templates, not the library.
        gid: ("variant-split:" if gid in split_groups else "variant:")
        + kernel_signature(template_kernel[gid])
        for gid in anchors
        if gid in template_kernel
    }
    known: dict[str, Any] = {gid: cache.get(key) for gid, key in variant_key.items()}
    to_measure = [gid for gid in anchors if not known.get(gid)]
    candidates = {"template": plan}
    if to_measure:
        variants.update({gid: "vendor" for gid in anchors})
        candidates["vendor"] = make_plan(None)
        variants.clear()
    times: dict[str, dict[str, float]] = {}
    crashed: dict[str, dict[str, str]] = {}  # candidate plan -> group -> why it must not run here
    ran: dict[str, tuple[Executor, dict[str, Any]]] = {}
    # The budget starts once every kernel the candidate plans need is compiled (precompile).
    deadline = time.perf_counter() + budget_s
    pre = Precompiled()
    by_signature: dict[str, Any] = {}

    def tune(name: str, p: Plan, pool: Any) -> None:
        executor = Executor(p, device)
        priority = {kid: (group_ms or {}).get(k.group, 0.0) for kid, k in p.kernels.items()}
        tuned = tune_kernel_configs(p, executor, cache, deadline, pool, priority, pre)
        # Kernel ids are per plan (the template and vendor plans both have a "k0"): the record is
        # keyed by signature here, and by the final plan's kernel ids once the compile has it.
        for kid, k in p.kernels.items():
            configs[kernel_signature(k)] = dict(k.config)
            sig = kernel_signature(k)
            # Layers repeated: the first of a signature is timed, the rest are cache hits of it.
            if kid in tuned and not (sig in by_signature and tuned[kid].get("cached")):
                by_signature[sig] = tuned[kid]
        ran[name] = (executor, tuned)
        # A kernel still at a start config that failed to compile (none of its fallbacks did, and
        # tuning did not reach it): never run in this process either.
        failing = {
            k.group: f"its generated kernel failed to compile in a compile worker: {timing.error}"
            for k in p.kernels.values()
            if (timing := pre.failed.get((kernel_signature(k), config_key(k.config)))) is not None
        }
        crashed[name] = {**failing, **unsafe_reasons(p, tuned)}

    # The kernels are compiled in parallel first (CompilePool), each at the config it runs with;
    # then the candidate configs compile in the background, most profiled time first, while one
    # worker times those already compiled. Triton's interpreter (device "cpu") compiles nothing:
    # there the worker only times.
    # A warm compile (every choice and config in the tuning cache, so every kernel was compiled
    # and run cleanly on this GPU before, and sits in Triton's disk cache) starts neither: it
    # times nothing, and loading a handful of cached binaries in this process is faster than
    # starting workers to load them (on the H200 the worker pool cost 10-13 s of a 15-20 s warm
    # compile).
    gpu = device.startswith("cuda")
    warm = not to_measure and cache.covers(candidates.values())
    record["warm"] = warm
    with TuningPool(device) as pool:
        if not warm:
            pool.start(wait=False)
        if gpu and not warm:
            t0 = time.perf_counter()
            compiler = compiler or CompilePool(device)  # the caller's pool may have started already
            try:
                pre = precompile(list(candidates.values()), cache, compiler, budget_s, group_ms)
                record["refit"] = {
                    kid: {"config": k.config, "start_failed": pre.refit[kernel_signature(k)][1]}
                    for p in candidates.values()
                    for kid, k in p.kernels.items()
                    if kernel_signature(k) in pre.refit
                }
                record["compile_s"] = round(time.perf_counter() - t0, 2)
                record["compile_workers"] = compiler.workers
                deadline = pre.deadline or deadline
                for name, p in candidates.items():
                    tune(name, p, pool)
            finally:
                pre.close()
                compiler.close()  # frees its GPU contexts before the plans run here
        else:
            if gpu:  # warm
                if compiler is not None:
                    compiler.close()
                record["precompile"] = "skipped: every kernel's config is in the tuning cache"
            for name, p in candidates.items():
                tune(name, p, pool)
        if to_measure:  # the plans run here only with kernels that ran cleanly in the worker
            for name, (executor, tuned) in ran.items():
                times[name] = variant_group_times(candidates[name], executor, feeds, tuned)
        for gid in anchors:
            if gid not in to_measure:
                variants[gid] = known[gid]["choice"]
                record["variants"][gid] = {**known[gid], "cached": True}
                continue
            t_ms = times["template"].get(gid, float("inf"))
            v_ms = times.get("vendor", {}).get(gid, float("inf"))
            choice = "vendor" if v_ms < t_ms else "template"
            if gid in lone_ids and not t_ms < 0.97 * v_ms:  # a lone anchor leaves the library
                choice = "vendor"  # kernel only for a clear gain
            variants[gid] = choice
            record["variants"][gid] = {
                "choice": choice,
                "template_ms": round(t_ms, 5),
                "vendor_ms": round(v_ms, 5),
            }
            if gid in split_groups:  # its "vendor" form is two kernels (lowering.py)
                record["variants"][gid]["vendor_form"] = split_groups[gid]
            if gid in variant_key and min(t_ms, v_ms) < float("inf"):
                cache.put(variant_key[gid], {"choice": choice, "template_ms": t_ms, "vendor_ms": v_ms})
        if "vendor" not in candidates and any(
            v == "vendor" for g, v in variants.items() if g not in lone_ids
        ):
            # Vendor variants taken from the cache: their epilogue kernels' configs come from it too.
            vendor_plan = make_plan(None)
            if gpu and not cache.covers([vendor_plan]):
                with CompilePool(device) as late:
                    pre = precompile(
                        [vendor_plan], cache, late, max(0.0, deadline - time.perf_counter()), group_ms
                    )
                    try:
                        tune("vendor", vendor_plan, pool)
                    finally:
                        pre.close()
            else:
                tune("vendor", vendor_plan, pool)
    library = {g.id for g in lone if variants.get(g.id) == "vendor"}
    # A group whose kernel crashed the tuning worker in the variant it would run is not fused: the
    # compiler's own process must never run it (verification, benchmarks). Decided before the
    # lone anchors that run as library ops leave: they are no groups any more, and their template
    # never runs.
    unsafe = {
        gid: why
        for gid, why in crashed.get("template", {}).items()
        if gid not in anchors or variants.get(gid) != "vendor"
    }
    unsafe.update(
        {gid: why for gid, why in crashed.get("vendor", {}).items() if variants.get(gid) == "vendor"}
    )
    if library:
        fusion.groups[:] = [g for g in fusion.groups if g.id not in library]
        for gid in library:
            del variants[gid]
            unsafe.pop(gid, None)
    record["lone_anchors"] = {"template": sorted({g.id for g in lone} - library), "library": sorted(library)}
    record["unsafe_groups"] = sorted(unsafe)
    record["unsafe"] = unsafe
    no_worker = [r for r in by_signature.values() if r.get("skipped") == NO_WORKER]
    if no_worker:
        why = pool.start_error or pre.start_error or "no worker answered"
        record["error"] = (
            f"{why}; {len(no_worker)} kernels run untuned at their default launch configs (verified as "
            "usual). Check that `python -m opfuse.tuning.pool` starts on this host: it must import "
            "opfuse, torch and triton"
        )
    cache.save()
    record["cache_hits"] = cache.hits
    # By kernel signature, every distinct kernel of the plans tuned; tuned_kernels() keys them by
    # the final plan's kernel ids. The summary counts distinct kernels.
    record["kernels"] = by_signature
    record["summary"] = tuning_summary(by_signature, budget_s)
    return record


BUG_NOTE = "this is a bug in opfuse: please report it with the model"


def _describe(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _faulty_groups(ids: list[str], build: Callable[[list[str]], Any]) -> dict[str, str]:
    """The groups among `ids` whose code cannot be generated on their own, each with its error,
    found by halving (`build` of a set of groups raises where one of them cannot be generated)."""
    errors: dict[str, str] = {}

    def fails(subset: list[str]) -> bool:
        try:
            build(subset)
        except ModelError:
            raise
        except Exception as exc:
            if len(subset) == 1:
                errors[subset[0]] = f"generating its kernel raised {_describe(exc)}"
            return True
        return False

    return {gid: errors.get(gid, "generating its kernel raised") for gid in _bisect_bad(ids, fails)}


def _first_run(
    plan: Plan,
    device: str,
    feeds: dict[str, Any],
    make_plan: Callable[[], Plan],
    unsafe: dict[str, str],
) -> tuple[Plan, Executor]:
    """Compile the plan's kernels here and run it once on `feeds`; (the plan that ran, its warm
    executor). A group whose kernel fails to compile (load its generated module) or raises when
    it first runs joins `unsafe`, with why, and the plan is made again without it. A failure in a
    step no group owns is not fusion's: it is raised."""
    from opfuse.runtime import executor as executor_module

    interpret = not device.startswith("cuda")
    while True:
        bad: dict[str, str] = {}
        for k in plan.kernels.values():
            if k.group in bad:
                continue
            try:
                executor_module.load_kernel_module(k.source, interpret)
            except ModelError:
                raise
            except Exception as exc:
                bad[k.group] = f"compiling its generated kernel raised {_describe(exc)}"
        if not bad:
            runner = Executor(plan, device)
            at = [-1]
            runner.step_hook = lambda i, step, at=at: at.__setitem__(0, i)
            try:
                runner.run(feeds)
                runner.step_hook = None
                return plan, runner
            except ModelError:
                raise
            except Exception as exc:
                step = plan.steps[at[0]] if at[0] >= 0 else None
                if step is None or not step.group or step.group in unsafe:
                    raise
                what = f"kernel {step.kernel}" if step.kind == "kernel" else f"library op {step.op_type}"
                bad[step.group] = f"the first run of its {what} raised {_describe(exc)}"
        unsafe.update(bad)
        plan = make_plan()


def tuned_kernels(plan: Plan, tuning: dict[str, Any]) -> None:
    """tuning.kernels for the plan that runs: each kernel's tuning record under its id there (a
    repeated layer shares its signature's record)."""
    from opfuse.tune import kernel_signature

    by_signature = tuning.get("kernels")
    if by_signature:
        tuning["kernels"] = {
            kid: by_signature[sig]
            for kid, k in plan.kernels.items()
            if (sig := kernel_signature(k)) in by_signature
        }


def tuning_summary(kernels: dict[str, Any], budget_s: float) -> dict[str, Any]:
    """How far tuning got, at a glance: kernels timed now, taken from the cache, and left at their
    default config because the budget ran out (raise `tune_budget_s` if that is not 0), and
    candidate configs not compiled in time."""
    from opfuse.tune import BUDGET_SPENT

    return {
        "budget_s": budget_s,
        "kernels": len(kernels),
        "timed": sum(1 for k in kernels.values() if "candidates" in k),
        "cached": sum(1 for k in kernels.values() if k.get("cached")),
        "budget_spent": sum(1 for k in kernels.values() if k.get("skipped") == BUDGET_SPENT),
        "candidates_left_out": sum(int(k.get("left_out", 0)) for k in kernels.values()),
    }


PRECISION_BOUND_FACTOR = 2.0  # how much more error than the unfused plan's a fused output may have
PRECISION_BOUND_LIMIT = 5.0  # past this many rtols the unfused plan is wrong, not imprecise


def precision_bound(base: dict[str, OutputCheck], rtol: float) -> tuple[dict[str, float], str]:
    """Where the unfused plan misses the reference at the job's precision, what each output's
    rtol becomes: PRECISION_BOUND_FACTOR times the unfused plan's error, for an output it misses
    by at most PRECISION_BOUND_LIMIT rtols. Fusion changes the order of arithmetic, never the
    precision of the values between kernels; a deep network whose error in fp16 is already past
    rtol unfused (ResNet-50 with random weights: 2.8%) is held to what fusion adds. Empty (with why) where an
    output misses by more, has NaN, or has the wrong shape: that is not a rounding error."""
    bound: dict[str, float] = {}
    missed = [(name, c) for name, c in base.items() if not c.passed]
    for name, c in missed:
        if not (np.isfinite(c.rel_l2_err) and c.rel_l2_err <= PRECISION_BOUND_LIMIT * rtol) or c.reason:
            return {}, f"output {name!r}: relative L2 error {c.rel_l2_err:.3g}" + (
                f", {c.reason}" if c.reason else ""
            )
        bound[name] = PRECISION_BOUND_FACTOR * c.rel_l2_err
    why = ", ".join(f"output {name!r}: {c.rel_l2_err:.3g}" for name, c in missed)
    return bound, why


def _bisect_bad(ids: list[str], fails: Callable[[list[str]], bool]) -> list[str]:
    """The groups that fail on their own, found by halving the set of fused groups."""
    if not ids or not fails(ids):
        return []
    if len(ids) == 1:
        return list(ids)
    mid = len(ids) // 2
    return _bisect_bad(ids[:mid], fails) + _bisect_bad(ids[mid:], fails)


def _group_times(base_plan: Plan, times: list[float], fusion: FusionPlan) -> dict[str, float]:
    # Node ids are stable across passes, so a group's nodes are found in the unfused plan.
    by_node = {s.node: t for s, t in zip(base_plan.steps, times, strict=False) if s.kind == "op"}
    return {
        g.id: round(sum(by_node.get(n.id, 0.0) for n in [*g.prologue, *g.nodes]), 6) for g in fusion.groups
    }


def _conv_times(
    base_plan: Plan, before: list[float], plan: Plan, after: list[float], groups: list[Any]
) -> dict[str, float] | None:
    """Device time of the convolutions with their fused neighbours, unfused and fused: every Conv
    step and every node of a conv group before; conv groups (a vendor variant's library step
    too) and lone convolutions after. None for a model without convolutions."""
    conv_groups = {g.id for g in groups if g.kind in ("conv", "chain")}
    conv_nodes = {n.id for g in groups if g.kind in ("conv", "chain") for n in [*g.prologue, *g.nodes]}
    was = [
        t
        for s, t in zip(base_plan.steps, before, strict=False)
        if s.kind == "op" and (s.op_type in CONV_OPS or s.node in conv_nodes)
    ]
    now = [
        t
        for s, t in zip(plan.steps, after, strict=False)
        if s.group in conv_groups or (s.kind == "op" and s.op_type in CONV_OPS)
    ]
    if not was:
        return None
    return {"before": round(sum(was), 6), "after": round(sum(now), 6)}


def slower_note(
    before_ms: float, after_ms: float, conv_ms: dict[str, float] | None, channels_last: bool
) -> str:
    """Why a fused plan ran slower than the unfused one, as far as the profile tells, and what to
    try. Seen on the H200: ResNet-50 in fp32, whose dense convolutions cuDNN runs faster in NCHW
    than channels-last (10.5 against 11.8 ms at batch 32; such regions now stay NCHW in fp32,
    rule fp32_dense_nchw)."""
    note = (
        f"the fused plan ran slower than the unfused one (p50 {after_ms:.3f} ms against "
        f"{before_ms:.3f} ms); profile.ops and profile.after give each step's time before and after"
    )
    if conv_ms and conv_ms["after"] > 1.05 * conv_ms["before"]:
        note += (
            f". The convolutions with their fused ops took {conv_ms['after']:.3f} ms against "
            f"{conv_ms['before']:.3f} ms unfused"
        )
        if channels_last:
            note += (
                ', in channels-last: fusion.disable ["channels_last"] keeps them in NCHW, which '
                "some of the library's convolution kernels run faster; compare the two reports"
            )
    return note


def _bytes_saved(plan: Plan, group: Any) -> int:
    """Intermediates that no longer round-trip through memory: one write and one read each."""
    from opfuse.profile.costs import _ITEMSIZE

    outs = set(group.outputs)
    saved = 0
    for n in group.nodes:
        for o in n.outputs:
            if o and o not in outs and o in plan.values:
                spec = plan.values[o]
                saved += 2 * spec.numel * _ITEMSIZE.get(spec.dtype, 4)
    return saved


def _manifest(
    original: onnx.ModelProto, precision: str, info: dict[str, Any], inputs: list[Any], outputs: list[Any]
) -> dict[str, Any]:
    return {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "source": {
            "sha256": hashlib.sha256(original.SerializeToString()).hexdigest(),
            "name": original.graph.name,
            "opset": default_opset(original),
        },
        "target": {
            "device": "cuda" if info["kind"] == "cuda" else "cpu",
            "gpu_name": info["name"] if info["kind"] == "cuda" else None,
            "capability": info["capability"],
            "torch": info["torch"],
            "triton": info["triton"],
            "cuda": info["cuda"],
        },
        "precision": precision,
        "inputs": [s.to_json() for s in inputs],
        "outputs": [s.to_json() for s in outputs],
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
    }


__all__ = ["STAGES", "CompiledModel", "ModelError", "compile", "load"]
