"""How the CLI shows models, jobs and reports to people: rich tables. (`--json` bypasses all of this.)

Every string that comes from a model, a report or the server goes through `escape`: rich markup is
escaped and control characters (C0, DEL, C1, so terminal escape sequences; bidirectional overrides)
are shown as `\\x1b`-style text, so a node name cannot retitle or recolour the user's terminal.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rich.console import Console, JustifyMethod
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


def fmt_num(value: Any, fmt: str = "{:.3g}", missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, (int, float)):
        return fmt.format(value)
    return escape(str(value))


def fmt_bytes(value: Any) -> str:
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


def fmt_status(status: Any) -> str:
    text = escape(str(status))
    style = STATUS_STYLE.get(str(status))
    return f"[{style}]{text}[/]" if style else text


def _tensors(specs: Sequence[Mapping[str, Any]] | None) -> str:
    return ", ".join(
        # A dynamic dim is its symbol: `[batch, 512]` is text here, never rich markup.
        f"{escape(str(s.get('name')))} {escape(str(s.get('dtype', '')))} "
        + escape(f"[{', '.join(str(d) for d in s.get('shape') or [])}]")
        for s in specs or []
    )


@dataclass(frozen=True)
class Column:
    """A table column: its header, and whether its cells may wrap (ids and counts do not)."""

    name: str
    no_wrap: bool = False
    justify: JustifyMethod = "left"


def listing(
    title: str, columns: Sequence[str | Column], rows: Iterable[Sequence[str]], caption: str | None = None
) -> Table:
    """The shape every listing has (keys, jobs, models, profiles): a titled table, one row per item.

    Cells are rich markup: escape what comes from a model or the server first."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for col in columns:
        c = col if isinstance(col, Column) else Column(col)
        table.add_column(c.name, overflow="fold", no_wrap=c.no_wrap, justify=c.justify)
    for row in rows:
        table.add_row(*row)
    return table


