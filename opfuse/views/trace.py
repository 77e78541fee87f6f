"""One inference before and after fusion as a Chrome/Perfetto trace (Trace Event Format JSON), the
format torch.profiler writes: open it in chrome://tracing or https://ui.perfetto.dev.

Standard library only. Process 1 is the unfused plan, op by op (profile.ops); process 2 the fused
plan, step by step (profile.after, else the fusion groups' time_ms_after with the unfused ops).
Each step is one complete ("X") event; steps are laid end to end from t=0, ts and dur in µs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["AFTER_PID", "BEFORE_PID", "render_trace"]

BEFORE_PID, AFTER_PID = 1, 2


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list | tuple) else []


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value] if isinstance(value, list | tuple) else []


def _meta(pid: int, name: str, sort: int) -> list[dict[str, Any]]:
    return [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 1, "args": {"sort_index": sort}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "inference"}},
    ]


def _lane(pid: int, steps: list[tuple[str, str, float, dict[str, Any]]]) -> list[dict[str, Any]]:
    events, ts = [], 0.0
    for name, cat, ms, args in steps:
        dur = ms * 1000.0
        events.append(
            {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 1, "ts": ts, "dur": dur, "args": args}
        )
        ts += dur
    return events


def _op_args(op: Mapping[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {"op_type": str(op.get("op_type") or ""), "nodes": _names(op.get("node"))}
    for key in ("bytes", "flops", "intensity", "bound", "time_ms"):
        if op.get(key) is not None:
            args[key] = op.get(key)
    return args


def _after_steps(report: Mapping[str, Any]) -> list[tuple[str, str, float, dict[str, Any]]]:
    fusion = report.get("fusion") if isinstance(report.get("fusion"), Mapping) else {}
    groups = _dicts((fusion or {}).get("groups"))
    by_nodes = {", ".join(_names(g.get("nodes"))): g for g in groups}
    profile = report.get("profile") if isinstance(report.get("profile"), Mapping) else {}
    after = _dicts((profile or {}).get("after"))
    steps = []
    if after:
        for op in after:
            ms = _num(op.get("time_ms"))
            if ms is None:
                continue
            args = _op_args(op)
            group = by_nodes.get(str(op.get("node")))
            if group is not None:
                args |= {"group": group.get("id"), "kind": group.get("kind"), "rule": group.get("rule")}
                args["nodes"] = _names(group.get("nodes"))
                args["kernel"] = group.get("kernel")
                name = f"{group.get('id')} {group.get('kind') or 'fused'}"
                steps.append((name, "fused", ms, args))
            else:
                steps.append((f"{op.get('node')} ({op.get('op_type')})", "op", ms, args))
        return steps
    # No per-step profile of the fused plan: each group where its first node ran, unfused ops as before.
    first_node = {(_names(g.get("nodes")) or [""])[0]: g for g in groups}
    grouped = {n for g in groups for n in _names(g.get("nodes"))}
    placed: set[int] = set()
    for op in _dicts((profile or {}).get("ops")):
        node = str(op.get("node"))
        group = first_node.get(node)
        if group is not None and id(group) not in placed:
            placed.add(id(group))
            ms = _num(group.get("time_ms_after"))
            if ms is not None:
                steps.append(
                    (f"{group.get('id')} {group.get('kind') or 'fused'}", "fused", ms, _group_args(group))
                )
        elif node not in grouped and (ms := _num(op.get("time_ms"))) is not None:
            steps.append((f"{node} ({op.get('op_type')})", "op", ms, _op_args(op)))
    for g in groups:  # groups whose nodes the per-op profile does not name
        if id(g) not in placed and (ms := _num(g.get("time_ms_after"))) is not None:
            steps.append((f"{g.get('id')} {g.get('kind') or 'fused'}", "fused", ms, _group_args(g)))
    return steps


def _group_args(group: Mapping[str, Any]) -> dict[str, Any]:
    args = {k: group.get(k) for k in ("id", "kind", "rule", "kernel", "bytes_saved_est", "time_ms_after")}
    args["op_type"] = "FusedKernel"
    args["nodes"] = _names(group.get("nodes"))
    return {k: v for k, v in args.items() if v is not None}


def render_trace(report: Mapping[str, Any]) -> dict[str, Any]:
    """The trace as a dict ({"traceEvents": [...], ...}); json.dump it to a file. Ops or groups
    without a time are left out; a report with no times gives a trace with only the lane names."""
    if not isinstance(report, Mapping):
        report = {}
    profile = report.get("profile") if isinstance(report.get("profile"), Mapping) else {}
    before = []
    for op in _dicts((profile or {}).get("ops")):
        ms = _num(op.get("time_ms"))
        if ms is not None:
            before.append((f"{op.get('node')} ({op.get('op_type')})", "op", ms, _op_args(op)))
    events = [*_meta(BEFORE_PID, "before (per-op)", 0), *_meta(AFTER_PID, "after (fused)", 1)]
    events += _lane(BEFORE_PID, before)
    events += _lane(AFTER_PID, _after_steps(report))
    device = report.get("device") if isinstance(report.get("device"), Mapping) else {}
    other = {
        "producer": "opfuse",
        "device": (device or {}).get("name"),
        "device_kind": (device or {}).get("kind"),
        "precision": report.get("precision"),
        "timing": (profile or {}).get("timing"),
    }
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {k: v for k, v in other.items() if v is not None},
    }
