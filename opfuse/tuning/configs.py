"""Per-kernel tuning: compile the candidate configs ahead in parallel, time each in a worker, keep the
fastest that agrees with the others.

Every candidate is timed on random inputs of the kernel's real shapes, in a worker process
(opfuse/tuning/pool.py): a candidate that fails scores infinity, and one that crashes or hangs the
worker is killed with it instead of the compiler. Results are cached by kernel signature, GPU and
versions (opfuse/tuning/cache.py). A time budget bounds the work: kernels not reached keep their
default config.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from opfuse.runtime.executor import Executor, GroupTimer
from opfuse.runtime.plan import KernelInfo, Plan
from opfuse.runtime.tensors import torch_dtype
from opfuse.runtime.timing_lock import timing_section
from opfuse.tuning import candidates as search
from opfuse.tuning.cache import TuningCache, config_key, kernel_signature
from opfuse.tuning.candidates import CANDIDATES, fallback_configs
from opfuse.tuning.pool import CompileJob, CompilePool, Timing, TimingRequest, TuningPool, cuda_graph_ms

__all__ = [
    "BUDGET_SPENT",
    "CANDIDATES",
    "LEFT_OUT",
    "NO_WORKER",
    "Precompiled",
    "TuningCache",
    "agreeing_configs",
    "config_key",
    "fallback_configs",
    "first_configs_that_compile",
    "kernel_signature",
    "precompile",
    "retime_close",
    "tune_kernel_configs",
    "unsafe_reasons",
    "variant_group_times",
]


def _random_tensor(plan: Plan, name: str, device: torch.device) -> torch.Tensor:
    spec = plan.values[name]
    dtype = torch_dtype(spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, device=device).to(dtype)
    return torch.randint(0, 4, spec.shape, device=device).to(dtype)


def time_launch(fn: Any, reps: int = 10) -> float:
    """Device time of one launch, timed in this process (see pool.cuda_graph_ms)."""
    return cuda_graph_ms(fn, reps)


def tune_inprocess() -> bool:
    """OPFUSE_TUNE_INPROCESS=1 times candidates in the compiler's own process: faster to start,
    but a candidate that crashes takes the compiler with it."""
    return os.environ.get("OPFUSE_TUNE_INPROCESS", "") == "1"


def _request(plan: Plan, k: KernelInfo, config: dict[str, Any]) -> TimingRequest:
    shapes = [(plan.values[x].shape, plan.values[x].dtype) for x in k.inputs]
    out_shapes = [(plan.values[o].shape, plan.values[o].dtype) for o in k.outputs]
    return TimingRequest(k.source, config, shapes, out_shapes)


LEFT_OUT = "not compiled within the tuning budget"
BUDGET_SPENT = "tuning budget spent"  # a kernel's record: left at its default config
NO_WORKER = "the tuning worker could not start (see tuning.error): default config, untuned"


class Precompiled:
    """What `precompile` did: the requests that failed (the tuner never times them), and the
    candidate configs still compiling in the background, which the tuner waits for one kernel at a
    time, in the order they were submitted (the order it tunes in). `deadline`: when tuning ends
    (the budget starts once every kernel the plans need is compiled)."""

    def __init__(
        self,
        failed: dict[tuple[str, str], Timing] | None = None,
        job: CompileJob | None = None,
        index: dict[tuple[str, str], int] | None = None,
        deadline: float | None = None,
        refit: dict[str, tuple[dict[str, Any], str]] | None = None,
        start_error: str | None = None,
    ) -> None:
        self.failed = dict(failed or {})
        # Why compile workers could not start: what they would have compiled is left to the
        # tuner's own worker (it compiles what it times).
        self.start_error = start_error
        self.job = job
        self.index = dict(index or {})
        self.deadline = deadline
        # kernel signature -> (the config it runs at instead, why its start config failed)
        self.refit = dict(refit or {})

    def outcome(self, key: tuple[str, str]) -> Timing | None:
        """None: time this candidate (compiled, or left to whoever times it to compile); a Timing:
        do not, it failed to compile or was left out at the deadline (error LEFT_OUT)."""
        if key in self.failed:
            return self.failed[key]
        i = self.index.get(key)
        if i is None or self.job is None:
            return None
        timing = self.job.wait(i)
        if timing is None and self.job.start_error is not None:
            return None  # no compile worker took it: the tuner's worker compiles it as it times it
        if timing is None:
            return Timing(math.inf, LEFT_OUT)
        if not timing.ok:
            self.failed[key] = timing
            return timing
        return None

    def close(self) -> None:
        """Stop taking candidates and wait for those compiling now (their workers stay usable)."""
        if self.job is not None:
            self.job.cancel()
            results = self.job.results()
            for key, i in self.index.items():
                timing = results[i]
                if timing is not None and not timing.ok:
                    self.failed[key] = timing


def precompile(
    plans: list[Plan],
    cache: TuningCache | None,
    compiler: CompilePool,
    budget_s: float | None = None,
    group_ms: dict[str, float] | None = None,
) -> Precompiled:
    """Compile the plans' kernels in parallel before anything times or runs them.

    First every kernel at the config it will run with unless tuned (its cached config, else its
    default), with no deadline, each run once to check it: the plan needs those anyway. Then the
    tuning budget (`budget_s`) starts, and the candidate configs of the kernels to be tuned (not
    in `cache`) compile in the background, without running, kernels of the groups with the most
    profiled time (`group_ms`) first, while the tuner times those already compiled. The caller
    closes the result when tuning is done.
    """
    must: dict[tuple[str, str], TimingRequest] = {}
    may: list[tuple[float, int, tuple[str, str], TimingRequest]] = []
    seen: set[tuple[str, str]] = set()
    for plan in plans:
        for k in plan.kernels.values():
            sig = kernel_signature(k)
            cached = cache.data.get(sig) if cache is not None else None
            start = dict(cached["config"]) if cached is not None else dict(k.config)
            key = (sig, config_key(start))
            if key not in seen:
                seen.add(key)
                must[key] = _request(plan, k, start)
            if cache is None or cached is not None:
                continue
            try:
                cands = search.candidates(k)
            except Exception:  # tuning this kernel raises again in tune_kernel, per group,
                continue  # where the group is set aside as unsafe, with the reason
            for cand in cands:
                config = {**k.config, **cand}
                key = (sig, config_key(config))
                if key not in seen:
                    seen.add(key)
                    weight = (group_ms or {}).get(k.group, 0.0)
                    may.append((-weight, len(may), key, _request(plan, k, config)))
    keys = list(must)
    checked = compiler.submit([must[k] for k in keys])
    failed = {
        key: timing
        for key, timing in zip(keys, checked.results(), strict=True)
        if timing is not None and not timing.ok and not timing.no_worker
    }
    # A start config that does not compile on this device (a float32 conv whose pipeline stages
    # overflow the shared memory) gives way to the first smaller one that does, before the budget
    # starts: tuned or not, the kernel then runs at a config that compiled.
    starts: dict[str, tuple[Plan, KernelInfo]] = {}
    for plan in plans:
        for k in plan.kernels.values():
            sig = kernel_signature(k)
            if (sig, config_key(k.config)) in failed:
                starts.setdefault(sig, (plan, k))
    refit = {
        sig: (config, failed[(sig, config_key(starts[sig][1].config))].error or "")
        for sig, config in first_configs_that_compile(list(starts.values()), compiler).items()
    }
    for plan in plans:
        for k in plan.kernels.values():
            if kernel_signature(k) in refit:
                k.config = dict(refit[kernel_signature(k)][0])
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    may.sort(key=lambda item: item[:2])
    job = compiler.submit([item[3] for item in may], deadline, launch=False)
    index = {item[2]: i for i, item in enumerate(may)}
    return Precompiled(failed, job, index, deadline, refit, checked.start_error)


def first_configs_that_compile(
    kernels: list[tuple[Plan, KernelInfo]], compiler: CompilePool
) -> dict[str, dict[str, Any]]:
    """For kernels whose starting config failed to compile (each with the plan it is in): by
    kernel signature, each one's first `fallback_configs` entry that compiled and ran (all
    compiled at once, in parallel). A kernel none of whose configs compiled is left out."""
    requests: list[TimingRequest] = []
    owners: list[tuple[str, dict[str, Any]]] = []
    for plan, k in kernels:
        for config in fallback_configs(k):
            requests.append(_request(plan, k, config))
            owners.append((kernel_signature(k), config))
    found: dict[str, dict[str, Any]] = {}
    for (sig, config), timing in zip(owners, compiler.run(requests) if requests else [], strict=True):
        if sig not in found and timing is not None and timing.ok:
            found[sig] = config
    return found


def tune_kernel_configs(
    plan: Plan,
    executor: Executor,
    cache: TuningCache,
    deadline: float,
    pool: TuningPool | None = None,
    priority: dict[str, float] | None = None,
    precompiled: Precompiled | None = None,
) -> dict[str, Any]:
    """Pick each kernel's fastest launch config; writes it into plan.kernels[*].config.

    Kernels are tuned in order of `priority` (kernel id -> weight, highest first: the profile's
    time of the nodes a kernel replaces), so a budget that runs out leaves the cheap ones untuned.

    Candidates are timed in `pool` (one is made for this call when None; pass one to share its
    worker between calls), or in this process under OPFUSE_TUNE_INPROCESS=1. A kernel one of whose
    candidates killed the worker keeps its default config and is cached as "crashed", so that it
    is not tried again. `precompiled` (from `precompile`): a candidate is timed once it has
    compiled; one that failed to compile, or was left out at the deadline, is not tried.
    """
    own_pool = None
    if tune_inprocess():
        pool = None  # a caller's pool starts its worker on first use: unused, it costs nothing
    elif pool is None:
        pool = own_pool = TuningPool(str(executor.device))
    try:
        return _tune_each(plan, executor, cache, deadline, pool, priority or {}, precompiled or Precompiled())
    finally:
        if own_pool is not None:
            own_pool.close()


def _tune_each(
    plan: Plan,
    executor: Executor,
    cache: TuningCache,
    deadline: float,
    pool: TuningPool | None,
    priority: dict[str, float],
    precompiled: Precompiled,
) -> dict[str, Any]:
    record: dict[str, Any] = {}
    order = sorted(plan.kernels, key=lambda kid: -priority.get(kid, 0.0))  # stable: plan order on ties
    for kid in order:
        k = plan.kernels[kid]
        default = dict(k.config)
        try:
            record[kid] = _tune_one(plan, executor, cache, deadline, pool, precompiled, kid)
        except Exception as exc:  # a fault of tuning this kernel: it is not fused, the compile goes on
            k.config = default
            executor.configs[kid] = dict(default)
            record[kid] = {"config": default, "error": f"{type(exc).__name__}: {_first_line(exc)}"}
    return record


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _tune_one(
    plan: Plan,
    executor: Executor,
    cache: TuningCache,
    deadline: float,
    pool: TuningPool | None,
    precompiled: Precompiled,
    kid: str,
) -> dict[str, Any]:
    """One kernel's tuning record; its chosen config is written into the plan and the executor.
    Only a config that ran, with its finite time, is cached (TuningCache.put)."""
    k = plan.kernels[kid]
    key = kernel_signature(k)
    cached = cache.get(key)
    if cached is not None:
        k.config = dict(cached["config"])
        executor.configs[kid] = dict(k.config)
        out = {"config": k.config, "ms": cached["ms"], "cached": True}
        if "crashed" in cached:
            out["crashed"] = cached["crashed"]
        return out
    if time.perf_counter() > deadline:
        return {"config": k.config, "skipped": BUDGET_SPENT}
    time_candidate = _candidate_timer(plan, executor, kid, pool)
    default = dict(k.config)
    best, best_ms, default_ms = dict(default), math.inf, math.inf
    crashed: str | None = None
    no_worker: str | None = None
    tried: list[dict[str, Any]] = []
    ran: list[tuple[dict[str, Any], float, tuple[float, ...] | None]] = []
    seen: set[str] = set()
    left_out = 0
    for cand in search.candidates(k):
        config = {**default, **cand}
        if config_key(config) in seen:  # a candidate equal to the default: timed (and votes) once
            continue
        seen.add(config_key(config))
        timing = precompiled.outcome((key, config_key(config))) or time_candidate(config)
        if timing.no_worker:  # says nothing about the kernel: no worker could try it
            no_worker = timing.error or "no worker"
            break
        if timing.error == LEFT_OUT:
            left_out += 1
            continue
        if not timing.ok:
            tried.append({"config": cand, "error": timing.error})
            if timing.killed:  # a bug the default config may share: no more of this kernel
                crashed = timing.error
                break
            continue
        tried.append({"config": cand, "ms": round(timing.ms, 5)})
        ran.append((config, timing.ms, timing.fingerprint))
    outvoted: list[dict[str, Any]] = []
    if crashed is None:
        ran, outvoted, crashed = agreeing_configs(ran, _fingerprint_rtol(plan, k))
    for config, ms, _ in ran:
        if config == default:
            default_ms = min(default_ms, ms)
        if ms < best_ms:
            best, best_ms = config, ms
    if no_worker is not None or (pool is not None and pool.start_error is not None):
        k.config = default  # untuned, as with tuning off: verification checks it as usual
        return {"config": default, "skipped": NO_WORKER}
    if left_out and not ran and crashed is None:  # the deadline came before its candidates
        k.config = default
        return {"config": default, "skipped": BUDGET_SPENT}
    entry: dict[str, Any] = {"config": best, "ms": best_ms}
    if left_out:  # chosen among those compiled in time; cached so, a warm compile keeps it
        entry["left_out"] = left_out
    if outvoted:  # computed something else than the other configs: never chosen
        entry["outvoted"] = outvoted
    if crashed is not None:
        entry = {"config": default, "ms": default_ms, "crashed": crashed}
    k.config = dict(entry["config"])
    executor.configs[kid] = dict(k.config)
    cache.put(key, entry)  # a failure (no config ran, or the default crashed) is not kept
    out = {**entry, "ms": round(entry["ms"], 5), "candidates": len(tried)}
    if not math.isfinite(entry["ms"]) and crashed is None:
        errors = [t["error"] for t in tried if "error" in t]
        out["failed"] = f"no launch config ran ({len(errors)} tried; first: {errors[0] if errors else '?'})"
    return out


def _fingerprint_rtol(plan: Plan, k: KernelInfo) -> float:
    """How far two configs' outputs may differ (rounding, summation order) relative to their norm."""
    narrow = any(plan.values[o].dtype in ("float16", "bfloat16") for o in k.outputs)
    return 2e-2 if narrow else 1e-3