def fields(title: str, rows: Iterable[tuple[str, str]]) -> Table:
    """A two-column table of one thing's fields (a job, a report's summary)."""
    table = Table(show_header=False, title=title, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for name, value in rows:
        table.add_row(name, value)
    return table


def models_table(models: Sequence[Mapping[str, Any]]) -> Table:
    columns: list[str | Column] = [
        Column("id", no_wrap=True),
        "name",
        "inputs",
        "outputs",
        "opset",
        Column("size", no_wrap=True),
    ]
    rows = (
        [
            escape(str(m.get("id"))),
            escape(str(m.get("name"))),
            _tensors(m.get("inputs")),
            _tensors(m.get("outputs")),
            fmt_num(m.get("opset"), "{}"),
            fmt_bytes(m.get("size_bytes")),
            _when(m.get("created_at")),
        ]
        for m in models
    )
    return listing("models", [*columns, "created"], rows)


def _kernels(summary: Mapping[str, Any]) -> str:
    if summary.get("kernels_before") is None:
        return "-"
    return f"{fmt_num(summary.get('kernels_before'), '{}')} → {fmt_num(summary.get('kernels_after'), '{}')}"


def jobs_table(jobs: Sequence[Mapping[str, Any]], model_names: Mapping[str, str] | None = None) -> Table:
    """Jobs, one a row; the model by its name where `model_names` knows it, else by its id."""
    names = model_names or {}
    columns: list[str | Column] = [
        Column("id", no_wrap=True),
        "model",
        Column("status", no_wrap=True),
        "stage",
        "progress",
        Column("speedup", justify="right"),
        Column("kernels", no_wrap=True),
        "created",
    ]
    rows = (
        [
            escape(str(j.get("id"))),
            escape(names.get(str(j.get("model_id")), str(j.get("model_id")))),
            fmt_status(j.get("status")),
            escape(str(j.get("stage") or "-")),
            f"{100 * float(j.get('progress') or 0):.0f}%",
            fmt_num((j.get("summary") or {}).get("speedup"), "{:.2f}x"),
            _kernels(j.get("summary") or {}),
            _when(j.get("created_at")),
        ]
        for j in jobs
    )
    return listing("jobs", columns, rows)


def _past(value: Any) -> bool:
    try:
        return bool(value) and datetime.fromisoformat(str(value)) <= datetime.now(UTC)
    except ValueError:
        return False


def _key_state(k: Mapping[str, Any]) -> str:
    if k.get("revoked"):
        return "[red]revoked[/]"
    return "[yellow]expired[/]" if _past(k.get("expires_at")) else "[green]live[/]"


def keys_table(keys: Sequence[Mapping[str, Any]]) -> Table:
    columns: list[str | Column] = [
        Column("id", no_wrap=True),
        Column("prefix", no_wrap=True),
        "tenant",
        "scope",
    ]
    rows = (
        [
            fmt_num(k.get("id"), "{}"),
            escape(str(k.get("prefix") or "-")) + "…",
            escape(str(k.get("tenant"))),
            escape(str(k.get("scope"))),
            _when(k.get("created_at")),
            _when(k.get("last_used_at")),
            _when(k.get("expires_at")) if k.get("expires_at") else "never",
            _key_state(k),
        ]
        for k in keys
    )
    return listing("API keys", [*columns, "created", "last used", "expires", "state"], rows)


def job_table(job: Mapping[str, Any], model_name: str | None = None) -> Table:
    summary = job.get("summary") or {}
    model = escape(str(job.get("model_id")))
    rows = [
        ("status", fmt_status(job.get("status"))),
        ("model", f"{escape(model_name)} ({model})" if model_name else model),
        ("stage", escape(str(job.get("stage") or "-"))),
        ("progress", f"{100 * float(job.get('progress') or 0):.0f}%"),
        ("attempts", fmt_num(job.get("attempts"), "{}")),
    ]
    rows += [
        (key.replace("_at", ""), _when(job.get(key))) for key in ("created_at", "started_at", "finished_at")
    ]
    if summary.get("kernels_before") is not None:
        rows.append(("kernels", _kernels(summary)))
    if summary.get("latency_ms_after") is not None:
        before, after = fmt_num(summary.get("latency_ms_before")), fmt_num(summary.get("latency_ms_after"))
        rows.append(("latency p50", f"{before} ms → {after} ms"))
        rows.append(("speedup", fmt_num(summary.get("speedup"), "{:.2f}x")))
    if summary.get("peak_memory_after") is not None:
        memory = (
            f"{fmt_bytes(summary.get('peak_memory_before'))} → {fmt_bytes(summary.get('peak_memory_after'))}"
        )
        rows.append(("peak memory", memory))
    if job.get("error"):
        rows.append(("error", f"[red]{escape(str(job['error']))}[/]"))
    return fields(f"job {escape(str(job.get('id')))}", rows)


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
    table.add_row(
        "kernels", f"{fmt_num(kernels.get('before'), '{}')} → {fmt_num(kernels.get('after'), '{}')}"
    )
    if before.get("latency_ms") or after.get("latency_ms"):
        p50b = (before.get("latency_ms") or {}).get("p50")
        p50a = (after.get("latency_ms") or {}).get("p50")
        table.add_row("latency p50", f"{fmt_num(p50b)} ms → {fmt_num(p50a)} ms")
        table.add_row("speedup", fmt_num(report.get("speedup"), "{:.2f}x"))
        table.add_row(
            "peak memory",
            f"{fmt_bytes(before.get('peak_memory_bytes'))} → {fmt_bytes(after.get('peak_memory_bytes'))}",
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
            fmt_bytes(g.get("bytes_saved_est")),
            f"{fmt_num(g.get('time_ms_before'))} → {fmt_num(g.get('time_ms_after'))}",
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
            fmt_num(o.get("max_abs_err")),
            fmt_num(o.get("rel_l2_err")),
            fmt_num(o.get("rtol")),
            fmt_num(o.get("atol")),
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
