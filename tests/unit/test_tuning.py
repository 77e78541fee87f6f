"""The tuning worker on the CPU: candidates timed in Triton's interpreter in a child process, and
candidates that exit, segfault or hang score infinity without harming this process."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from opfuse.tuning.pool import CompilePool, Timing, TimingRequest, TuningPool, compile_workers

# A kernel module as codegen writes one; `fault` in the config makes its launch misbehave.
SOURCE = """
import os
import signal
import time

import triton
import triton.language as tl

CONFIG = {"BLOCK": 64}
INTERPRETER_CONFIG = {"BLOCK": 1024}


@triton.jit
def add_one(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=mask) + 1.0, mask=mask)


def launch(x, out, config=None):
    c = CONFIG if config is None else config
    fault = c.get("fault")
    if fault == "exit":
        os._exit(1)
    if fault == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "hang":
        time.sleep(600)
    if fault == "raise":
        raise ValueError("no such config")
    if fault == "wait":  # holds the worker until the test says go: a file appears
        while not os.path.exists(c["go"]):
            time.sleep(0.01)
    add_one[(triton.cdiv(out.numel(), c["BLOCK"]),)](x, out, out.numel(), BLOCK=c["BLOCK"])
    if fault == "wrong":  # as if compiled wrong at this config: a tile of the output is off
        out[:64] *= 3.0
"""
SHAPES = [((256,), "float32")]
# The same kernel calling a @triton.jit helper (compile-only launches must leave helpers alone).
HELPER_SOURCE = SOURCE.replace(
    "tl.load(x + offs, mask=mask) + 1.0", "plus_one(tl.load(x + offs, mask=mask))"
).replace(
    "@triton.jit\ndef add_one",
    "@triton.jit\ndef plus_one(v):\n    return v + 1.0\n\n\n@triton.jit\ndef add_one",
)


def request(**config: Any) -> TimingRequest:
    return TimingRequest(SOURCE, {"BLOCK": 64, **config}, SHAPES, SHAPES, reps=3)


@pytest.fixture(scope="module")
def pool() -> Iterator[TuningPool]:
    with TuningPool("cpu", timeout_s=30) as p:
        p.start(wait=False)  # its imports overlap this process importing torch for opfuse.tuning
        yield p


def assert_gone(pid: int | None) -> None:
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def one_kernel_plan() -> Any:
    from opfuse.graph import TensorSpec
    from opfuse.runtime.plan import KernelInfo, Plan, Step

    x, y = TensorSpec("x", "float32", (256,)), TensorSpec("y", "float32", (256,))
    kernel = KernelInfo("k0_add", "pointwise", "g0", ["x"], ["y"], {"BLOCK": 64}, SOURCE)
    step = Step("kernel", ["x"], ["y"], kernel="k0_add", group="g0")
    return Plan("fp32", [x], [y], {"x": x, "y": y}, [step], {"k0_add": kernel})


@pytest.fixture
def tuning(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """opfuse.tuning.configs with its cache in tmp_path and candidates that the test sets."""
    from opfuse.tuning import configs as tune

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OPFUSE_TUNE_INPROCESS", raising=False)
    return tune


def cpu_executor() -> Any:
    import torch

    return SimpleNamespace(device=torch.device("cpu"), configs={}, modules={})


class ScriptedPool:
    """Stands in for TuningPool: a config with "fault" kills the worker, BLOCK 128 is fastest."""

    start_error = None

    def __init__(self) -> None:
        self.requests: list[TimingRequest] = []

    def time(self, req: TimingRequest, timeout_s: float | None = None) -> Timing:
        self.requests.append(req)
        if "fault" in req.config:
            return Timing(math.inf, "the tuning worker died (exited with status 1)", killed=True)
        return Timing(0.5 if req.config["BLOCK"] == 128 else 1.0)


def test_tune_kernel_configs_times_in_the_worker(
    pool: TuningPool, tuning: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(tuning.CANDIDATES, "pointwise", [{}, {"fault": "raise"}, {"BLOCK": 128}])
    plan, executor = one_kernel_plan(), cpu_executor()
    cache = tuning.TuningCache()
    record = tuning.tune_kernel_configs(plan, executor, cache, time.perf_counter() + 60, pool)["k0_add"]
    assert record["candidates"] == 3 and math.isfinite(record["ms"]) and "crashed" not in record
    assert record["config"] in ({"BLOCK": 64}, {"BLOCK": 128})
    assert executor.configs["k0_add"] == plan.kernels["k0_add"].config == record["config"]
    assert cache.get(tuning.kernel_signature(plan.kernels["k0_add"]))["config"] == record["config"]


def test_crashed_kernel_keeps_its_default_and_is_not_retried(
    tuning: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The crash comes third: the default ran, the one after the crash is never tried.
    candidates = [{}, {"BLOCK": 128}, {"fault": "exit"}, {"BLOCK": 32}]
    monkeypatch.setitem(tuning.CANDIDATES, "pointwise", candidates)
    plan, executor, pool = one_kernel_plan(), cpu_executor(), ScriptedPool()
    cache = tuning.TuningCache()
    record = tuning.tune_kernel_configs(plan, executor, cache, time.perf_counter() + 60, pool)["k0_add"]
    assert "exited with status 1" in record["crashed"]
    assert record["config"] == {"BLOCK": 64} == plan.kernels["k0_add"].config == executor.configs["k0_add"]
    assert record["candidates"] == 3 and record["ms"] == 1.0 and len(pool.requests) == 3
    assert pool.requests[0].inputs == [((256,), "float32")] and pool.requests[0].outputs == [
        ((256,), "float32")
    ]
    cache.save()

    plan = one_kernel_plan()
    again = tuning.tune_kernel_configs(plan, executor, tuning.TuningCache(), time.perf_counter() + 60, pool)
    assert again["k0_add"]["cached"] and "exited" in again["k0_add"]["crashed"]
    assert len(pool.requests) == 3  # nothing timed again

    # The default ran cleanly, so the plan may run in-process; with a crashed default it may not.
    assert tuning.unsafe_groups(plan, {"k0_add": record}) == set()
    crashed_default = {"k0_add": {"crashed": "died", "ms": math.inf}}
    assert tuning.unsafe_groups(plan, crashed_default) == {"g0"}
    assert tuning.variant_group_times(plan, executor, {}, crashed_default) == {"g0": math.inf}
    # Every candidate failed to compile or run (no crash): not safe in-process either.
    assert tuning.unsafe_groups(plan, {"k0_add": {"config": {}, "ms": math.inf, "candidates": 5}}) == {"g0"}
    # Not reached within the budget: it keeps its default config and may run.
    assert tuning.unsafe_groups(plan, {"k0_add": {"config": {}, "skipped": "tuning budget spent"}}) == set()


@pytest.mark.skipif(
    not os.environ.get("TRITON_INTERPRET"), reason="times an interpreted kernel in this process"
)
def test_inprocess_switch_times_here(tuning: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.pool import wall_clock_ms

    monkeypatch.setenv("OPFUSE_TUNE_INPROCESS", "1")
    monkeypatch.setattr(tuning, "time_launch", wall_clock_ms)  # no CUDA here
    monkeypatch.setitem(tuning.CANDIDATES, "pointwise", [{}, {"BLOCK": 128}])
    plan, executor, pool = one_kernel_plan(), cpu_executor(), ScriptedPool()
    executor.modules["k0_add"] = load_kernel_module(SOURCE, interpret=True)
    record = tuning.tune_kernel_configs(plan, executor, tuning.TuningCache(), time.perf_counter() + 60, pool)
    assert math.isfinite(record["k0_add"]["ms"]) and record["k0_add"]["candidates"] == 2
    assert pool.requests == []


def test_normal_candidate_is_timed(pool: TuningPool) -> None:
    timing = pool.time(request())
    assert timing.ok and timing.ms > 0 and timing.error is None
    first = pool.pid
    assert pool.time(request(BLOCK=128)).ok
    assert pool.pid == first  # one worker serves the session


def test_candidate_error_loses_without_a_restart(pool: TuningPool) -> None:
    pool.start()
    pid = pool.pid
    timing = pool.time(request(fault="raise"))
    assert not timing.ok and not timing.killed
    assert "ValueError: no such config" in (timing.error or "")
    assert pool.pid == pid


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("exit", "exited with status 1"),
        ("segv", "killed by SIGSEGV): Fatal Python error: Segmentation fault | File "),
    ],
    ids=["exit", "segv"],
)
def test_crash_scores_inf_and_a_fresh_worker_times_the_next(pool: TuningPool, fault: str, why: str) -> None:
    pool.start()
    pid, spawns = pool.pid, pool.spawns
    timing = pool.time(request(fault=fault))
    assert timing.ms == math.inf and timing.killed
    assert why in (timing.error or "")
    if fault == "segv":
        assert (timing.error or "").endswith("in launch")
    assert_gone(pid)
    nxt = pool.time(request())
    assert nxt.ok
    assert pool.spawns == spawns + 1 and pool.pid != pid


def test_hang_is_killed_at_the_timeout(pool: TuningPool) -> None:
    pool.start()  # the worker's start-up is not the candidate's time
    pid = pool.pid
    t = time.perf_counter()
    timing = pool.time(request(fault="hang"), timeout_s=1.0)
    elapsed = time.perf_counter() - t
    assert timing.ms == math.inf and timing.killed and "timed out" in (timing.error or "")
    assert elapsed < 1.0 + 1.5
    assert_gone(pid)
    assert pool.pid is None  # the next request starts a fresh worker


def test_worker_that_cannot_start_scores_inf_and_caches_nothing(tuning: Any) -> None:
    with TuningPool("cpu", timer="opfuse.no_such_module:timer", start_timeout_s=30) as broken:
        timing = broken.time(request())
        assert timing.ms == math.inf and "could not start" in (timing.error or "")
        assert "No module named 'opfuse.no_such_module'" in (timing.error or "")
        assert broken.time(request()).error == timing.error and broken.spawns == 1  # no retries

        plan, cache = one_kernel_plan(), tuning.TuningCache()
        record = tuning.tune_kernel_configs(plan, cpu_executor(), cache, time.perf_counter() + 60, broken)
        assert "could not start" in record["k0_add"]["skipped"] and cache.data == {}


def test_variant_choices_are_cached_and_a_warm_compile_skips_the_vendor_plan(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The template-vs-vendor step of the compiler, run for real on the CPU (interpreter, wall
    clock): the first pass measures both plans and caches each anchor's choice; the second takes
    every choice from the cache and never builds the all-vendor plan."""
    import numpy as np
    from onnx import helper

    from opfuse.frontend.load import load_and_specialize
    from opfuse.fusion.planner import plan_fusion
    from opfuse.graph import graph_from_onnx
    from opfuse.lowering import build_plan
    from opfuse.passes.pipeline import run_passes
    from opfuse.pipeline import builder as builder_module
    from opfuse.runtime.ops import SUPPORTED_OPS
    from opfuse.verify.reference import random_inputs
    from tests.unit.test_fusion import make_model

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    model = make_model(nodes, {"x": [8, 16]}, {"y": [8, 16]}, {"w": rng.standard_normal((16, 16))})
    _, spec = load_and_specialize(model, {"x": [8, 16]}, SUPPORTED_OPS)
    graph = graph_from_onnx(spec)
    run_passes(graph)
    fusion = plan_fusion(graph)
    (anchor,) = [g.id for g in fusion.groups if g.kind == "gemm"]
    built: list[dict[str, str]] = []  # the variants of every plan the tuning stage builds

    def recording(*args: Any, **kwargs: Any) -> Any:
        built.append(dict(kwargs.get("variants") or {}))
        return build_plan(*args, **kwargs)

    def run_once() -> dict[str, Any]:
        plan = build_plan(graph, fusion, "fp32", graph.inputs, graph.outputs)
        feeds = random_inputs(graph.inputs, rng)
        with monkeypatch.context() as m:
            m.setattr(builder_module, "build_plan", recording)
            result, _ = tune_fusion(graph, fusion, feeds, plan)
        assert result.variants[anchor] in ("template", "vendor")
        return result.record

    first = run_once()
    assert "cached" not in first["variants"][anchor]
    n = len(first["kernels"])
    assert first["summary"] == {
        "budget_s": 60.0,
        "kernels": n,
        "timed": n,
        "cached": 0,
        "budget_spent": 0,
        "candidates_left_out": 0,
    }
    assert {"vendor"} in [set(v.values()) for v in built]  # the all-vendor plan was built and timed
    built.clear()
    second = run_once()
    assert first["warm"] is False and second["warm"] is True  # every config from the cache
    assert "compile_s" not in second  # a warm compile starts no compile workers (on the GPU)
    assert second["variants"][anchor]["cached"] is True
    assert second["summary"]["cached"] == len(second["kernels"]) and second["summary"]["timed"] == 0
    assert second["variants"][anchor]["choice"] == first["variants"][anchor]["choice"]
    if first["variants"][anchor]["choice"] == "template":
        assert built == []  # nothing but the template plan it was given


