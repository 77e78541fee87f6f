"""The CLI's performance views: where a job's time went (`opfuse profile`), two jobs side by side
(`opfuse compare`) and a local timing (`opfuse bench`). Strings from reports are escaped (client.render).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from client.records import Job, Measurement, ProfileOp, Report
from client.render import Column, escape, fields, fmt_bytes, fmt_num, fmt_status, listing

INTERPRETER_NOTE = "ran in the Triton interpreter on CPU: these times say nothing about GPU speed"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _si(value: float | None) -> str:
    """A count with an SI prefix: 32, 1.02k, 3.4M, 1.1G."""
    if value is None:
        return "-"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{prefix}"
    return f"{value:.3g}"


def steps_table(title: str, steps: Sequence[ProfileOp], top: int | None) -> Table:
    """Steps largest first, like trtexec's --dumpProfile: time, share of the total, bytes, bound."""
    ranked = sorted(steps, key=lambda s: -(s.time_ms or 0.0))
    total = sum(s.time_ms or 0.0 for s in ranked)
    shown = ranked if top is None else ranked[:top]
    columns: list[str | Column] = [
        Column("#", justify="right"),
        "op / group",
        "type",
        Column("time ms", justify="right"),
        Column("share", justify="right"),
        Column("bytes", justify="right"),
        Column("FLOPs", justify="right"),
        "bound",
    ]
    rows = (
        [
            str(i),
            escape(str(s.node)),
            escape(str(s.op_type or "-")),
            _ms(s.time_ms),
            f"{100 * (s.time_ms or 0.0) / total:.1f}%" if total > 0 else "-",
            fmt_bytes(s.bytes),
            _si(s.flops),
            escape(str(s.bound or "-")),
        ]
        for i, s in enumerate(shown, 1)
    )
    left = len(ranked) - len(shown)
    caption = f"total {total:.4g} ms over {len(ranked)} step{'s' if len(ranked) != 1 else ''}" + (
        f"; {left} smaller not shown (--top 0 shows all)" if left else ""
    )
    return listing(title, columns, rows, caption=caption)


def profile_tables(report: Report, top: int | None) -> list[Table]:
    """Before: the original model op by op. After: the fused plan step by step (groups and the ops
    left unfused). The per-step times are the profiler's, not the benchmark's."""
    tables = [steps_table("before: per op (original model)", report.ops, top)]
    after = report.get("profile", {}).get("after")
    if isinstance(after, list):
        steps = tuple(ProfileOp.from_dict(s) for s in after if isinstance(s, Mapping))
        tables.append(steps_table("after: per kernel (fused plan)", steps, top))
    return tables


def _side(m: Measurement | None, key: str) -> float | None:
    if m is None:
        return None
    return m.latency_ms.get(key)


def _verdict(report: Report) -> str:
    passed = report.verification.passed
    if passed is None:
        return "-"
    worst = max((o.rel_l2_err or 0.0 for o in report.verification.outputs.values()), default=None)
    text = "[green]passed[/]" if passed else "[red]FAILED[/]"
    return text + (f" (rel L2 ≤ {worst:.2g})" if worst is not None else "")


def compare_table(pairs: Sequence[tuple[Job, Report | None, str | None]]) -> Table:
    """Jobs side by side, one column each: latency, launches, memory, verification, groups."""
    table = Table(title="compare", title_justify="left", caption_justify="left")
    table.add_column("", style="bold")
    for job, _, _ in pairs:
        table.add_column(escape(str(job.id)), overflow="fold")

    def row(name: str, cell: Any) -> None:
        table.add_row(name, *(cell(job, report, model) for job, report, model in pairs))

    def from_report(fn: Any) -> Any:
        return lambda job, report, model: fn(report) if report is not None else "-"

    row("model", lambda job, report, model: escape(model or str(job.model_id)))
    row("status", lambda job, report, model: fmt_status(job.status))
    row("device", from_report(lambda r: escape(f"{r.device.get('kind', '-')} {r.device.get('name') or ''}")))
    row("precision", from_report(lambda r: escape(str(r.precision or "-"))))
    row("p50 before ms", from_report(lambda r: _ms(_side(r.before, "p50"))))
    row("p50 after ms", from_report(lambda r: _ms(_side(r.after, "p50"))))
    row("p99 after ms", from_report(lambda r: _ms(_side(r.after, "p99"))))
    row("speedup", from_report(lambda r: fmt_num(r.speedup, "{:.2f}x")))
    row(
        "launches",
        from_report(lambda r: f"{fmt_num(r.kernels_before, '{}')} → {fmt_num(r.kernels_after, '{}')}"),
    )
    row(
        "peak memory",
        from_report(
            lambda r: (
                f"{fmt_bytes(r.before and r.before.peak_memory_bytes)} → "
                f"{fmt_bytes(r.after and r.after.peak_memory_bytes)}"
            )
        ),
    )
    row("verification", from_report(_verdict))
    row("fused groups", from_report(lambda r: str(len(r.groups))))
    row("not fused", from_report(lambda r: str(len(r.not_fused))))
    row("kinds", from_report(lambda r: escape(_kinds(r))))
    if any(report is not None and report.on_interpreter for _, report, _ in pairs):
        table.caption = "a cpu-interpreter column's latencies are not a speed claim"
    return table


def _kinds(report: Report) -> str:
    counts: dict[str, int] = {}
    for g in report.groups:
        counts[str(g.kind)] = counts.get(str(g.kind), 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def bench_table(title: str, result: Mapping[str, Any]) -> Table:
    """`opfuse bench`'s answer: the latency percentiles and where they were measured."""
    latency = result.get("latency_ms") or {}
    rows = [
        ("device", escape(str(result.get("device")))),
        ("inputs", escape(str(result.get("inputs")))),
        ("warm-up, iterations", f"{result.get('warmup')}, {result.get('iterations')}"),
        ("method", escape(str(result.get("method")))),
    ]
    rows += [
        (f"latency {k}", f"{_ms(latency.get(k))} ms") for k in ("p50", "p90", "p99", "mean") if k in latency
    ]
    if result.get("peak_memory_bytes") is not None:
        rows.append(("peak memory", fmt_bytes(result.get("peak_memory_bytes"))))
    if result.get("note"):
        rows.append(("note", f"[yellow]{escape(str(result['note']))}[/]"))
    return fields(title, rows)