def agreeing_configs(
    ran: list[tuple[dict[str, Any], float, tuple[float, ...] | None]], rtol: float
) -> tuple[list[tuple[dict[str, Any], float, tuple[float, ...] | None]], list[dict[str, Any]], str | None]:
    """The configs to choose from, given what each computed on the same inputs.

    Configs of one kernel compute one function; where they disagree, a compiler bug hit some of
    them (seen on the H200: a depthwise kernel wrong at one tile size, right at others). A strict
    majority that agrees wins and the rest are outvoted; without one, no config is trusted and the
    kernel counts as crashed (its group is not fused). Returns (kept, outvoted configs, crash reason).
    """
    from opfuse.tuning.pool import fingerprints_agree

    printed = [r for r in ran if r[2] is not None]
    clusters: list[list[tuple[dict[str, Any], float, tuple[float, ...] | None]]] = []
    for r in printed:
        for c in clusters:
            if fingerprints_agree(c[0][2] or (), r[2] or (), rtol):
                c.append(r)
                break
        else:
            clusters.append([r])
    if len(clusters) <= 1:
        return ran, [], None
    clusters.sort(key=len, reverse=True)
    if 2 * len(clusters[0]) > len(printed):
        keep = {id(r) for r in clusters[0]}
        return (
            [r for r in ran if r[2] is None or id(r) in keep],
            [r[0] for r in printed if id(r) not in keep],
            None,
        )
    return (
        [],
        [],
        (
            f"its {len(printed)} launch configs computed {len(clusters)} different results on the same "
            "inputs and no majority agrees: a compiler bug at some config; not fused"
        ),
    )


