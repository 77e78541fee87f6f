"""How the CLI shows models, jobs and reports to people: rich tables. (`--json` bypasses all of this.)

Every string that comes from a model, a report or the server goes through `escape`: rich markup is
escaped and control characters (C0, DEL, C1, so terminal escape sequences; bidirectional overrides)
are shown as `\\x1b`-style text, so a node name cannot retitle or recolour the user's terminal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.markup import escape as escape_markup
from rich.table import Table

from client.shapes import format_shape

STATUS_STYLE = {
    "queued": "yellow",
    "running": "cyan",
    "succeeded": "green",
    "failed": "red",
    "canceled": "magenta",
}


# C0 controls (tab and newline too: they would break a table row), DEL, C1 controls, and the
# bidirectional embeddings, overrides and isolates that reorder what a terminal shows.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def strip_controls(text: str) -> str:
    """`text` with every control character written out as `\\xNN` / `\\uNNNN` text."""
    return _UNSAFE.sub(_visible, text)


def escape(text: str) -> str:
    """`text` safe to print with rich: control characters written out, markup escaped."""
    return escape_markup(strip_controls(str(text)))


def _num(value: Any, fmt: str = "{:.3g}", missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, (int, float)):
        return fmt.format(value)
    return escape(str(value))


def _bytes(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _when(value: Any) -> str:
    """An ISO timestamp as `YYYY-MM-DD HH:MM:SS` (UTC), or '-'."""
    if not value:
        return "-"
    return escape(str(value).replace("T", " ")[:19])


def _status(status: Any) -> str:
    text = escape(str(status))
    style = STATUS_STYLE.get(str(status))
    return f"[{style}]{text}[/]" if style else text


def _tensors(specs: Sequence[Mapping[str, Any]] | None) -> str:
    return ", ".join(
        f"{escape(str(s.get('name')))} {escape(str(s.get('dtype', '')))}"
        + escape(f"[{', '.join(str(d) for d in s.get('shape') or [])}]")
        for s in specs or []
    )


def models_table(models: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="models", title_justify="left")
    for col in ("id", "name", "inputs", "outputs", "opset", "size", "created"):
        table.add_column(col, overflow="fold", no_wrap=col in ("id", "size"))
    for m in models:
        table.add_row(
            escape(str(m.get("id"))),
            escape(str(m.get("name"))),
            _tensors(m.get("inputs")),
            _tensors(m.get("outputs")),
            _num(m.get("opset"), "{}"),
            _bytes(m.get("size_bytes")),
            _when(m.get("created_at")),
        )
    return table


def jobs_table(jobs: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="jobs", title_justify="left")
    for col in ("id", "model", "status", "stage", "progress", "speedup", "kernels", "created"):
        table.add_column(col, overflow="fold", no_wrap=col in ("id", "status", "kernels"))
    for j in jobs:
        summary = j.get("summary") or {}
        kernels = "-"
        if summary.get("kernels_before") is not None:
            kernels = (
                f"{_num(summary.get('kernels_before'), '{}')} → {_num(summary.get('kernels_after'), '{}')}"
            )
        table.add_row(
            escape(str(j.get("id"))),
            escape(str(j.get("model_id"))[:8]) + "…",
            _status(j.get("status")),
            escape(str(j.get("stage") or "-")),
            f"{100 * float(j.get('progress') or 0):.0f}%",
            _num(summary.get("speedup"), "{:.2f}x"),
            kernels,
            _when(j.get("created_at")),
        )
    return table


def _past(value: Any) -> bool:
    try:
        return bool(value) and datetime.fromisoformat(str(value)) <= datetime.now(UTC)
    except ValueError:
        return False


def keys_table(keys: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="API keys", title_justify="left")
    for col in ("id", "prefix", "tenant", "scope", "created", "last used", "expires", "state"):
        table.add_column(col, overflow="fold", no_wrap=col in ("id", "prefix"))
    for k in keys:
        state = "[red]revoked[/]" if k.get("revoked") else "[green]live[/]"
        if not k.get("revoked") and _past(k.get("expires_at")):
            state = "[yellow]expired[/]"
        table.add_row(
            _num(k.get("id"), "{}"),
            escape(str(k.get("prefix") or "-")) + "…",
            escape(str(k.get("tenant"))),
            escape(str(k.get("scope"))),
            _when(k.get("created_at")),
            _when(k.get("last_used_at")),
            _when(k.get("expires_at")) if k.get("expires_at") else "never",
            state,
        )
    return table


def job_table(job: Mapping[str, Any]) -> Table:
    table = Table(show_header=False, title=f"job {escape(str(job.get('id')))}", title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("status", _status(job.get("status")))
    table.add_row("model", escape(str(job.get("model_id"))))
    table.add_row("stage", escape(str(job.get("stage") or "-")))
    table.add_row("progress", f"{100 * float(job.get('progress') or 0):.0f}%")
    table.add_row("attempts", _num(job.get("attempts"), "{}"))
    for key in ("created_at", "started_at", "finished_at"):
        table.add_row(key.replace("_at", ""), _when(job.get(key)))
    summary = job.get("summary") or {}
    if summary.get("kernels_before") is not None:
        table.add_row(
            "kernels",
            f"{_num(summary.get('kernels_before'), '{}')} → {_num(summary.get('kernels_after'), '{}')}",
        )
    if summary.get("latency_ms_after") is not None:
        table.add_row(
            "latency p50",
            f"{_num(summary.get('latency_ms_before'))} ms → {_num(summary.get('latency_ms_after'))} ms",
        )
        table.add_row("speedup", _num(summary.get("speedup"), "{:.2f}x"))
    if summary.get("peak_memory_after") is not None:
        table.add_row(
            "peak memory",
            f"{_bytes(summary.get('peak_memory_before'))} → {_bytes(summary.get('peak_memory_after'))}",
        )
    if job.get("error"):
        table.add_row("error", f"[red]{escape(str(job['error']))}[/]")
    return table


def report_summary_table(report: Mapping[str, Any]) -> Table:
    device = report.get("device") or {}
    kernels = report.get("kernels") or {}
    before, after = report.get("before") or {}, report.get("after") or {}
    verification = report.get("verification") or {}
    table = Table(show_header=False, title="summary", title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("device", escape(f"{device.get('kind', '-')} {device.get('name') or ''}".strip()))
    table.add_row("precision", escape(str(report.get("precision", "-"))))
    table.add_row("kernels", f"{_num(kernels.get('before'), '{}')} → {_num(kernels.get('after'), '{}')}")
    if before.get("latency_ms") or after.get("latency_ms"):
        p50b = (before.get("latency_ms") or {}).get("p50")
        p50a = (after.get("latency_ms") or {}).get("p50")
        table.add_row("latency p50", f"{_num(p50b)} ms → {_num(p50a)} ms")
        table.add_row("speedup", _num(report.get("speedup"), "{:.2f}x"))
        table.add_row(
            "peak memory",
            f"{_bytes(before.get('peak_memory_bytes'))} → {_bytes(after.get('peak_memory_bytes'))}",
        )
    if device.get("kind") == "cpu-interpreter":
        table.add_row("note", "ran in the Triton interpreter on CPU: latencies are not a speed claim")
    passed = verification.get("passed")
    if passed is not None:
        table.add_row("verification", "[green]passed[/]" if passed else "[red]FAILED[/]")
    return table


def fusion_groups_table(report: Mapping[str, Any]) -> Table:
    table = Table(title="fusion groups", title_justify="left")
    for col in ("id", "kind", "rule", "nodes", "kernel", "saved", "ms before → after"):
        table.add_column(col, overflow="fold", no_wrap=col in ("id", "kernel"))
    for g in (report.get("fusion") or {}).get("groups") or []:
        nodes = [str(n) for n in g.get("nodes") or []]
        shown = ", ".join(nodes[:6]) + (f", … (+{len(nodes) - 6})" if len(nodes) > 6 else "")
        table.add_row(
            escape(str(g.get("id"))),
            escape(str(g.get("kind", "-"))),
            escape(str(g.get("rule", "-"))),
            escape(shown),
            escape(str(g.get("kernel", "-"))),
            _bytes(g.get("bytes_saved_est")),
            f"{_num(g.get('time_ms_before'))} → {_num(g.get('time_ms_after'))}",
        )
    return table


def not_fused_table(report: Mapping[str, Any]) -> Table:
    table = Table(title="not fused", title_justify="left")
    for col in ("rule", "nodes", "reason"):
        table.add_column(col, overflow="fold")
    for item in (report.get("fusion") or {}).get("not_fused") or []:
        table.add_row(
            escape(str(item.get("rule", "-"))),
            escape(", ".join(str(n) for n in item.get("nodes") or [])),
            escape(str(item.get("reason", ""))),
        )
    return table


def verification_table(report: Mapping[str, Any]) -> Table:
    verification = report.get("verification") or {}
    title = f"verification (reference: {escape(str(verification.get('reference', '-')))})"
    table = Table(title=title, title_justify="left")
    for col in ("output", "max abs err", "rel L2 err", "rtol", "atol"):
        table.add_column(col)
    for name, o in (verification.get("outputs") or {}).items():
        table.add_row(
            escape(str(name)),
            _num(o.get("max_abs_err")),
            _num(o.get("rel_l2_err")),
            _num(o.get("rtol")),
            _num(o.get("atol")),
        )
    rolled_back = verification.get("rolled_back") or []
    if rolled_back:
        table.caption = f"rolled back (kept unfused): {escape(', '.join(str(g) for g in rolled_back))}"
    return table


def print_report(console: Console, report: Mapping[str, Any], *, full: bool = True) -> None:
    console.print(report_summary_table(report))
    console.print(fusion_groups_table(report))
    if full and (report.get("fusion") or {}).get("not_fused"):
        console.print(not_fused_table(report))
    if full:
        console.print(verification_table(report))


def outputs_table(outputs: Mapping[str, Any]) -> Table:
    table = Table(title="outputs", title_justify="left")
    for col in ("name", "dtype", "shape"):
        table.add_column(col)
    for name, value in outputs.items():
        table.add_row(
            escape(name), escape(str(getattr(value, "dtype", "-"))), format_shape(getattr(value, "shape", ()))
        )
    return table
