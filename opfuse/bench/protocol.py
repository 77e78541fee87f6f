"""Time a plan the same way before and after fusion.

CUDA: CUDA events around each inference, inputs rotated between several sets so caches do not
flatter, p50/p90/p99 and mean over the iterations, peak memory from the caching allocator. A
CUDA-graph runner is timed around its replay alone: each set's inputs are copied into the graph's
buffers before the start event, as a peer's captured graph is timed (bench/run.py `time_cuda`), so
neither figure holds the Python that feeds the replay.
CPU (Triton interpreter): wall time; the numbers describe the interpreter, not a speed claim.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np
import torch

from opfuse.runtime.executor import Executor
from opfuse.runtime.timing_lock import timing_section


def _percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms, dtype=np.float64)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
    }


class _UtilizationSampler:
    """GPU utilization (NVML) sampled in a thread while the timed loop runs; None without NVML."""

    def __init__(self, device_index: int, period_s: float = 0.005) -> None:
        self.samples: list[int] = []
        self.period_s = period_s
        self.stop = threading.Event()
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self.nvml = pynvml
        except Exception:  # NVML is optional: no library, no permission, no device
            self.handle = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append(int(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            except Exception:
                return
            time.sleep(self.period_s)

    def __enter__(self) -> _UtilizationSampler:
        if self.handle is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.handle is not None:
            self.thread.join(timeout=1.0)

    @property
    def mean(self) -> float | None:
        return float(np.mean(self.samples)) if self.samples else None


def _count_launches(executor: Executor, env: dict[str, torch.Tensor]) -> int | None:
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            executor.run_tensors(dict(env))
            torch.cuda.synchronize()
        return sum(
            1
            for e in prof.events()
            if e.device_type.name == "CUDA"
            and "memcpy" not in e.name.lower()
            and "memset" not in e.name.lower()
        )
    except Exception:  # the profiler is optional: a missing CUPTI must not fail a benchmark
        return None


class Runner(Protocol):
    def run_tensors(self, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class Replayer(Protocol):
    """A captured plan: `stage` copies inputs in, `replay` runs it (runtime/cudagraph.GraphRunner)."""

    def stage(self, env: dict[str, torch.Tensor]) -> None: ...

    def replay(self) -> dict[str, torch.Tensor]: ...


def _device_runs(
    executor: Executor,
    envs: list[dict[str, Any]],
    iters: int,
    run: Callable[[dict[str, Any]], Any],
    replayer: Replayer | None,
    runner: Runner | None,
) -> tuple[list[float], int, float | None]:
    """(ms of each of `iters` runs by CUDA events, peak bytes, mean GPU utilization)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    with _UtilizationSampler(executor.device.index or 0) as sampler:
        for i in range(iters):
            env = envs[i % len(envs)]
            if replayer is not None:
                replayer.stage(env)  # enqueued before the start event: not timed
                starts[i].record()
                replayer.replay()
            else:
                starts[i].record()
                run(dict(env))
            ends[i].record()
        torch.cuda.synchronize()
    util = sampler.mean
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    peak = int(torch.cuda.max_memory_allocated() - base)
    peak = max(peak, int(getattr(runner, "pool_bytes", 0)))
    peak += executor.memory.arena_bytes  # kernel outputs: allocated once, before the runs
    return times, peak, util


def measure(
    executor: Executor, feed_sets: list[dict[str, Any]], iters: int, warmup: int, runner: Runner | None = None
) -> dict[str, Any]:
    """Latency percentiles of `runner` (default: the executor step by step) over rotated inputs."""
    envs = [executor.prepare_inputs(f) for f in feed_sets]
    cuda = executor.device.type == "cuda"
    # A captured graph (stage, then replay) is timed around its replay alone.
    replayer = (
        cast(Replayer, runner) if cuda and hasattr(runner, "stage") and hasattr(runner, "replay") else None
    )
    run = (runner or executor).run_tensors
    with torch.no_grad():
        for i in range(warmup):
            run(dict(envs[i % len(envs)]))
        times: list[float] = []
        peak = None
        util: float | None = None
        if cuda:
            # Only the timed runs hold the timing lock (OPFUSE_TIMING_LOCK): not the warm-up.
            with timing_section():
                times, peak, util = _device_runs(executor, envs, iters, run, replayer, runner)
        else:
            for i in range(iters):
                t0 = time.perf_counter()
                run(dict(envs[i % len(envs)]))
                times.append((time.perf_counter() - t0) * 1000.0)
    lat = _percentiles(times)
    return {
        "latency_ms": lat,
        "throughput_per_s": 1000.0 / lat["p50"] if lat["p50"] > 0 else None,
        "peak_memory_bytes": peak,
        "kernel_launches_measured": _count_launches(executor, envs[0]) if cuda else None,
        "cuda_graph": runner is not None,
        # what the events enclose: the replay alone (inputs staged before), or the whole run
        "timed": "replay" if replayer is not None else "run",
        "gpu_util_pct": util,
        "iterations": iters,
    }