def _candidate_timer(
    plan: Plan, executor: Executor, kid: str, pool: TuningPool | None
) -> Callable[[dict[str, Any]], Timing]:
    """config -> Timing for one kernel: in the worker, or in this process when `pool` is None."""
    k = plan.kernels[kid]
    if pool is not None:
        return lambda config: pool.time(_request(plan, k, config))
    module = executor.modules[kid]
    ins = [_random_tensor(plan, x, executor.device) for x in k.inputs]
    outs = [
        torch.empty(plan.values[o].shape, dtype=torch_dtype(plan.values[o].dtype), device=executor.device)
        for o in k.outputs
    ]

    def in_process(config: dict[str, Any]) -> Timing:
        try:
            return Timing(time_launch(lambda: module.launch(*ins, *outs, config=config)))
        except Exception as exc:  # out of resources, compile errors: this candidate loses
            return Timing(math.inf, type(exc).__name__)

    return in_process


def unsafe_groups(plan: Plan, tuned: dict[str, Any]) -> set[str]:
    """Groups with a kernel that no config ran cleanly in the tuning worker (its default crashed it,
    or every candidate failed to compile or run), or whose tuning raised: not to run in-process."""
    return set(unsafe_reasons(plan, tuned))


def unsafe_reasons(plan: Plan, tuned: dict[str, Any]) -> dict[str, str]:
    """unsafe_groups, each with why (the first of its kernels that made it so)."""
    out: dict[str, str] = {}
    for kid, k in plan.kernels.items():
        rec = tuned.get(kid, {})
        if k.group in out:
            continue
        if "error" in rec:
            out[k.group] = f"tuning its kernel raised {rec['error']}"
        elif ("crashed" in rec or "ms" in rec) and not math.isfinite(rec.get("ms", math.inf)):
            why = rec.get("crashed") or rec.get("failed") or "no launch config ran"
            out[k.group] = f"its generated kernel failed in the tuning worker: {why}"
    return out


