"""Report assembly: the report (DESIGN.md §5, docs/bundle.md) and manifest of a compile, from what its
stages made. Nothing here changes a plan or runs one."""

from __future__ import annotations

import datetime as dt
import hashlib
import platform
from typing import TYPE_CHECKING, Any

import onnx
import torch

from opfuse.frontend.inspect import default_opset
from opfuse.fusion.coverage import explain_unfused
from opfuse.fusion.groups import Group
from opfuse.ir.ops import CONV_OPS
from opfuse.passes.rules import node_label
from opfuse.profile.costs import profile_steps, roofline
from opfuse.runtime.bundle import BUNDLE_FORMAT, BUNDLE_VERSION
from opfuse.runtime.capture import host_blockers
from opfuse.runtime.plan import Plan
from opfuse.tuning.cache import kernel_signature
from opfuse.tuning.configs import BUDGET_SPENT

if TYPE_CHECKING:
    from opfuse.pipeline.builder import PlanBuilder
    from opfuse.pipeline.stages import Fused, Loaded, Timed


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


def tuned_kernels(plan: Plan, tuning: dict[str, Any]) -> None:
    """tuning.kernels for the plan that runs: each kernel's tuning record under its id there (a
    repeated layer shares its signature's record)."""
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
    return {
        "budget_s": budget_s,
        "kernels": len(kernels),
        "timed": sum(1 for k in kernels.values() if "candidates" in k),
        "cached": sum(1 for k in kernels.values() if k.get("cached")),
        "budget_spent": sum(1 for k in kernels.values() if k.get("skipped") == BUDGET_SPENT),
        "candidates_left_out": sum(int(k.get("left_out", 0)) for k in kernels.values()),
    }


def group_times(base_plan: Plan, times: list[float], groups: list[Group]) -> dict[str, float]:
    """Each group's time in the unfused profile: the sum of its nodes' steps."""
    # Node ids are stable across passes, so a group's nodes are found in the unfused plan.
    by_node = {s.node: t for s, t in zip(base_plan.steps, times, strict=False) if s.kind == "op"}
    return {g.id: round(sum(by_node.get(n.id, 0.0) for n in [*g.prologue, *g.nodes]), 6) for g in groups}


def conv_times(
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


def bytes_saved(plan: Plan, group: Any) -> int:
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


def manifest(
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


def cuda_graph_outlook(plan: Plan) -> dict[str, Any]:
    """Whether the plan can run as one CUDA graph, and what in it touches the host if not."""
    blockers = host_blockers(plan)
    return {"capturable": not blockers, "blockers": blockers[:20], "blocker_count": len(blockers)}


def assemble(
    loaded: Loaded,
    fused: Fused,
    builder: PlanBuilder,
    before: Timed,
    after: Timed,
    verification: dict[str, Any],
    tuning: dict[str, Any],
    timings: dict[str, float],
    disabled: set[str],
) -> dict[str, Any]:
    """The report of a compile (DESIGN.md §5; benchmark keys come with CompiledModel.benchmark):
    `before` the unfused plan's profile, `after` the fused plan's (its warm executor too),
    `builder` what the fused plan was made of (its groups, variants and unsafe groups)."""
    plan, device, precision = after.plan, after.device, builder.precision
    rolled = set(verification["rolled_back"])
    fused_groups = [g for g in builder.groups if g.id not in rolled and g.id not in builder.unsafe]
    conv_ms = conv_times(before.plan, before.times, plan, after.times, fused_groups)
    info = device_info(device)
    report: dict[str, Any] = {
        "device": {k: info[k] for k in ("kind", "name", "capability", "torch", "triton")},
        "precision": precision,
        "kernels": {"before": before.plan.launches, "after": plan.launches},
        "compute_nodes": sum(1 for s in before.plan.steps if s.launches),
        "speedup": None,
        "peers": {},
        "verification": verification,
        "fusion": {
            "groups": _groups_json(builder, before, after, fused_groups),
            "not_fused": _not_fused(loaded, fused, builder, rolled),
            "passes": {"fired": loaded.passes.fired, "onnx_optimizer": loaded.optimizer_status},
        },
        "profile": {
            "roofline": roofline(precision, device),
            "ops": profile_steps(before.plan, before.times, device=device),
            "after": profile_steps(plan, after.times, device=device),
            **({"convolutions_ms": conv_ms} if conv_ms else {}),
            "timing": "cuda-synchronized wall time per step"
            if info["kind"] == "cuda"
            else "cpu wall time per step (interpreter: not a speed claim)",
        },
        "tuning": tuning,
        "memory": {**after.executor.memory.to_json(), "scratch_bytes": after.executor.scratch_bytes()},
        "cuda_graph": cuda_graph_outlook(plan),
        "timings_s": {k: round(v, 4) for k, v in timings.items()},
    }
    report["fusion"]["coverage"] = explain_unfused(
        loaded.graph, plan, report["fusion"]["not_fused"], disabled
    )
    return report


def _groups_json(
    builder: PlanBuilder, before: Timed, after: Timed, fused_groups: list[Group]
) -> list[dict[str, Any]]:
    """fusion.groups: each fused group with its kernel, bytes saved and time before and after."""
    plan = after.plan
    time_before = group_times(before.plan, before.times, builder.groups)
    time_after: dict[str, float] = {}
    for step, t_ms in zip(plan.steps, after.times, strict=False):
        if step.group:  # a vendor-variant group is its library step plus its epilogue kernel
            time_after[step.group] = round(time_after.get(step.group, 0.0) + t_ms, 6)
    kernel_of_group = {k.group: k.id for k in plan.kernels.values()}
    out = []
    for g in fused_groups:
        d = g.to_json()
        d.update(
            kernel=kernel_of_group.get(g.id),
            bytes_saved_est=bytes_saved(plan, g),
            time_ms_before=time_before.get(g.id),
            time_ms_after=time_after.get(g.id),
        )
        if g.id in builder.variants:
            d["variant"] = builder.variants[g.id]
        out.append(d)
    return out


def _not_fused(loaded: Loaded, fused: Fused, builder: PlanBuilder, rolled: set[str]) -> list[dict[str, Any]]:
    """fusion.not_fused: the rules that did not fire and why, the planner's faults, the groups
    left unfused by a fault (`builder.unsafe`) and those rolled back by verification."""
    not_fused = [nf.to_json() for nf in loaded.passes.not_fired + fused.fusion.not_fused] + fused.fault_notes
    by_id = {g.id: g for g in builder.groups}
    for gid in sorted(builder.unsafe):
        grp = by_id.get(gid)
        if grp is None:  # a group of a candidate plan that is not in this one (nothing of it runs)
            continue
        not_fused.append(
            {
                "rule": grp.rule,
                "nodes": [node_label(n) for n in [*grp.prologue, *grp.nodes]],
                "reason": f"{builder.unsafe[gid]}; its nodes run unfused",
                "fault": True,  # planned, then left unfused by a fault of opfuse's own
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
                "rolled_back": True,
            }
        )
    return not_fused
