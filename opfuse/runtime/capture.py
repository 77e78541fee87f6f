"""What keeps a plan from being captured as one CUDA graph, found without a GPU.

A CUDA graph replays device work only: a step that reads a device value on the host (a shape, an
axis, a count) or copies a host table to the device mid-run cannot be captured, and the plan then
runs step by step, paying a launch from the host per kernel. The runtime is built so that static
plans never do that (ops_registry.OpEntry.host_inputs: constants an op reads on the host come from
a host copy; tensors.device_table: host-computed tables are copied once and kept on the device).
Two checks hold it to that:

- `host_blockers(plan)`, static and cheap: the steps that must touch the host whatever the data
  (an op whose output shape depends on values; an input read on the host that is computed at run
  time). The CUDA-graph runner refuses such a plan up front with these reasons, and the report
  carries them (`cuda_graph.blockers`).
- `audit(executor, env)`, dynamic and CPU-only (tests, the corpus's CPU leg): runs the plan's
  per-op steps under a torch function mode that treats the plan's tensors as device tensors and
  records every read of one on the host (`.item()`, `.tolist()`, `int()`) and every host tensor
  carried into device work. A plan with no static blocker must audit clean.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from opfuse.runtime.executor import HOST_COPY_MAX_ELEMENTS
from opfuse.runtime.ops_index import HOST_INDEX_CHECKS
from opfuse.runtime.ops_recurrent import prepared_weights
from opfuse.runtime.ops_registry import OP_TABLE
from opfuse.runtime.plan import Plan
from opfuse.runtime.tensors import TABLES_ON_CPU, device_tables


class CaptureBlocked(RuntimeError):
    """The plan must touch the host mid-run; the message says which steps and why."""


def host_blockers(plan: Plan) -> list[str]:
    """Why `plan` cannot be one CUDA graph, one line per step (empty: nothing in the way)."""
    reasons = []
    for step in plan.steps:
        if step.kind != "op":
            continue
        entry = OP_TABLE.get(step.op_type)
        if entry is None:
            continue
        if entry.data_dependent_shape:
            reasons.append(
                f"node {step.label!r} ({step.op_type}): its output's shape depends on its input's values"
            )
            continue
        for i in entry.host_inputs:
            name = step.inputs[i] if i < len(step.inputs) else ""
            if name and name not in plan.constants:
                reasons.append(
                    f"node {step.label!r} ({step.op_type}) reads input {i} ({name!r}) on the host, "
                    "and it is computed at run time"
                )
            elif name and plan.constants[name].size > HOST_COPY_MAX_ELEMENTS:
                reasons.append(
                    f"node {step.label!r} ({step.op_type}) reads input {i} ({name!r}) on the host, "
                    f"a constant of {plan.constants[name].size} elements (host copies stop at "
                    f"{HOST_COPY_MAX_ELEMENTS})"
                )
    return reasons


def describe(reasons: list[str], limit: int = 3) -> str:
    more = f" (and {len(reasons) - limit} more)" if len(reasons) > limit else ""
    return (
        "the plan reads values on the host mid-run, so it runs step by step: "
        + "; ".join(reasons[:limit])
        + more
    )


# Tensor methods that bring a value to the host.
_HOST_READS = {"item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__"}
# Functions whose output's size depends on the values: a sync on a GPU.
_VALUE_SIZED = {"nonzero", "unique", "unique_consecutive", "masked_select", "bincount"}
# Functions that make a tensor from host data (a copy to the device when `device` names one).
_FROM_HOST = {"tensor", "as_tensor", "from_numpy", "asarray"}


def _names_device(args: Any, kwargs: dict[str, Any]) -> bool:
    return kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args)


class _Audit(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.device: dict[int, weakref.ref[torch.Tensor]] = {}
        self.findings: list[str] = []
        self.step = ""

    def mark(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self.device[id(t)] = weakref.ref(t)
        elif isinstance(t, (list, tuple)):
            for x in t:
                self.mark(x)

    def on_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self.device.get(id(t))
        return ref is not None and ref() is t

    def note(self, what: str) -> None:
        self.findings.append(f"{self.step}: {what}")

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = list(_tensors([*args, *kwargs.values()]))
        dev = [t for t in tensors if self.on_device(t)]
        host = [t for t in tensors if not self.on_device(t)]
        if dev and name in _HOST_READS:
            self.note(f"reads a device value on the host ({name})")
        elif dev and name in _VALUE_SIZED:
            self.note(f"sizes a tensor by device values ({name})")
        elif dev and name == "__getitem__" and any(t.dtype == torch.bool for t in tensors[1:]):
            self.note("indexes by a boolean mask (sized by device values)")
        elif name == "to" and host and not dev and _names_device(args[1:], kwargs):
            self.note(f"copies a host tensor of shape {list(host[0].shape)} to the device")
        elif name in _FROM_HOST and kwargs.get("device") is not None:
            self.note("copies host data to the device")
        elif dev and any(t.dim() > 0 for t in host):
            shape = next(list(t.shape) for t in host if t.dim() > 0)
            self.note(f"uses a host tensor of shape {shape} in device work ({name})")
        out = func(*args, **kwargs)
        if dev or kwargs.get("device") is not None:
            self.mark(out)  # device work makes device tensors; so does a factory given a device
        return out


def _tensors(values: list[Any]) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(list(v))


@contextmanager
def _auditing(mode: _Audit) -> Iterator[_Audit]:
    with mode:
        yield mode


def audit(executor: Any, feeds: Mapping[str, Any]) -> list[str]:
    """Run `executor`'s plan once on the CPU as if on a GPU; what would stop a capture there.

    `executor` must be built with `host_copies=True` (as on a GPU). A first run, not audited,
    fills the device tables (tensors.device_table) and the recurrent ops' prepared weights
    (ops_recurrent.prepared_weights) as a GPU's warm-up before capture does; then the audited
    run. Generated kernels run outside the audit (their launches are device work); their outputs
    count as device tensors."""
    tables = TABLES_ON_CPU.set(True)
    checks = HOST_INDEX_CHECKS.set(False)  # indices are clamped on a GPU, not checked on the host
    try:
        with torch.no_grad():
            executor.run_tensors(executor.prepare_inputs(feeds))
            return _audited_run(executor, feeds)
    finally:
        HOST_INDEX_CHECKS.reset(checks)
        TABLES_ON_CPU.reset(tables)


def _audited_run(executor: Any, feeds: Mapping[str, Any]) -> list[str]:
    env = executor.prepare_inputs(feeds)
    mode = _Audit()
    host = {id(t) for args in executor.host_args for t in args.values()}
    for t in [
        *env.values(),
        *executor.constants.values(),
        *executor.arena_views.values(),
        *device_tables(),
        *prepared_weights(),
    ]:
        if id(t) not in host:
            mode.mark(t)

    def around(i: int, step: Any, run: Callable[[], None], env: dict[str, torch.Tensor]) -> None:
        if step.kind != "op":
            run()
            for name in step.outputs:
                if name in env:
                    mode.mark(env[name])
            return
        mode.step = f"node {step.label!r} ({step.op_type})"
        with _auditing(mode):
            run()

    executor.run_tensors(env, around=around)
    return list(dict.fromkeys(mode.findings))