# The first pass over each candidate plan: rounds, and launches a round of each group's steps
# (GroupTimer: on a GPU one CUDA graph per group and round, captured, replayed and let go).
FIRST_GPU = (3, 5)
FIRST_CPU = (3, 1)


def variant_group_times(
    plan: Plan, executor: Executor, feeds: dict[str, Any], tuned: dict[str, Any]
) -> dict[str, float]:
    """Per-group ms of one candidate plan, for the template-vs-vendor choice.

    The plan runs here: vendor ops are torch ops, and its generated kernels run with configs that
    ran cleanly in the tuning worker. Each group's steps are timed together (GroupTimer), as the
    plan's own CUDA graph runs them: a library op and its epilogue kernel back to back. Timed one
    step at a time, each step's figure carries its own launch gaps, and the library form (two
    steps) came out slower than it runs. A plan holding a kernel that crashed there is not run:
    its kernel groups take the worker's times, crashed groups and groups with torch op steps
    score infinity (so the choice falls to the template, the default).
    """
    bad = unsafe_groups(plan, tuned)
    per_group: dict[str, float] = {}
    if not bad:
        groups = list(dict.fromkeys(s.group for s in plan.steps if s.group))
        if not groups:
            return per_group
        rounds, reps = FIRST_GPU if executor.device.type == "cuda" else FIRST_CPU
        samples = _time_rounds({"plan": GroupTimer(executor, feeds, groups, reps)}, groups, rounds)["plan"]
        return {gid: ts[len(ts) // 2] for gid, ts in samples.items()}
    for step in plan.steps:
        if not step.group:
            continue
        ms = math.inf  # torch op steps are not timed without running the plan
        if step.kind == "kernel" and step.group not in bad:
            ms = float(tuned.get(step.kernel, {}).get("ms", math.inf))
        per_group[step.group] = per_group.get(step.group, 0.0) + ms
    return per_group


# A group whose two forms' first times (one pass over each plan, a few launches a step) are within
# this ratio is timed again: the forms alternate, many rounds, and the medians decide.
CLOSE_RATIO = 1.5


def retime_close(
    executors: dict[str, Executor],
    feeds: dict[str, Any],
    first: dict[str, dict[str, float]],
    rounds: int,
    reps: int,
) -> dict[str, dict[str, list[float]]]:
    """The groups of `first` (form -> group -> ms, each plan timed once, whole) whose forms came out
    within CLOSE_RATIO, timed again on each form's plan's executor (`executors`, by form): form ->
    group -> `rounds` times, sorted.

    A first pass times one plan, then the other, a few launches a step: on a GPU whose clocks
    move, or that another process's tuning worker shares, a group a few percent apart is decided by
    when each form happened to be timed. Here both forms of one group are timed in one locked
    section (OPFUSE_TIMING_LOCK), `reps` launches each from a CUDA graph, the order swapped each
    round, so a disturbance falls on both. Groups the first pass found far apart are not timed
    again."""
    names = list(executors)
    close = [
        gid
        for gid in first[names[0]]
        if all(math.isfinite(first[n].get(gid, math.inf)) for n in names)
        and max(first[n][gid] for n in names) <= CLOSE_RATIO * min(first[n][gid] for n in names)
    ]
    if not close:
        return {}
    timers = {n: GroupTimer(executor, feeds, close, reps) for n, executor in executors.items()}
    return _time_rounds(timers, close, rounds)


def _time_rounds(
    timers: dict[str, GroupTimer], gids: list[str], rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Each group of `gids` timed `rounds` times on every timer: timer -> group -> times, sorted.
    A group's timings of one round share a timing section (OPFUSE_TIMING_LOCK), the timers'
    order swapped each round, so that a disturbance falls on all of them."""
    names = list(timers)
    samples: dict[str, dict[str, list[float]]] = {n: {gid: [] for gid in gids} for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for gid in gids:
            with timing_section():
                for n in order:
                    samples[n][gid].append(timers[n].time(gid))
    return {n: {gid: sorted(ts) for gid, ts in per.items()} for n, per in samples.items()}