def test_kernels_are_tuned_where_the_time_is_first(tuning: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the budget spent after one kernel, the one with the most profiled time got it."""
    from opfuse.graph import TensorSpec
    from opfuse.runtime.plan import KernelInfo, Plan, Step

    monkeypatch.setitem(tuning.CANDIDATES, "pointwise", [{}, {"BLOCK": 128}])
    x, y, z = (TensorSpec(n, "float32", (256,)) for n in "xyz")
    k0 = KernelInfo("k0_add", "pointwise", "g0", ["x"], ["y"], {"BLOCK": 64}, SOURCE)
    k1 = KernelInfo("k1_add", "pointwise", "g1", ["y"], ["z"], {"BLOCK": 64}, SOURCE + "\nSECOND = 1\n")
    steps = [
        Step("kernel", ["x"], ["y"], kernel="k0_add", group="g0"),
        Step("kernel", ["y"], ["z"], kernel="k1_add", group="g1"),
    ]
    plan = Plan("fp32", [x], [z], {"x": x, "y": y, "z": z}, steps, {"k0_add": k0, "k1_add": k1})

    class SlowPool(ScriptedPool):
        def time(self, req: TimingRequest, timeout_s: float | None = None) -> Timing:
            time.sleep(0.6)
            return super().time(req, timeout_s)

    # Spent while the first kernel's candidates are timed, with room for a loaded machine (the
    # GPU suite runs 14 workers) to get to the first one: at 0.05 s one run tuned nothing.
    deadline = time.perf_counter() + 0.3
    record = tuning.tune_kernel_configs(
        plan, cpu_executor(), tuning.TuningCache(), deadline, SlowPool(), {"k0_add": 0.1, "k1_add": 2.0}
    )
    assert record["k1_add"]["candidates"] == 2  # the expensive one, although it comes second
    assert record["k0_add"]["skipped"] == "tuning budget spent"
    from opfuse.report import tuning_summary

    summary = tuning_summary(record, 0.05)
    assert (summary["timed"], summary["budget_spent"], summary["cached"]) == (1, 1, 0)


def test_compile_pool_runs_each_request_once_and_reports_failures() -> None:
    """Kernels compiled ahead of timing, in parallel workers: each request runs once, untimed; one
    that raises or kills its worker comes back as a failure and the other workers carry on."""
    requests = [
        request(),
        request(fault="raise"),
        request(BLOCK=128),
        request(fault="exit"),
        request(BLOCK=32),
    ]
    with CompilePool("cpu", workers=2) as compiler:
        results = compiler.run(requests)
        assert len(compiler._pools) == 2
    assert all(r is not None for r in results)
    assert [r.ok for r in results if r is not None] == [True, False, True, False, True]
    assert results[0] is not None and results[0].ms == 0.0  # compiled and run, not timed
    assert results[1] is not None and not results[1].killed and "ValueError" in (results[1].error or "")
    assert results[3] is not None and results[3].killed and "exited with status 1" in (results[3].error or "")


def test_compile_pool_leaves_out_what_the_deadline_does_not_reach() -> None:
    with CompilePool("cpu", workers=1) as compiler:
        assert compiler.run([request(), request(BLOCK=128)], deadline=time.perf_counter() - 1.0) == [
            None,
            None,
        ]


def test_compile_workers_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPFUSE_COMPILE_WORKERS", "3")
    assert compile_workers() == 3
    monkeypatch.delenv("OPFUSE_COMPILE_WORKERS")
    assert 1 <= compile_workers() <= 16


def test_precompiled_failures_are_not_timed_again(tuning: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """precompile compiles the kernel at its start config, then the candidates of kernels to be
    tuned; the tuner takes a candidate that failed there as lost without sending it to the worker."""
    monkeypatch.setitem(tuning.CANDIDATES, "pointwise", [{}, {"fault": "raise"}, {"BLOCK": 128}])
    plan = one_kernel_plan()
    sig = tuning.kernel_signature(plan.kernels["k0_add"])
    with CompilePool("cpu", workers=2) as compiler:
        alone = tuning.precompile([plan], None, compiler)  # no cache: the start config alone
        assert alone.failed == {} and alone.index == {}
        pre = tuning.precompile([plan], tuning.TuningCache(), compiler, budget_s=60)
        pool = ScriptedPool()
        cache = tuning.TuningCache()
        record = tuning.tune_kernel_configs(
            plan, cpu_executor(), cache, time.perf_counter() + 60, pool, precompiled=pre
        )
        pre.close()
    assert list(pre.failed) == [(sig, tuning.config_key({"BLOCK": 64, "fault": "raise"}))]
    assert "ValueError: no such config" in (pre.failed[next(iter(pre.failed))].error or "")
    assert [r.config for r in pool.requests] == [{"BLOCK": 64}, {"BLOCK": 128}]
    assert record["k0_add"]["candidates"] == 3 and record["k0_add"]["config"] == {"BLOCK": 128}


def test_candidates_left_out_at_the_deadline_are_not_timed(
    tuning: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Candidates compile in the background once the budget starts; those no worker reached by the
    deadline are not timed (the timing worker would compile them one by one). A kernel none of
    whose candidates compiled keeps its default config, uncached; one with some compiled is tuned
    among those, and the record says how many were left out."""
    monkeypatch.setitem(tuning.CANDIDATES, "pointwise", [{"BLOCK": 128}, {"BLOCK": 32}])
    plan = one_kernel_plan()
    with CompilePool("cpu", workers=1) as compiler:
        pre = tuning.precompile([plan], tuning.TuningCache(), compiler, budget_s=-1.0)  # spent already
        pool = ScriptedPool()
        cache = tuning.TuningCache()
        record = tuning.tune_kernel_configs(
            plan, cpu_executor(), cache, time.perf_counter() + 60, pool, precompiled=pre
        )
        pre.close()
    assert pool.requests == []
    assert record["k0_add"] == {"config": {"BLOCK": 64}, "skipped": "tuning budget spent"}
    assert cache.get(tuning.kernel_signature(plan.kernels["k0_add"])) is None

    # One of the two compiled in time: chosen among the one, and said so.
    sig = tuning.kernel_signature(plan.kernels["k0_add"])
    index = {(sig, tuning.config_key({"BLOCK": 128})): 0, (sig, tuning.config_key({"BLOCK": 32})): 1}
    half = tuning.Precompiled({}, cast(Any, FinishedJob([Timing(0.0), None])), index)
    pool = ScriptedPool()
    record = tuning.tune_kernel_configs(
        plan, cpu_executor(), tuning.TuningCache(), time.perf_counter() + 60, pool, precompiled=half
    )
    assert [r.config for r in pool.requests] == [{"BLOCK": 128}]
    assert record["k0_add"]["config"] == {"BLOCK": 128} and record["k0_add"]["left_out"] == 1


class FinishedJob:
    """A compile job whose workers have stopped, with these outcomes (None: never compiled)."""

    start_error = None  # every worker started

    def __init__(self, results: list[Timing | None]) -> None:
        self._results = results

    def wait(self, i: int) -> Timing | None:
        return self._results[i]

    def cancel(self) -> None:
        pass


def test_a_compile_job_is_waited_for_one_request_at_a_time(tmp_path: Any) -> None:
    """submit returns at once; wait(i) blocks until request i is compiled; a cancelled job takes no
    more requests, and what it left out waits for nothing."""
    go = tmp_path / "go"
    with CompilePool("cpu", workers=1) as compiler:
        job = compiler.submit([request(), request(fault="raise"), request(BLOCK=128)], launch=False)
        first = job.wait(0)
        assert first is not None and first.ok and first.ms == 0.0
        second = job.wait(1)  # a config whose launch raises fails without running anything
        assert second is not None and "ValueError" in (second.error or "")
        assert [r is not None and r.ok for r in job.results()] == [True, False, True]

        # The first request holds the worker until `go` exists, so the cancel always comes while
        # the worker is still on it (or before it took any): it takes no more after.
        job = compiler.submit(
            [request(fault="wait", go=str(go)), request(BLOCK=128), request(BLOCK=32)], launch=False
        )
        job.cancel()
        go.touch()
        results = job.results()
        assert results[0] is None or results[0].ok
        assert results[1:] == [None, None]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's case; tests/gpu has the GPU's"
)
def test_compile_only_runs_nothing_under_the_interpreter() -> None:
    """A compile-only launch leaves its outputs untouched (on the GPU it compiles, tests/gpu)."""
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.pool import _compile_only

    module = load_kernel_module(HELPER_SOURCE, True)
    assert "def plus_one" in HELPER_SOURCE and "plus_one(tl.load" in HELPER_SOURCE
    x, out = torch.randn(256), torch.full((256,), 7.0)
    with _compile_only(module, True):
        module.launch(x, out, config={"BLOCK": 64})
    assert torch.equal(out, torch.full((256,), 7.0))
    module.launch(x, out, config={"BLOCK": 64})  # restored: runs again
    assert torch.equal(out, x + 1.0)


