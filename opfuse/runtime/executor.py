"""Run a plan: per-op torch kernels and generated Triton kernels over named buffers."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np
import torch

from opfuse.errors import InputError, ModelError
from opfuse.runtime.graph_capture import graph_capture
from opfuse.runtime.kernels import ensure_interpreter, load_kernel_module
from opfuse.runtime.memory import plan_memory
from opfuse.runtime.ops import run_op
from opfuse.runtime.ops_index import checked_index, host_index_checks
from opfuse.runtime.ops_registry import host_inputs
from opfuse.runtime.plan import Plan, Step
from opfuse.runtime.tensors import DTYPE_NAMES, from_numpy, to_numpy, torch_dtype
from opfuse.runtime.timing_lock import timing_section

log = logging.getLogger(__name__)

# Constants up to this many elements that an op reads on the host get a host copy (runtime/capture.py).
HOST_COPY_MAX_ELEMENTS = 1024


class Executor:
    def __init__(self, plan: Plan, device: str, host_copies: bool | None = None) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.interpret = self.device.type != "cuda"
        if self.interpret and plan.kernels:
            ensure_interpreter()
        self.constants = {
            k: from_numpy(v, self.device).to(torch_dtype(plan.values[k].dtype))
            if k in plan.values
            else from_numpy(v, self.device)
            for k, v in plan.constants.items()
        }
        self.modules: dict[str, ModuleType] = {
            kid: load_kernel_module(k.source, self.interpret) for kid, k in plan.kernels.items()
        }
        self.configs = {kid: self._config(kid) for kid in plan.kernels}
        # What each kernel's generated offsets assume of its inputs: checked before every launch, so
        # a value of another shape or type (a bug) fails that group instead of reading past a tensor.
        self.kernel_inputs = {
            kid: [(x, torch.Size(plan.values[x].shape), torch_dtype(plan.values[x].dtype)) for x in k.inputs]
            for kid, k in plan.kernels.items()
        }
        # OPFUSE_TRACE_LAUNCHES=<file>: one line per kernel launch (its module, and the address
        # range of every input and output) appended to the file: a debug switch that matches an
        # address compute-sanitizer reports to the tensor it belongs to.
        self.trace = os.environ.get("OPFUSE_TRACE_LAUNCHES") or None
        # Index inputs of Gathers computed in a kernel (fusion/rules/gather_prologue.py), which
        # clamps them: (input slot, axis size) each, checked on the CPU before its launch.
        self.index_checks: dict[str, list[tuple[int, int]]] = {
            kid: list(getattr(m, "INDEX_CHECKS", ())) for kid, m in self.modules.items()
        }
        # Split-K convs' partial tiles and counters (codegen/conv.py), by device and tiling, made at
        # a first launch and kept (a CUDA graph captured from this executor replays with them).
        # Shared by this plan's steps of one tiling: they run one after another on one stream, and
        # each launch leaves the counters at 0 (ResNet-50 at batch 1: about 7 MB, not 22 per step).
        self.scratch: dict[Any, Any] = {}
        # Inputs an op reads as Python values (axes, shapes, pads, scales: ops_registry.OpEntry.host_inputs)
        # come from a host copy where they are constants of the plan: no device-to-host sync, so
        # the whole plan can be captured as a CUDA graph. On the CPU the constants are host tensors
        # already (`host_copies` forces the copies there: runtime/capture.py's audit uses them).
        if host_copies is None:
            host_copies = self.device.type != "cpu"
        host: dict[str, torch.Tensor] = {}
        self.host_args: list[dict[int, torch.Tensor]] = []
        for step in plan.steps:
            args: dict[int, torch.Tensor] = {}
            for i in host_inputs(step.op_type) if step.kind == "op" and host_copies else ():
                name = step.inputs[i] if i < len(step.inputs) else ""
                value = plan.constants.get(name) if name else None
                if value is None or value.size > HOST_COPY_MAX_ELEMENTS:
                    continue
                if name not in host:
                    host[name] = from_numpy(value).to(self.constants[name].dtype)
                args[i] = host[name]
            self.host_args.append(args)
        self.dies = plan.last_uses()
        self.step_hook: Callable[[int, Step], Any] | None = None
        # Kernel outputs live in one arena at offsets fixed by liveness (runtime/memory.py).
        self.memory = plan_memory(plan)
        self.arena = torch.empty(self.memory.arena_bytes, dtype=torch.uint8, device=self.device)
        # OPFUSE_POISON_BUFFERS=1: kernel output buffers start as bytes 0xFF (NaN in every float
        # type), so a kernel that reads what no kernel wrote shows it. The test suite sets it.
        self.poison = os.environ.get("OPFUSE_POISON_BUFFERS") == "1"
        if self.poison:
            self.arena.fill_(255)
        self.arena_views: dict[str, torch.Tensor] = {}  # made once: the offsets never change
        for name, offset in self.memory.offsets.items():
            spec = plan.values[name]
            dtype = torch_dtype(spec.dtype)
            view = self.arena[offset : offset + spec.numel * dtype.itemsize].view(dtype)
            self.arena_views[name] = view.view(spec.shape)

    def _config(self, kernel_id: str) -> dict[str, Any] | None:
        """Launch parameters: the interpreter's (large blocks: one numpy pass each), else the plan's.
        OPFUSE_INTERPRET_GPU_CONFIGS=1 runs the interpreter with the GPU's configs (slow; for finding
        a bug that only the GPU's tile sizes show)."""
        if self.interpret and os.environ.get("OPFUSE_INTERPRET_GPU_CONFIGS") != "1":
            return dict(self.modules[kernel_id].INTERPRETER_CONFIG)
        return dict(self.plan.kernels[kernel_id].config) or None

    def scratch_bytes(self) -> int:
        """Bytes held by the kernels' scratch (split-K's partial tiles and counters), beside the arena."""
        return sum(t.numel() * t.element_size() for pair in self.scratch.values() for t in pair)

    def prepare_inputs(self, feeds: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        missing = [s.name for s in self.plan.inputs if s.name not in feeds]
        if missing:
            raise ModelError(
                f"missing input(s) {missing}; the model takes {[s.name for s in self.plan.inputs]}"
            )
        env: dict[str, torch.Tensor] = {}
        for spec in self.plan.inputs:
            value = feeds[spec.name]
            t = value if isinstance(value, torch.Tensor) else from_numpy(np.asarray(value))
            if tuple(t.shape) != spec.shape:
                raise ModelError(
                    f"input {spec.name!r} has shape {list(t.shape)}, but the model was compiled for {list(spec.shape)}"
                )
            declared = torch_dtype(spec.dtype)
            if t.dtype.is_floating_point != declared.is_floating_point or (t.dtype == torch.bool) != (
                declared == torch.bool
            ):
                raise ModelError(
                    f"input {spec.name!r} is {DTYPE_NAMES.get(t.dtype, t.dtype)}, but the model takes "
                    f"{spec.dtype}: convert it before running"
                )
            internal = self.plan.values[spec.name]
            env[spec.name] = t.to(device=self.device, dtype=torch_dtype(internal.dtype))
        return env

    def _buffer(self, name: str, arena: bool) -> torch.Tensor:
        if arena and name in self.arena_views:
            return self.arena_views[name]
        spec = self.plan.values[name]
        t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)
        if self.poison:
            t.view(-1).view(torch.uint8).fill_(255)
        return t

    def _run_step(self, i: int, step: Step, env: dict[str, torch.Tensor], arena: bool = False) -> None:
        if step.kind == "op":
            host_args = self.host_args[i]
            args = [
                host_args[j] if j in host_args else (env[x] if x else None) for j, x in enumerate(step.inputs)
            ]
            try:
                outs = run_op(
                    step.op_type, args, step.attrs, num_outputs=len(step.outputs), device=self.device
                )
            except InputError as exc:  # the inputs' fault: say which node, and what to fix
                raise InputError(f"node {step.label!r}: {exc}; fix that input's values") from None
            for name, value in zip(step.outputs, outs, strict=False):
                if name:
                    env[name] = value
            return
        ins = [env[x].contiguous() for x in self.plan.kernels[step.kernel].inputs]
        for t, (name, shape, dtype) in zip(ins, self.kernel_inputs[step.kernel], strict=True):
            if t.shape != shape or t.dtype != dtype:  # the kernel's offsets assume the spec's
                raise KernelInputMismatch(
                    f"step {i} ({step.label or step.kernel}): input {name!r} is {t.dtype} "
                    f"{list(t.shape)}, but kernel {step.kernel} was generated for {dtype} {list(shape)}"
                )
        kouts = [self._buffer(name, arena) for name in step.outputs]
        module = self.modules[step.kernel]
        if self.trace is not None:
            self._trace(i, step, module, ins, kouts)
        for slot, size in self.index_checks[step.kernel]:  # the library Gather's error on the CPU
            if host_index_checks(ins[slot].device):
                try:
                    checked_index(ins[slot], size, "Gather", 0)
                except InputError as exc:
                    raise InputError(f"node {step.label!r}: {exc}; fix that input's values") from None
        if getattr(module, "USES_SCRATCH", False):  # split-K's partial tiles and counters: this plan's own
            module.launch(*ins, *kouts, config=self.configs[step.kernel], scratch=self.scratch)
        else:
            module.launch(*ins, *kouts, config=self.configs[step.kernel])
        env.update(zip(step.outputs, kouts, strict=True))

    def _trace(
        self, i: int, step: Step, module: ModuleType, ins: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> None:
        def ranges(names: list[str], ts: list[torch.Tensor]) -> str:
            return " ".join(
                f"{n}={t.data_ptr():#x}+{t.numel() * t.element_size()}"
                f"[{t.untyped_storage().data_ptr():#x}+{t.untyped_storage().nbytes()}]"
                for n, t in zip(names, ts, strict=True)
            )

        kernel = self.plan.kernels[step.kernel]
        line = (
            f"{os.getpid()} {id(self):#x} step {i} {step.kernel} {os.path.basename(module.__file__ or '')} "
            f"group {step.group} config {self.configs[step.kernel]} in {ranges(kernel.inputs, ins)} "
            f"out {ranges(step.outputs, outs)}\n"
        )
        assert self.trace is not None
        with open(self.trace, "a") as f:
            f.write(line)

    def run_tensors(
        self, env: dict[str, torch.Tensor], keep_all: bool = False, around: Callable[..., None] | None = None
    ) -> dict[str, torch.Tensor]:
        """Run every step; buffers are freed after their last use unless `keep_all`.

        Kernel outputs go to the arena, except with `keep_all` (every value must survive then).
        `around(i, step, run, env)` wraps each step's run (runtime/capture.py's audit).
        """
        env = {**self.constants, **env}
        with _matmul_precision(self.plan.precision, self.device):
            for i, step in enumerate(self.plan.steps):
                if self.step_hook is not None:
                    self.step_hook(i, step)
                if around is None:
                    self._run_step(i, step, env, arena=not keep_all)
                else:
                    around(i, step, functools.partial(self._run_step, i, step, env, arena=not keep_all), env)
                if not keep_all:
                    for name in self.dies.get(i, ()):
                        env.pop(name, None)
        if keep_all:
            return env
        outs = {}
        for spec in self.plan.outputs:
            t = env[spec.name].to(torch_dtype(spec.dtype))
            if t.numel() and t.untyped_storage().data_ptr() == self.arena.untyped_storage().data_ptr():
                t = t.clone()  # a view into the arena: the next run would overwrite it
            outs[spec.name] = t
        return outs

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """numpy in, numpy out; torch in, torch out (DESIGN.md §6)."""
        torch_in = any(isinstance(v, torch.Tensor) for v in feeds.values())
        with torch.no_grad():
            outs = self.run_tensors(self.prepare_inputs(feeds))
        if torch_in:
            return dict(outs)
        return {k: to_numpy(v) for k, v in outs.items()}

    def time_steps(self, feeds: Mapping[str, Any], reps: int = 5) -> list[float]:
        """Time of each step in ms: the profile of this plan.

        CUDA: each step's device time, launches replayed from a CUDA graph (see _device_time).
        CPU: wall time.
        """
        env = self.prepare_inputs(feeds)
        with torch.no_grad():
            if self.device.type != "cuda":
                marks: list[float] = []
                self.step_hook = lambda i, step: marks.append(time.perf_counter())
                try:
                    self.run_tensors(env)
                finally:
                    self.step_hook = None
                marks.append(time.perf_counter())
                return [(b - a) * 1000.0 for a, b in itertools.pairwise(marks)]
            full = self.run_tensors(env, keep_all=True)
            times = []
            with _matmul_precision(self.plan.precision, self.device):
                for i, step in enumerate(self.plan.steps):
                    with timing_section():  # OPFUSE_TIMING_LOCK: one step's timing at a time
                        times.append(self._device_time([(i, step)], full, reps))
            return times

    def _device_time(self, steps: list[tuple[int, Step]], env: dict[str, torch.Tensor], reps: int) -> float:
        """The device time of one run of `steps`: `reps` runs captured in a CUDA graph and replayed
        once, so host launch overhead (which a graph-replayed plan does not pay) stays out of the
        figure. The graph is let go before this returns (a capture costs 4-8 ms)."""
        scratch = dict(env)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def run() -> None:
            for i, step in steps:
                self._run_step(i, step, scratch)

        try:
            try:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    run()  # warm: compile and allocate outside the capture
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with warnings.catch_warnings():
                    # A step that launches nothing (a view: Reshape, Flatten, Squeeze) captures an
                    # empty graph, and torch warns; its device time is ~0, which is the answer.
                    warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                    with graph_capture(graph):
                        for _ in range(reps):
                            run()
                graph.replay()
                start.record()
                graph.replay()
                end.record()
            except RuntimeError as exc:  # a step that cannot be captured is timed eagerly
                if device_lost(exc):
                    raise
                start.record()
                for _ in range(reps):
                    run()
                end.record()
            end.synchronize()
        except RuntimeError as exc:
            if device_lost(exc):  # say where, here: the error is sticky and surfaces anywhere later
                labels = "; ".join(step.label or step.kernel or step.op_type for _, step in steps)
                log.error(
                    "the device failed while timing steps [%s] of plan steps %s: %s",
                    labels,
                    [i for i, _ in steps],
                    str(exc).splitlines()[0],
                )
            raise
        return start.elapsed_time(end) / reps


class KernelInputMismatch(RuntimeError):
    """A kernel was handed a value of another shape or type than its plan's spec (a bug in
    opfuse): raised before the launch, where the kernel would read past the tensor."""


# Errors after which the device's context cannot be used (CUDA's sticky errors): a kernel read
# or wrote outside its memory, or died. Not a capture that failed (the step is timed eagerly).
DEVICE_LOST = (
    "illegal memory access",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
)


def device_lost(exc: BaseException) -> bool:
    """Whether `exc` is a sticky device error: nothing on this device runs after it."""
    text = str(exc)
    return any(s in text for s in DEVICE_LOST)


class GroupTimer:
    """The device time of a few groups' steps of one plan, timed again on demand.

    The tuning stage's second look at a close choice between a group's template and its library
    form (tuning/orchestrate.py) alternates the two plans' timers. The steps' inputs are those of
    one run of the plan, kept; each `time(gid)` runs the group's steps (the library op and its
    epilogue kernel run back to back, as in the plan's own CUDA graph) `reps` times: on a GPU
    captured as one CUDA graph, replayed and let go, as the per-step profile times a step
    (Executor._device_time); on the CPU back to back by the wall clock.

    A first form kept each group's graph (all its steps in one) for every round: on the GPU that
    met an illegal memory access (halonet26t at batch 32, twice in two runs; not under
    CUDA_LAUNCH_BLOCKING=1, and not with the second timing off). torch keeps cuBLAS workspaces per
    capture stream, and a graph let go clears them under graphs still alive that replay with
    them (pytorch/pytorch#193402), which fits. Here no graph outlives its own timing, as in the
    profile.
    """

    def __init__(self, executor: Executor, feeds: Mapping[str, Any], groups: list[str], reps: int) -> None:
        self.executor, self.reps = executor, reps
        plan = executor.plan
        self.steps: dict[str, list[tuple[int, Step]]] = {gid: [] for gid in groups}
        for i, s in enumerate(plan.steps):
            if s.group in self.steps:
                self.steps[s.group].append((i, s))
        needed = {
            x
            for steps in self.steps.values()
            for _, s in steps
            for x in (plan.kernels[s.kernel].inputs if s.kind == "kernel" else s.inputs)
            if x
        }
        with torch.no_grad():
            full = executor.run_tensors(executor.prepare_inputs(feeds), keep_all=True)
        self.env = {x: full[x] for x in needed if x in full}  # the rest of the run is let go

    def time(self, gid: str) -> float:
        """ms of one run of the group's steps (the mean of `reps` back to back)."""
        executor = self.executor
        with torch.no_grad(), _matmul_precision(executor.plan.precision, executor.device):
            if executor.device.type == "cuda":
                return executor._device_time(self.steps[gid], self.env, self.reps)
            env = dict(self.env)
            t0 = time.perf_counter()
            for _ in range(self.reps):
                for i, step in self.steps[gid]:
                    executor._run_step(i, step, env)
            return (time.perf_counter() - t0) * 1000.0 / self.reps


class _matmul_precision:
    """tf32 allows TensorFloat-32 matmuls and convs for the duration of a run; others forbid it."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.enabled = precision == "tf32"
        self.cuda = device.type == "cuda"
        self.saved: tuple[bool, bool] | None = None

    def __enter__(self) -> None:
        if self.cuda:
            self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            torch.backends.cuda.matmul.allow_tf32 = self.enabled
            torch.backends.cudnn.allow_tf32 = self.enabled

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved
