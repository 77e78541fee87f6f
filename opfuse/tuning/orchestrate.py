"""The compiler's tuning stage: what to build after measuring, as a TuningResult.

`tune` times every kernel's launch configs and, for each anchor group, its template against the
library's kernel (or its split form); `precompile_untuned` only compiles the untuned plan's
kernels in parallel on the GPU. Both return a TuningResult and change neither the fusion plan nor
the PlanBuilder they are given: PlanBuilder.adopt makes the builder of the tuned plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opfuse.codegen.registry import has_alternative, split_form
from opfuse.fusion.groups import Group
from opfuse.report import tuning_summary
from opfuse.runtime.executor import Executor, device_lost
from opfuse.runtime.plan import KernelInfo, Plan
from opfuse.tuning import configs as configs_module
from opfuse.tuning.cache import TuningCache, config_key, kernel_signature
from opfuse.tuning.configs import NO_WORKER, Precompiled, precompile
from opfuse.tuning.pool import CompilePool, TuningPool

if TYPE_CHECKING:
    from opfuse.pipeline.builder import PlanBuilder

WORKER_HINT = (
    "Check that `python -m opfuse.tuning.pool` starts on this host: it must import opfuse, torch and triton"
)


@dataclass
class TuningResult:
    """What tuning decided. `record`: report["tuning"]. `groups`: the groups the fused plan has
    (the planner's, less the lone anchors measured faster as library ops, plus those whose
    template won). `variants`: anchor group -> "template" or "vendor". `configs`: kernel signature
    -> launch config. `unsafe`: groups whose kernel failed in a worker, each with why (never run
    in the compiler's process). `codegen_faults`: groups whose code could not be generated in a
    candidate plan. `rebuild`: whether the plan must be made again (False where nothing changed)."""

    record: dict[str, Any]
    groups: list[Group]
    variants: dict[str, str]
    configs: dict[str, dict[str, Any]]
    unsafe: dict[str, str]
    codegen_faults: dict[str, str]
    rebuild: bool = True


def _plan_of(work: PlanBuilder, variants: dict[str, str]) -> tuple[Plan, dict[str, str]]:
    """The plan of `work`'s groups with `variants`, and the groups whose "vendor" form could not
    be generated, each with why: left out of that plan, and not marked unsafe in `work` (their
    templates generate; `work.plan` found those faults already)."""
    trial = work.derive(variants=variants)
    p = trial.plan()
    faults = {
        gid: why
        for gid, why in trial.unsafe.items()
        if gid not in work.unsafe and variants.get(gid) == "vendor"
    }
    work.unsafe.update(
        {gid: why for gid, why in trial.unsafe.items() if gid not in work.unsafe and gid not in faults}
    )
    return p, faults


def variant_cache_key(split: str | None, template: KernelInfo) -> str:
    """The tuning cache's key of a group's template-or-alternative choice: its template kernel's
    signature, and the alternative. A split form's choice is keyed apart, by the form (`split`,
    registry.split_form): its "vendor" is no library kernel, and a choice made against one form
    says nothing of another (pooled_gemm's became the library's GEMM where it had been the GEMM's
    template, 2026-12-06)."""
    return (f"variant-split:{split}:" if split is not None else "variant:") + kernel_signature(template)


def tune(
    builder: PlanBuilder,
    plan: Plan,
    lone: list[Group],
    device: str,
    feeds: dict[str, Any],
    budget_s: float,
    group_ms: dict[str, float] | None = None,
    compiler: Any = None,
    cache: TuningCache | None = None,
) -> TuningResult:
    """Launch configs for every kernel of `plan` (made by `builder`), then template vs vendor per
    anchor group, by measurement; `lone`: the planner's anchors with nothing to fuse, which become
    groups where their template is measured clearly faster than the library's kernel.

    Kernels are tuned where the time is first: in order of their group's time in the unfused
    profile (`group_ms`), so a spent budget leaves only the cheap kernels at their defaults.
    Neither `builder` nor the fusion plan is changed: the result says what to build."""
    cache = cache or TuningCache()
    record: dict[str, Any] = {"kernels": {}, "variants": {}}
    # Anchors with nothing to fuse join as template candidates; those whose library kernel is
    # measured faster leave again below (they run as plain library ops, as without tuning). The
    # candidate plans share one set of configs and codegen faults, this call's own.
    lone_ids = {g.id for g in lone}
    work = builder.derive(groups=[*builder.groups, *lone], variants={}, configs={})
    variants, configs = work.variants, work.configs
    if lone:
        plan = work.plan(None)
    # Groups timed against an alternative: their split form, or else the library's kernel (none
    # for a template-only group: merged sibling convs, whose template alone writes the Split's
    # parts, and a conv summing a shortcut, which the library has not).
    split_groups = {g.id: form for g in work.groups if (form := split_form(g)) is not None}
    anchors = [g.id for g in work.groups if g.variant == "template" and has_alternative(g)]
    # A variant choice is cached under its template kernel's signature: compiling the same model
    # again (or one with the same layers) skips the vendor plan and its timing altogether.
    template_kernel = {k.group: k for k in plan.kernels.values()}
    variant_key = {
        gid: variant_cache_key(split_groups.get(gid), template_kernel[gid])
        for gid in anchors
        if gid in template_kernel
    }
    known: dict[str, Any] = {gid: cache.get(key) for gid, key in variant_key.items()}
    to_measure = [gid for gid in anchors if not known.get(gid)]
    candidates = {"template": plan}
    # A group whose alternative cannot be generated is left out of the alternatives' plan (it runs
    # unfused there, so its template wins): the fault is the alternative's, never the group's.
    vendor_faults: dict[str, str] = {}
    if to_measure:
        candidates["vendor"], vendor_faults = _plan_of(work, {gid: "vendor" for gid in anchors})
    times: dict[str, dict[str, float]] = {}
    retimed: dict[str, dict[str, list[float]]] = {}  # the close groups' second look (_retime_close)
    crashed: dict[str, dict[str, str]] = {}  # candidate plan -> group -> why it must not run here
    ran: dict[str, tuple[Executor, dict[str, Any]]] = {}
    # The budget starts once every kernel the candidate plans need is compiled (precompile).
    deadline = time.perf_counter() + budget_s
    pre = Precompiled()
    by_signature: dict[str, Any] = {}

    def tune(name: str, p: Plan, pool: Any) -> None:
        executor = Executor(p, device)
        priority = {kid: (group_ms or {}).get(k.group, 0.0) for kid, k in p.kernels.items()}
        tuned = configs_module.tune_kernel_configs(p, executor, cache, deadline, pool, priority, pre)
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
        crashed[name] = {**failing, **configs_module.unsafe_reasons(p, tuned)}

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
                t1 = time.perf_counter()
                for name, p in candidates.items():
                    tune(name, p, pool)
                record["configs_s"] = round(time.perf_counter() - t1, 2)
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
            t1 = time.perf_counter()
            for name, (executor, tuned) in ran.items():
                times[name] = configs_module.variant_group_times(candidates[name], executor, feeds, tuned)
            retimed = _retime_close(candidates, ran, times, to_measure, feeds, gpu, record)
            record["variants_s"] = round(time.perf_counter() - t1, 2)
        for gid in anchors:
            if gid not in to_measure:
                variants[gid] = known[gid]["choice"]
                record["variants"][gid] = {**known[gid], "cached": True}
                continue
            t_ms = times["template"].get(gid, float("inf"))
            v_ms = times.get("vendor", {}).get(gid, float("inf"))
            again: dict[str, Any] = {}
            if gid in retimed.get("template", {}):  # close at first: the medians of the rounds decide
                ts, vs = retimed["template"][gid], retimed["vendor"][gid]
                again = {
                    "first_ms": [round(t_ms, 5), round(v_ms, 5)],
                    "template_range": [round(ts[0], 5), round(ts[-1], 5)],
                    "vendor_range": [round(vs[0], 5), round(vs[-1], 5)],
                    "rounds": len(ts),
                }
                t_ms, v_ms = ts[len(ts) // 2], vs[len(vs) // 2]
            choice = "vendor" if v_ms < t_ms else "template"
            if gid in lone_ids and not t_ms < 0.97 * v_ms:  # a lone anchor leaves the library
                choice = "vendor"  # kernel only for a clear gain
            variants[gid] = choice
            record["variants"][gid] = {
                "choice": choice,
                "template_ms": round(t_ms, 5),
                "vendor_ms": round(v_ms, 5),
            }
            if again:
                record["variants"][gid]["retimed"] = again
            if gid in split_groups:  # its "vendor" form is two kernels (lowering.py)
                record["variants"][gid]["vendor_form"] = split_groups[gid]
            if gid in vendor_faults:
                record["variants"][gid]["vendor_error"] = vendor_faults[gid]
            # Only what both ran is remembered: an alternative that failed is measured next time.
            if gid in variant_key and max(t_ms, v_ms) < float("inf"):
                cache.put(variant_key[gid], {"choice": choice, "template_ms": t_ms, "vendor_ms": v_ms})
        if "vendor" not in candidates and any(
            v == "vendor" for g, v in variants.items() if g not in lone_ids
        ):
            # Vendor variants taken from the cache: their epilogue kernels' configs come from it too.
            # One this opfuse cannot generate (a choice cached by another version) keeps its template.
            vendor_plan, broken = _plan_of(work, dict(variants))
            for gid, why in broken.items():
                variants[gid] = "template"
                record["variants"][gid] = {
                    **record["variants"][gid],
                    "choice": "template",
                    "vendor_error": why,
                }
            if broken:
                vendor_plan = work.plan(None)
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
    groups = [g for g in work.groups if g.id not in library]
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
            f"usual). {WORKER_HINT}"
        )
    cache.save()
    record["cache_hits"] = cache.hits
    # By kernel signature, every distinct kernel of the plans tuned; tuned_kernels() keys them by
    # the final plan's kernel ids. The summary counts distinct kernels.
    record["kernels"] = by_signature
    record["summary"] = tuning_summary(by_signature, budget_s)
    faults = {gid: why for gid, why in work.unsafe.items() if gid not in builder.unsafe}
    return TuningResult(record, groups, dict(variants), dict(configs), unsafe, faults)


# Rounds of the second look at close choices, and launches a round (retime_close): on a GPU each
# round captures each form's group as a CUDA graph (4-8 ms), replays it (tens of microseconds)
# and lets it go; in Triton's interpreter a launch of a template takes about as long as a whole
# GPU round, so there it is a few.
RETIME_GPU = (5, 20)
RETIME_CPU = (3, 1)


def _retime_close(
    candidates: dict[str, Plan],
    ran: dict[str, tuple[Executor, dict[str, Any]]],
    times: dict[str, dict[str, float]],
    gids: list[str],
    feeds: dict[str, Any],
    gpu: bool,
    record: dict[str, Any],
) -> dict[str, dict[str, list[float]]]:
    """configs.retime_close over the anchor groups being chosen, where both plans ran whole (a plan
    with a kernel unsafe here was scored from the worker's times instead, and is not run again).
    A failure keeps the first times and is one line of the record: this is a second opinion."""
    if set(ran) != {"template", "vendor"} or any(
        configs_module.unsafe_groups(candidates[name], tuned) for name, (_, tuned) in ran.items()
    ):
        return {}
    first = {
        name: {gid: times[name].get(gid, float("inf")) for gid in gids} for name in ("template", "vendor")
    }
    rounds, reps = RETIME_GPU if gpu else RETIME_CPU
    t0 = time.perf_counter()
    try:
        retimed = configs_module.retime_close(
            {name: ran[name][0] for name in ("template", "vendor")},
            feeds,
            first,
            rounds,
            reps,
        )
    except Exception as exc:  # the first times stand; the record says why
        if device_lost(exc):
            raise  # not a second opinion that failed: the device runs nothing after it
        record["retime_error"] = f"{type(exc).__name__}: {exc}"
        return {}
    if retimed:
        record["retime"] = {"groups": len(retimed["template"]), "s": round(time.perf_counter() - t0, 2)}
    return retimed


def precompile_untuned(builder: PlanBuilder, plan: Plan, compile_pool: CompilePool) -> TuningResult:
    """Tuning off on the GPU, a plan of many kernels: compile them in parallel (each at its default
    config, or the first smaller one that compiles where that fails) before this process runs
    them; a kernel that failed in a compile worker leaves its group unfused."""
    pre = precompile([plan], None, compile_pool)  # the untuned plan's kernels, in parallel
    compile_pool.close()
    record: dict[str, Any] = {"compile_failed": {}, "unsafe_groups": [], "refit": {}}
    configs: dict[str, dict[str, Any]] = dict(builder.configs)
    unsafe: dict[str, str] = {}
    for kid, k in plan.kernels.items():
        sig = kernel_signature(k)
        if sig in pre.refit:  # its start config failed; it runs at the first that compiled
            configs[sig] = dict(k.config)
            record["refit"][kid] = {"config": k.config, "start_failed": pre.refit[sig][1]}
        timing = pre.failed.get((sig, config_key(k.config)))
        if timing is not None:  # never run in this process what failed or crashed in a worker
            record["compile_failed"][kid] = timing.error
            if k.group not in builder.unsafe:
                unsafe.setdefault(k.group, f"its generated kernel failed in a compile worker: {timing.error}")
    if unsafe or builder.unsafe:
        record["unsafe_groups"] = sorted({*builder.unsafe, *unsafe})
    if pre.start_error:
        record["error"] = (
            f"{pre.start_error}; the kernels were not compiled ahead (each compiles at its first run "
            f"here). {WORKER_HINT}"
        )
    rebuild = bool(unsafe or builder.unsafe or pre.refit)
    return TuningResult(
        record, list(builder.groups), dict(builder.variants), configs, unsafe, {}, rebuild=rebuild
    )