def test_compile_pool_started_early_runs_on_the_workers_it_started() -> None:
    """compile() starts the compile workers before loading the model; run() then uses them."""
    with CompilePool("cpu", workers=2) as compiler:
        compiler.start()
        started = [p._proc.pid for p in compiler._pools if p._proc is not None]
        assert len(started) == 2
        results = compiler.run([request(), request(BLOCK=128), request(BLOCK=32)])
        assert all(r is not None and r.ok for r in results)
        assert [p.pid for p in compiler._pools] == started
    assert compiler._pools == []


@pytest.mark.parametrize("faster", ["template", "library"])
def test_lone_anchor_runs_its_template_only_when_measured_faster(
    faster: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GEMM with nothing to fuse is not a group unless tuning measures its template clearly
    faster than the library kernel; then it is one, and the plan runs the template."""
    import numpy as np
    from onnx import helper

    from opfuse.frontend.load import load_and_specialize
    from opfuse.fusion.planner import plan_fusion
    from opfuse.graph import graph_from_onnx
    from opfuse.passes.pipeline import run_passes
    from opfuse.runtime.ops import SUPPORTED_OPS
    from opfuse.tuning import configs as tune
    from opfuse.verify.reference import random_inputs
    from tests.unit.test_fusion import make_model

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    model = make_model(nodes, {"x": [8, 16]}, {"y": [8, 12]}, {"w": rng.standard_normal((16, 12))})
    _, spec = load_and_specialize(model, {"x": [8, 16]}, SUPPORTED_OPS)
    graph = graph_from_onnx(spec)
    run_passes(graph)
    fusion = plan_fusion(graph)
    assert fusion.groups == [] and [g.kind for g in fusion.lone] == ["gemm"]
    (gid,) = [g.id for g in fusion.lone]

    def timed(plan: Any, executor: Any, feeds: Any, tuned: Any) -> dict[str, float]:
        template = any(k.group == gid for k in plan.kernels.values())
        fast = (faster == "template") == template
        return {gid: 1.0 if fast else 2.0}

    monkeypatch.setattr(tune, "variant_group_times", timed)
    feeds = random_inputs(graph.inputs, rng)
    result, tuned = tune_fusion(graph, fusion, feeds)
    record = result.record
    assert record["variants"][gid]["choice"] == ("template" if faster == "template" else "vendor")
    after = tuned.plan()
    if faster == "template":
        assert record["lone_anchors"] == {"template": [gid], "library": []}
        assert [g.id for g in result.groups] == [gid] and result.variants == {gid: "template"}
        assert [k.kind for k in after.kernels.values()] == ["gemm"]
    else:
        assert record["lone_anchors"] == {"template": [], "library": [gid]}
        assert result.groups == [] and result.variants == {} and after.kernels == {}
    assert fusion.groups == [] and [g.id for g in fusion.lone] == [gid]  # the planner's plan, untouched


def test_fingerprints_tell_a_wrong_tile_from_rounding() -> None:
    import torch

    from opfuse.tuning.pool import fingerprint, fingerprints_agree

    torch.manual_seed(3)
    y = torch.randn(64, 72)
    rounded = y.half().float()  # what another tile order or precision may change
    wrong = y.clone()
    wrong[:, 64:] = 0.0  # one channel block not written right
    assert fingerprints_agree(fingerprint([y]), fingerprint([y]), 1e-3)
    assert fingerprints_agree(fingerprint([y]), fingerprint([rounded]), 2e-2)
    assert not fingerprints_agree(fingerprint([y]), fingerprint([wrong]), 2e-2)
    assert not fingerprints_agree(fingerprint([y]), fingerprint([y, y]), 1e-3)


def test_a_config_that_computes_something_else_is_outvoted_or_the_kernel_is_not_fused(
    tuning: Any,
) -> None:
    a, b, c = (1.0, 0.0, 0.0), (1.0, 0.5, 0.5), (2.0, 1.0, 1.0)
    ran = [({"BLOCK": 64}, 3.0, a), ({"BLOCK": 128}, 1.0, b), ({"BLOCK": 32}, 2.0, a)]
    kept, outvoted, crashed = tuning.agreeing_configs(ran, 1e-3)
    assert [r[0] for r in kept] == [{"BLOCK": 64}, {"BLOCK": 32}] and outvoted == [{"BLOCK": 128}]
    assert crashed is None
    kept, outvoted, crashed = tuning.agreeing_configs(ran[:2], 1e-3)
    assert kept == [] and "no majority" in (crashed or "")
    three = [*ran[:2], ({"BLOCK": 16}, 1.0, c)]
    assert tuning.agreeing_configs(three, 1e-3)[2] is not None
    assert tuning.agreeing_configs([ran[0], ran[2]], 1e-3) == ([ran[0], ran[2]], [], None)


def test_tuning_never_picks_a_config_whose_output_differs(
    pool: TuningPool, tuning: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker fingerprints every candidate's output on the same inputs: the fastest config is
    chosen among those that agree, and the one that computed something else is outvoted."""
    monkeypatch.setitem(
        tuning.CANDIDATES, "pointwise", [{}, {"BLOCK": 128}, {"BLOCK": 256, "fault": "wrong"}, {"BLOCK": 32}]
    )
    plan, executor = one_kernel_plan(), cpu_executor()
    cache = tuning.TuningCache()
    record = tuning.tune_kernel_configs(plan, executor, cache, time.perf_counter() + 60, pool)["k0_add"]
    assert record["outvoted"] == [{"BLOCK": 256, "fault": "wrong"}]
    assert "fault" not in record["config"] and math.isfinite(record["ms"]) and "crashed" not in record


def test_tuning_caches_of_two_processes_merge_on_save(tuning: Any) -> None:
    """Two compiles on one host (GPU workers, benchmark shards) read the file, tune different
    kernels and save: neither loses the other's entries."""
    first, second = tuning.TuningCache(), tuning.TuningCache()
    first.put("kernel-a", {"config": {"BLOCK": 64}, "ms": 1.0})
    second.put("kernel-b", {"config": {"BLOCK": 128}, "ms": 2.0})
    first.save()
    second.save()
    assert set(tuning.TuningCache().data) == {"kernel-a", "kernel-b"}


def test_fingerprint_in_chunks_sees_every_element(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from opfuse.tuning import pool as tuning_pool
    from opfuse.tuning.pool import fingerprint, fingerprints_agree

    monkeypatch.setattr(tuning_pool, "FINGERPRINT_CHUNK", 100)
    y = torch.randn(1000)
    late = y.clone()
    late[-10:] += 5.0  # the last chunk only
    assert fingerprint([y]) == fingerprint([y.clone()])
    assert abs(fingerprint([y])[0] - float(torch.linalg.vector_norm(y.double()))) < 1e-9
    assert not fingerprints_agree(fingerprint([y]), fingerprint([late]), 2e-2)


def tune_fusion(graph: Any, fusion: Any, feeds: Any, plan: Any = None) -> tuple[Any, Any]:
    """The tuning stage (opfuse.tuning.orchestrate.tune) on the planner's `fusion` of `graph`, in
    fp32 on TEST_DEVICE with a 60 s budget, from `plan` (made from `fusion` when None): (its
    TuningResult, the PlanBuilder of the tuned plan)."""
    from opfuse.pipeline.builder import PlanBuilder
    from opfuse.tuning import orchestrate
    from tests.builders import TEST_DEVICE

    builder = PlanBuilder(graph, list(fusion.groups), "fp32", graph.inputs, graph.outputs)
    plan = builder.plan() if plan is None else plan
    result = orchestrate.tune(builder, plan, fusion.lone, TEST_DEVICE, feeds, 60.0)
    return result, builder.adopt(result)


def _tune_with_fake_times(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    model: Any,
    shape: list[int],
    select: Callable[[Any], bool],
    is_split: Callable[[Any, str], bool],
    faster: str,
) -> tuple[dict[str, Any], str, Callable[[], Any]]:
    """The tuning stage on the one group `select` picks, with the split form (`is_split` of a plan)
    or the fused kernel timed faster: (the tuning record, the group's id, the plan as tuned)."""

    def group_ms(plan: Any, gid: str, groups: list[Any]) -> dict[str, float]:
        return {gid: 1.0 if is_split(plan, gid) == (faster == "split") else 2.0}

    record, gid, make_plan, _ = _tune_with(monkeypatch, tmp_path, model, shape, select, group_ms)
    assert record["variants"][gid]["choice"] == ("vendor" if faster == "split" else "template")
    return record, gid, make_plan


def _tune_with(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    model: Any,
    shape: list[int],
    select: Callable[[Any], bool],
    group_ms: Callable[[Any, str, list[Any]], dict[str, float]],
) -> tuple[dict[str, Any], str, Callable[[], Any], dict[str, str]]:
    """The tuning stage on `model`, every candidate plan's groups timed by `group_ms(plan, id of the
    group `select` picks, the fusion's groups)`: (the tuning record, that id, the plan as tuned,
    the variants chosen)."""
    import numpy as np

    from opfuse.frontend.load import load_and_specialize
    from opfuse.fusion.planner import plan_fusion
    from opfuse.graph import graph_from_onnx
    from opfuse.passes.pipeline import run_passes
    from opfuse.runtime.ops import SUPPORTED_OPS
    from opfuse.tuning import configs as tune
    from opfuse.verify.reference import random_inputs

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    _, spec = load_and_specialize(model, {"x": shape}, SUPPORTED_OPS)
    graph = graph_from_onnx(spec)
    run_passes(graph)
    fusion = plan_fusion(graph)
    (gid,) = [g.id for g in fusion.groups if select(g)]

    def timed(plan: Any, executor: Any, feeds: Any, tuned: Any) -> dict[str, float]:
        return group_ms(plan, gid, fusion.groups)

    monkeypatch.setattr(tune, "variant_group_times", timed)
    feeds = random_inputs(graph.inputs, np.random.default_rng(6))
    result, tuned = tune_fusion(graph, fusion, feeds)
    return result.record, gid, tuned.plan, result.variants


@pytest.mark.parametrize("faster", ["fused", "split"])
def test_a_depthwise_prologue_is_timed_against_its_split_form(
    faster: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The alternative to a 1x1 conv computing its depthwise input on its tiles is the depthwise
    conv's own kernel, then the 1x1 conv's template (what the plan is without the rule), not the
    library ops; the faster is kept, and the record says what the alternative was."""
    from tests.unit.test_conv import separable

    def is_split(plan: Any, gid: str) -> bool:
        assert all(s.kind == "kernel" for s in plan.steps if s.group == gid)  # no library op
        return sum(k.group == gid for k in plan.kernels.values()) == 2

    model, _ = separable(1, 16, 24, 6)
    record, gid, make_plan = _tune_with_fake_times(
        monkeypatch, tmp_path, model, [1, 16, 6, 6], lambda g: bool(g.prologue), is_split, faster
    )
    assert record["variants"][gid]["vendor_form"].startswith("split")
    kinds = [k.kind for k in make_plan().kernels.values() if k.group == gid]
    assert kinds == (["conv", "conv"] if faster == "split" else ["conv"])


@pytest.mark.parametrize("faster", ["fused", "split"])
def test_a_depthwise_reduction_is_timed_against_its_split_form(
    faster: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The alternative to a row kernel computing its depthwise conv on its tiles is the plan
    without the rule: the library's depthwise conv, then the row kernel. The faster is kept."""
    from tests.unit.test_conv import depthwise_squeeze_excite

    def is_split(plan: Any, gid: str) -> bool:
        return any(s.kind == "op" for s in plan.steps if s.group == gid)

    model, _ = depthwise_squeeze_excite(1, 16, 6)
    record, gid, make_plan = _tune_with_fake_times(
        monkeypatch,
        tmp_path,
        model,
        [1, 16, 6, 6],
        lambda g: g.kind == "rowwise" and bool(g.prologue),
        is_split,
        faster,
    )
    assert (
        record["variants"][gid]["vendor_form"] == "split: the library's depthwise conv, then the row kernel"
    )
    mine = [(s.kind, s.op_type) for s in make_plan().steps if s.group == gid]
    assert mine == ([("op", "opfuse.ConvNHWC"), ("kernel", "")] if faster == "split" else [("kernel", "")])


@pytest.mark.parametrize("faster", ["fused", "split"])
def test_a_gemm_reduction_is_timed_against_its_split_form(
    faster: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The alternative to a row kernel computing its GEMM on its tiles (a Linear, its bias, the
    residual and the LayerNorm) is the plan without the rule: the library's GEMM, then the row
    kernel. The faster is kept."""
    from onnx import helper

    from tests.builders import tiny_model, weights

    def is_split(plan: Any, gid: str) -> bool:
        return any(s.kind == "op" for s in plan.steps if s.group == gid)

    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
        helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
        helper.make_node("Add", ["hb", "x"], ["s"], name="residual"),
        helper.make_node("LayerNormalization", ["s", "g"], ["y"], name="ln", axis=-1),
    ]
    inits = {"w": weights(32, 32), "b": weights(32, seed=1), "g": 1.0 + weights(32, seed=2)}
    model = tiny_model(nodes, {"x": [2, 5, 32]}, {"y": [2, 5, 32]}, inits)
    record, gid, make_plan = _tune_with_fake_times(
        monkeypatch,
        tmp_path,
        model,
        [2, 5, 32],
        lambda g: g.kind == "rowwise" and bool(g.prologue),
        is_split,
        faster,
    )
    assert record["variants"][gid]["vendor_form"] == "split: the library's GEMM, then the row kernel"
    mine = [(s.kind, s.op_type) for s in make_plan().steps if s.group == gid]
    assert mine == ([("op", "MatMul"), ("kernel", "")] if faster == "split" else [("kernel", "")])


@pytest.mark.parametrize("faster", ["fused", "split"])
def test_a_conv_summing_a_shortcut_is_timed_against_the_librarys_two_convolutions(
    faster: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The alternative to a conv summing its 1x1 shortcut in a second K loop (shortcut_conv) is the
    library's per-op kernel of that conv (its two convolutions and their sum), then the epilogue's
    kernel; the faster is kept."""
    from opfuse.ir.ops import has_shortcut
    from tests.unit.test_conv import bottleneck

    def is_split(plan: Any, gid: str) -> bool:
        return any(s.kind == "op" for s in plan.steps if s.group == gid)

    record, gid, make_plan = _tune_with_fake_times(
        monkeypatch,
        tmp_path,
        bottleneck(1, 8, 8, 16, 7),
        [1, 8, 7, 7],
        lambda g: has_shortcut(g.nodes[0]),
        is_split,
        faster,
    )
    assert "vendor_form" not in record["variants"][gid]  # the library's kernel, no split form
    mine = [(s.kind, s.op_type, s.launches) for s in make_plan().steps if s.group == gid]
    assert mine == (
        [("op", "opfuse.ConvNHWC", 3), ("kernel", "", 1)] if faster == "split" else [("kernel", "", 1)]
    )


def test_a_start_config_that_fails_to_compile_gives_way_to_the_first_that_does(
    tuning: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Untuned on the GPU, a kernel whose starting config does not compile there (a conv tile
    whose pipeline stages overflow shared memory) runs at the first of its fallback configs that
    compiles and runs, rather than leaving its group unfused. Fallbacks: one stage, then half the
    K tile, then the tuning candidates, without repeats."""
    from opfuse.runtime.plan import KernelInfo

    conv = KernelInfo("k1", "conv", "g1", [], [], {"BLOCK_M": 64, "BLOCK_K": 64, "num_stages": 3}, "")
    monkeypatch.setitem(tuning.CANDIDATES, "conv", [{}, {"BLOCK_M": 32}, {"num_stages": 1}])
    assert tuning.fallback_configs(conv) == [
        {"BLOCK_M": 64, "BLOCK_K": 64, "num_stages": 1},
        {"BLOCK_M": 64, "BLOCK_K": 32, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_K": 64, "num_stages": 3},
    ]

    plan = one_kernel_plan()
    plan.kernels["k0_add"].config = {"BLOCK": 64, "fault": "raise"}
    monkeypatch.setitem(
        tuning.CANDIDATES,
        "pointwise",
        [{}, {"fault": "exit"}, {"fault": "none", "BLOCK": 128}, {"fault": "none", "BLOCK": 32}],
    )
    k = plan.kernels["k0_add"]
    sig = tuning.kernel_signature(k)
    with CompilePool("cpu", workers=2) as compiler:
        assert tuning.first_configs_that_compile([(plan, k)], compiler) == {
            sig: {"BLOCK": 128, "fault": "none"}
        }
        # precompile does it for every plan it compiles, tuned or not: the kernel's config is the
        # first that compiled, and why its start failed is kept.
        pre = tuning.precompile([plan], None, compiler)
        assert k.config == {"BLOCK": 128, "fault": "none"}
        assert pre.refit[sig][0] == k.config and "ValueError" in pre.refit[sig][1]
        assert (sig, tuning.config_key({"BLOCK": 64, "fault": "raise"})) in pre.failed
        monkeypatch.setitem(tuning.CANDIDATES, "pointwise", [{"fault": "exit"}])
        k.config = {"BLOCK": 64, "fault": "raise"}
        assert tuning.first_configs_that_compile([(plan, k)], compiler) == {}
        pre = tuning.precompile([plan], None, compiler)
        # None compiled: the kernel keeps its failing start, which the compiler never runs.
        assert pre.refit == {} and (sig, tuning.config_key(k.config)) in pre.failed


def test_the_tuning_record_names_the_kernels_of_the_plan_that_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The template and vendor plans number their kernels alike (both have a "k0": the conv
    template in one, the library conv's epilogue in the other). The record is kept by kernel
    signature while tuning, then keyed by the ids of the plan that runs, each with that kernel's
    config: here the vendor variant's epilogue, not the template it was timed against."""
    from opfuse.report import tuned_kernels
    from opfuse.tuning.cache import kernel_signature
    from tests.builders import conv_bn_relu

    def library_faster(plan: Any, gid: str, groups: list[Any]) -> dict[str, float]:
        fused = {k.group for k in plan.kernels.values() if k.kind == "conv"}
        return {g.id: 2.0 if g.id in fused else 1.0 for g in groups}

    record, gid, make_plan, variants = _tune_with(
        monkeypatch, tmp_path, conv_bn_relu(4, 8, 8), [1, 4, 8, 8], lambda g: g.kind == "conv", library_faster
    )
    assert variants[gid] == "vendor"
    plan = make_plan()
    by_signature = dict(record["kernels"])
    signatures = {kid: kernel_signature(k) for kid, k in plan.kernels.items()}
    assert len(by_signature) == 2 and set(signatures.values()) < set(by_signature)  # the template's too
    tuned_kernels(plan, record)
    assert set(record["kernels"]) == set(plan.kernels)
    assert [k.kind for k in plan.kernels.values()] == ["pointwise"]
    for kid, sig in signatures.items():
        assert record["kernels"][kid] is by_signature[sig] and "config" in by_signature[sig]


@pytest.mark.parametrize("template_first, vendor_first", [(1.0, 1.05), (1.0, 2.0)])
def test_a_close_choice_is_timed_again_with_the_forms_alternating(
    template_first: float, vendor_first: float, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A group whose template and library forms came out within CLOSE_RATIO in the first pass is
    timed again: both plans' group steps, really run (the interpreter here), alternating for the
    rounds; the medians decide, and the record keeps the first times and each form's range. A
    group far apart is decided by the first pass."""
    from opfuse.tuning.configs import CLOSE_RATIO
    from opfuse.tuning.orchestrate import RETIME_CPU, RETIME_GPU
    from tests.builders import TEST_DEVICE, conv_bn_relu

    def first(plan: Any, gid: str, groups: list[Any]) -> dict[str, float]:
        template = any(k.group == gid and k.kind == "conv" for k in plan.kernels.values())
        return {gid: template_first if template else vendor_first}

    record, gid, _, variants = _tune_with(
        monkeypatch, tmp_path, conv_bn_relu(4, 8, 8), [1, 4, 8, 8], lambda g: g.kind == "conv", first
    )
    entry = record["variants"][gid]
    if vendor_first > CLOSE_RATIO * template_first:
        assert "retimed" not in entry and "retime" not in record
        assert entry == {"choice": "template", "template_ms": 1.0, "vendor_ms": 2.0}
        return
    again = entry["retimed"]
    assert (
        again["first_ms"] == [template_first, vendor_first]
        and again["rounds"] == (RETIME_CPU if TEST_DEVICE == "cpu" else RETIME_GPU)[0]
    )
    assert record["retime"]["groups"] == 1
    for form in ("template", "vendor"):
        lo, hi = again[f"{form}_range"]
        assert 0.0 < lo <= entry[f"{form}_ms"] <= hi  # the median of real runs, not the first time
    assert entry["template_ms"] != template_first and entry["vendor_ms"] != vendor_first
    assert (
        variants[gid]
        == entry["choice"]
        == ("vendor" if entry["vendor_ms"] < entry["template_ms"] else "template")
    )


def test_a_second_timing_that_raises_leaves_the_first_times_to_decide(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The second timing is a second opinion: where it raises (here the timer, for every group),
    the choice is the first pass's, the record says why in one line, and tuning goes on."""
    from opfuse.runtime import executor as executor_module
    from tests.builders import conv_bn_relu

    def broken(self: Any, gid: str) -> float:
        raise RuntimeError("injected: the second timing failed")

    monkeypatch.setattr(executor_module.GroupTimer, "time", broken)

    def first(plan: Any, gid: str, groups: list[Any]) -> dict[str, float]:
        template = any(k.group == gid and k.kind == "conv" for k in plan.kernels.values())
        return {gid: 1.05 if template else 1.0}

    record, gid, make_plan, variants = _tune_with(
        monkeypatch, tmp_path, conv_bn_relu(4, 8, 8), [1, 4, 8, 8], lambda g: g.kind == "conv", first
    )
    assert record["retime_error"] == "RuntimeError: injected: the second timing failed"
    assert "retime" not in record and "retimed" not in record["variants"][gid]
    assert record["variants"][gid] == {"choice": "vendor", "template_ms": 1.05, "vendor_ms": 1.0}
    assert variants[gid] == "vendor" and [k.kind for k in make_plan().kernels.values()] == ["pointwise"]


def test_the_first_pass_times_each_group_s_steps_together(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The first pass over each candidate plan times a group's steps as one unit (GroupTimer), as
    the plan's graph runs them: the library form's conv and its epilogue kernel together, not
    each alone and summed. Every group of both plans is timed FIRST rounds; the choice takes the
    medians of real runs."""
    import numpy as np

    from opfuse.frontend.load import load_and_specialize
    from opfuse.fusion.planner import plan_fusion
    from opfuse.graph import graph_from_onnx
    from opfuse.passes.pipeline import run_passes
    from opfuse.runtime import executor as executor_module
    from opfuse.runtime.ops import SUPPORTED_OPS
    from opfuse.tuning.configs import FIRST_CPU, FIRST_GPU
    from opfuse.verify.reference import random_inputs
    from tests.builders import TEST_DEVICE, conv_bn_relu

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    timed: list[tuple[int, str, tuple[str, ...]]] = []
    original = executor_module.GroupTimer.time

    def spy(self: Any, gid: str) -> float:
        plan = self.executor.plan
        kinds = tuple(s.kind if s.kind == "kernel" else s.op_type for _, s in self.steps[gid])
        timed.append((id(plan), gid, kinds))
        return original(self, gid)

    monkeypatch.setattr(executor_module.GroupTimer, "time", spy)
    _, spec = load_and_specialize(conv_bn_relu(4, 8, 8), {"x": [1, 4, 8, 8]}, SUPPORTED_OPS)
    graph = graph_from_onnx(spec)
    run_passes(graph)
    fusion = plan_fusion(graph)
    (gid,) = [g.id for g in fusion.groups if g.kind == "conv"]
    result, _ = tune_fusion(graph, fusion, random_inputs(graph.inputs, np.random.default_rng(6)))
    entry = result.record["variants"][gid]
    assert math.isfinite(entry["template_ms"]) and math.isfinite(entry["vendor_ms"])
    rounds = (FIRST_CPU if TEST_DEVICE == "cpu" else FIRST_GPU)[0]
    forms = {kinds for _, g, kinds in timed if g == gid}
    # The template (reading the NCHW image in place: layout_prologue); the library form: the
    # Transpose to NHWC, the library's conv, the epilogue's kernel.
    assert forms == {("kernel",), ("Transpose", "opfuse.ConvNHWC", "kernel")}
    plans = {p for p, g, _ in timed if g == gid}
    assert len(plans) == 2
    for p in plans:  # the first pass: `rounds` times each; a close pair adds the second timing's
        n = sum(1 for q, g, _ in timed if q == p and g == gid)
        assert n == rounds + (entry["retimed"]["rounds"] if "retimed" in entry else 0)


def test_a_device_lost_while_timing_fails_the_compile_where_it_happened(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A sticky device error (an illegal memory access: nothing on the device runs after it) met
    while timing is no group's fault and no second opinion that failed: tuning raises it where it
    happened, instead of leaving every kernel untuned and failing at the next upload."""
    import opfuse
    from opfuse.runtime import executor as executor_module
    from tests.builders import conv_bn_relu

    def lost(self: Any, gid: str) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(executor_module.GroupTimer, "time", lost)
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        opfuse.compile(conv_bn_relu(4, 8, 8), input_shapes={"x": [1, 4, 8, 8]}, tune_budget_s=5)
    assert executor_module.device_lost(RuntimeError("CUDA error: misaligned address"))
    assert not executor_module.device_lost(RuntimeError("operation not permitted when stream is capturing"))


def test_the_group_timer_runs_the_groups_steps_on_their_inputs() -> None:
    """GroupTimer keeps only the inputs of the groups it times and runs exactly their steps."""
    import numpy as np

    from opfuse.runtime.executor import Executor, GroupTimer
    from opfuse.verify.reference import random_inputs
    from tests.builders import TEST_DEVICE

    plan = one_kernel_plan()
    executor = Executor(plan, TEST_DEVICE)
    (gid,) = {s.group for s in plan.steps if s.group}
    timer = GroupTimer(executor, random_inputs(plan.inputs, np.random.default_rng(2)), [gid], reps=2)
    (kernel,) = plan.kernels.values()
    assert set(timer.env) == set(kernel.inputs)
    ran: list[int] = []
    real = executor._run_step
    executor._run_step = lambda i, step, env, arena=False: (ran.append(i), real(i, step, env, arena))  # type: ignore[method-assign]
    assert timer.time(gid) > 0.0
    steps = [i for i, s in enumerate(plan.steps) if s.group == gid]
    assert ran == steps * 2 or TEST_DEVICE != "cpu"  # a CUDA graph replays what it captured


# --- a cache that holds only what ran; workers that cannot start --------------------------------


SHADOWED = "opfuse cannot be imported here (simulated)"


def _shadowing_env(tmp_path: Any, real: Callable[[], dict[str, str]]) -> Callable[[], dict[str, str]]:
    """child_env with a shadowing `opfuse` package first on the worker's path, whose import fails
    (as where the library was used from a source tree the worker did not see)."""
    shadow = tmp_path / "shadow"
    (shadow / "opfuse").mkdir(parents=True, exist_ok=True)
    (shadow / "opfuse" / "__init__.py").write_text(f"raise ImportError({SHADOWED!r})\n")

    def broken() -> dict[str, str]:
        env = real()
        env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", "")])
        env["PYTHONSAFEPATH"] = "1"  # and not the working folder (this checkout) before it
        return env

    return broken


def test_a_worker_imports_what_the_parent_imports(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module found only on this process's sys.path (not installed, not on PYTHONPATH) is found
    by the worker too: here its timer."""
    (tmp_path / "opfuse_probe_timer.py").write_text("def timer(fn, reps):\n    fn()\n    return 1.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with TuningPool("cpu", timer="opfuse_probe_timer:timer", start_timeout_s=60) as p:
        timing = p.time(request())
    assert timing.error is None and timing.ms == 1.25


def test_cache_entries_that_are_not_finite_are_ignored_and_never_written(tuning: Any, tmp_path: Any) -> None:
    import json

    plan = one_kernel_plan()
    sig = tuning.kernel_signature(plan.kernels["k0_add"])
    poisoned = {
        sig: {"config": {"BLOCK": 64}, "ms": math.inf},
        "nan": {"config": {}, "ms": math.nan},
        "crash": {"config": {}, "ms": math.inf, "crashed": "died"},
        "variant:x": {"choice": "vendor", "template_ms": math.inf, "vendor_ms": 0.2},
        "good": {"config": {"BLOCK": 32}, "ms": 0.5},
    }
    (tmp_path / "tuning.json").write_text(json.dumps(poisoned))  # Infinity, NaN: as an old opfuse wrote
    cache = tuning.TuningCache()
    assert cache.data == {"good": {"config": {"BLOCK": 32}, "ms": 0.5}}
    assert cache.get(sig) is None
    cache.put("bad", {"config": {}, "ms": math.inf})
    cache.put("worse", {"config": {}, "ms": math.nan, "crashed": "segfault"})
    assert "bad" not in cache.data and "worse" not in cache.data
    cache.save()
    on_disk = json.loads((tmp_path / "tuning.json").read_text())
    assert on_disk == {"good": {"config": {"BLOCK": 32}, "ms": 0.5}}

    # The kernel the poisoned file held as failed is timed again, and not marked unsafe.
    record = tuning.tune_kernel_configs(plan, cpu_executor(), cache, time.perf_counter() + 60, ScriptedPool())
    assert "cached" not in record["k0_add"] and math.isfinite(record["k0_add"]["ms"])
    assert tuning.unsafe_groups(plan, record) == set()
    assert cache.data[sig]["ms"] == record["k0_add"]["ms"]


def test_a_kernel_no_config_ran_is_unsafe_for_this_compile_only(
    tuning: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(tuning.CANDIDATES, "pointwise", [{"fault": "raise"}])
    plan, cache = one_kernel_plan(), tuning.TuningCache()

    class Failing(ScriptedPool):
        def time(self, req: TimingRequest, timeout_s: float | None = None) -> Timing:
            self.requests.append(req)
            return Timing(math.inf, "ValueError: no such config")

    record = tuning.tune_kernel_configs(plan, cpu_executor(), cache, time.perf_counter() + 60, Failing())
    assert record["k0_add"]["ms"] == math.inf and "no such config" in record["k0_add"]["failed"]
    assert tuning.unsafe_reasons(plan, record) == {
        "g0": "its generated kernel failed in the tuning worker: " + record["k0_add"]["failed"]
    }
    assert cache.data == {}  # the next compile tries it again


def test_compile_workers_that_cannot_start_fail_no_kernel(
    tuning: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compile workers that cannot import opfuse: nothing counts as failed to compile, the
    candidates go to the tuner's worker; one worker of two broken: the other compiles everything."""
    from opfuse.tuning import pool as tuning_pool

    monkeypatch.setitem(tuning.CANDIDATES, "pointwise", [{}, {"BLOCK": 128}])
    real = tuning_pool.child_env
    monkeypatch.setattr(tuning_pool, "child_env", _shadowing_env(tmp_path, real))
    plan = one_kernel_plan()
    with CompilePool("cpu", workers=2) as compiler:
        pre = tuning.precompile([plan], tuning.TuningCache(), compiler, budget_s=60)
        pool = ScriptedPool()
        record = tuning.tune_kernel_configs(
            plan, cpu_executor(), tuning.TuningCache(), time.perf_counter() + 60, pool, precompiled=pre
        )
        pre.close()
    assert pre.failed == {} and SHADOWED in (pre.start_error or "")
    assert len(pool.requests) == 2 and math.isfinite(record["k0_add"]["ms"])  # timed by the tuner's

    calls = iter([_shadowing_env(tmp_path, real), real])
    monkeypatch.setattr(tuning_pool, "child_env", lambda: next(calls, real)())
    requests = [request(BLOCK=b) for b in (16, 32, 64, 128)]
    with CompilePool("cpu", workers=2) as compiler:
        job = compiler.submit(requests)
        results = job.results()
    assert all(r is not None and r.ok for r in results) and "could not start" in (job.start_error or "")


def test_a_compile_whose_workers_cannot_import_then_a_healthy_one_on_the_same_cache(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on a GPU host: tuning workers that could not import opfuse failed every kernel, the
    failures went into the shared cache, and every later compile there lost those groups (and
    crashed). Now the broken compile says so in one line, runs every group untuned and verifies;
    the cache keeps no failure; the next compile on the same cache tunes normally."""
    import json

    import opfuse
    from opfuse.tuning import cache, configs
    from opfuse.tuning import pool as tuning_pool
    from tests.builders import TEST_DEVICE, softmax_then_gemm

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OPFUSE_TUNE_INPROCESS", raising=False)
    real = tuning_pool.child_env
    monkeypatch.setattr(tuning_pool, "child_env", _shadowing_env(tmp_path, real))
    broken = opfuse.compile(softmax_then_gemm(seed=11), device=TEST_DEVICE, tune_budget_s=60)
    t = broken.report["tuning"]
    assert "could not start" in t["error"] and SHADOWED in t["error"]
    assert t["unsafe_groups"] == [] and t["kernels"] and t["summary"]["timed"] == 0
    assert all(k.get("skipped") == configs.NO_WORKER for k in t["kernels"].values())
    assert broken.report["verification"]["passed"] is True
    assert sorted(g["kind"] for g in broken.report["fusion"]["groups"]) == ["gemm", "rowwise"]
    path = tmp_path / "cache" / "tuning.json"
    on_disk = json.loads(path.read_text()) if path.exists() else {}
    assert all(cache.measured(v) for v in on_disk.values())
    assert not any("config" in v for v in on_disk.values())  # no kernel config: nothing was timed

    monkeypatch.setattr(tuning_pool, "child_env", real)
    healthy = opfuse.compile(softmax_then_gemm(seed=11), device=TEST_DEVICE, tune_budget_s=60)
    t = healthy.report["tuning"]
    assert "error" not in t and t["unsafe_groups"] == []
    assert t["summary"]["timed"] == t["summary"]["kernels"] > 0
    assert all(math.isfinite(k["ms"]) for k in t["kernels"].values())
    assert healthy.report["verification"]["passed"] is True
    assert sorted(g["kind"] for g in healthy.report["fusion"]["groups"]) == ["gemm", "rowwise"]
    on_disk = json.loads(path.read_text())
    assert sum("config" in v for v in on_disk.values()) == t["summary"]["kernels"]
    assert all(cache.measured(v) for v in on_disk.values())


def test_a_lone_anchor_left_to_the_library_is_never_unsafe(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone GEMM whose template crashed and that runs as the library's op is no group any more:
    it is not among the unsafe groups (the compiler once looked it up among the groups and raised
    StopIteration)."""
    import numpy as np
    from onnx import helper

    from opfuse.tuning import configs as tune
    from tests.unit.test_fusion import make_model

    real = tune.unsafe_reasons

    def crashed(plan: Any, tuned: Any) -> dict[str, str]:
        return {**real(plan, tuned), **{k.group: "died" for k in plan.kernels.values() if k.kind == "gemm"}}

    monkeypatch.setattr(tune, "unsafe_reasons", crashed)
    rng = np.random.default_rng(5)
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        {"x": [8, 16]},
        {"y": [8, 12]},
        {"w": rng.standard_normal((16, 12))},
    )

    def group_ms(plan: Any, gid: str, groups: list[Any]) -> dict[str, float]:
        template = any(k.group == gid for k in plan.kernels.values())
        return {gid: 2.0 if template else 1.0}

    monkeypatch.setattr(tune, "variant_group_times", lambda plan, ex, feeds, tuned: group_ms(plan, gid, []))
    from opfuse.frontend.load import load_and_specialize
    from opfuse.fusion.planner import plan_fusion
    from opfuse.graph import graph_from_onnx
    from opfuse.passes.pipeline import run_passes
    from opfuse.runtime.ops import SUPPORTED_OPS
    from opfuse.verify.reference import random_inputs

    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path))
    _, spec = load_and_specialize(model, {"x": [8, 16]}, SUPPORTED_OPS)
    graph = graph_from_onnx(spec)
    run_passes(graph)
    fusion = plan_fusion(graph)
    (gid,) = [g.id for g in fusion.lone]
    feeds = random_inputs(graph.inputs, rng)
    record = tune_fusion(graph, fusion, feeds)[0].record
    assert record["lone_anchors"]["library"] == [gid]
    assert record["unsafe_groups"] == [] and record["unsafe"] == {}


def test_a_split_forms_choice_is_cached_under_its_form() -> None:
    """A choice between a group's template and its split form is keyed by the form as well as the
    template kernel: a choice cached against an earlier form (pooled_gemm's GEMM template) is not
    taken for one against another (the library's GEMM), nor for the library's kernel."""
    from bench.kernels import plan_model
    from opfuse.codegen.registry import split_form
    from opfuse.tuning.orchestrate import variant_cache_key
    from tests.unit.test_gemm import classifier_head

    shapes = {"x": [1, 24, 5, 5], "r": [1, 24, 5, 5]}
    p = plan_model(classifier_head(1, 24, 5, 40), shapes, "fp32")
    (g,) = [g for g in p.fusion.groups if g.kind == "gemm"]
    (k,) = [k for k in p.plan.kernels.values() if k.group == g.id]
    form = split_form(g)
    assert form == "split: the row kernel, then the library's GEMM"
    key = variant_cache_key(form, k)
    assert key.startswith(f"variant-split:{form}:")
    assert key != variant_cache_key("split: the row kernel, then the GEMM's template", k)
    assert variant_cache_key(None, k).startswith("variant:") and variant_cache_key(None, k) != key
