"""The report as one self-contained HTML page: inline CSS, charts drawn here as inline SVG, one small
inline script (table sorting) allowed by its hash. Nothing is fetched when the page is viewed.

Standard library only. Every string that comes from the report (node names, op types, reasons,
kernel sources) is escaped with html.escape; a field the report lacks reads "not measured".
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "SCRIPT_HASH",
    "Roofs",
    "kernel_sources_from_zip",
    "render_html",
    "roofs_for",
]

NOT_MEASURED = "not measured"

# Clicking a column header sorts the table by it (numbers by data-v, else by text).
_SCRIPT = """
document.querySelectorAll("table.sortable th").forEach(function (th, col) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0];
    var down = th.getAttribute("data-dir") !== "desc";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("data-dir"); });
    th.setAttribute("data-dir", down ? "desc" : "asc");
    var idx = Array.prototype.indexOf.call(th.parentNode.children, th);
    var key = function (tr) {
      var td = tr.children[idx];
      var v = td ? td.getAttribute("data-v") : null;
      return v !== null ? parseFloat(v) : (td ? td.textContent : "");
    };
    Array.prototype.slice.call(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b);
      var c = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
      return down ? -c : c;
    }).forEach(function (tr) { body.appendChild(tr); });
  });
});
"""
SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; "
    f"script-src 'sha256-{SCRIPT_HASH}'; img-src data:; base-uri 'none'; form-action 'none'"
)

_CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#d9dde5; --bg:#ffffff; --panel:#f6f7f9;
        --before:#9aa3b2; --after:#2f6fdf; --good:#1a7f37; --bad:#c62828; --warn:#9a6700; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: var(--fg); background: var(--bg); }
main { max-width: 1180px; margin: 0 auto; padding: 20px 24px 60px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 32px 0 10px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 14px; margin: 16px 0 6px; }
.sub { color: var(--muted); margin: 0 0 14px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 10px; }
.card { background: var(--panel); border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
.card .v { font-size: 18px; font-weight: 600; margin-top: 2px; overflow-wrap: anywhere; }
.card .d { color: var(--muted); font-size: 12px; overflow-wrap: anywhere; }
.card.hero .v { font-size: 30px; }
.nm { color: var(--muted); font-style: italic; font-weight: 400; }
.card .v .nm { font-size: 15px; }
.pass { color: var(--good); } .fail { color: var(--bad); }
.note { background: #fff8e1; border: 1px solid #f0d98c; border-radius: 6px; padding: 8px 10px; margin: 10px 0; }
table { border-collapse: collapse; width: 100%; margin: 6px 0 12px; font-size: 13px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--panel); font-weight: 600; white-space: nowrap; }
table.sortable th { cursor: pointer; user-select: none; }
table.sortable th[data-dir="desc"]::after { content: " \\25BE"; }
table.sortable th[data-dir="asc"]::after { content: " \\25B4"; }
td.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code, pre { font: 12px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
pre { background: #0f1420; color: #e6e9ef; padding: 10px 12px; border-radius: 6px; overflow: auto;
      max-height: 520px; white-space: pre; }
details { border: 1px solid var(--line); border-radius: 6px; margin: 6px 0; background: var(--bg); }
details > summary { cursor: pointer; padding: 6px 10px; background: var(--panel); border-radius: 6px; }
details[open] > summary { border-bottom: 1px solid var(--line); border-radius: 6px 6px 0 0; }
details > .body { padding: 6px 12px 10px; }
.tag { display: inline-block; padding: 0 6px; border-radius: 10px; background: #e8eefc; color: #1f4fb0;
       font-size: 12px; margin-right: 4px; }
.nodes code { display: inline-block; background: var(--panel); border: 1px solid var(--line); border-radius: 4px;
              padding: 0 4px; margin: 1px 2px; overflow-wrap: anywhere; }
svg { display: block; max-width: 100%; height: auto; }
svg text { font: 11px system-ui, sans-serif; fill: var(--fg); }
.legend span { display: inline-block; margin-right: 14px; color: var(--muted); }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: -1px; }
footer { margin-top: 40px; color: var(--muted); font-size: 12px; }
"""


# -- values ----------------------------------------------------------------------------------------


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _num(value: Any) -> float | None:
    """A finite number, else None (missing, null, NaN, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _nm() -> str:
    return f'<span class="nm">{NOT_MEASURED}</span>'


def _sig(value: float, digits: int = 3) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits + 2) or abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"


def _ms(value: Any) -> str:
    v = _num(value)
    return _nm() if v is None else f"{_sig(v)} ms"


def _bytes(value: Any) -> str:
    v = _num(value)
    if v is None:
        return _nm()
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(v) >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f} B"


def _plain(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return _nm()
    if isinstance(value, float):
        return _sig(value)
    return _e(value)


def _list(values: Any) -> list[Any]:
    return list(values) if isinstance(values, list | tuple) else []


def _dicts(values: Any) -> list[Mapping[str, Any]]:
    return [v for v in _list(values) if isinstance(v, Mapping)]


def _node_names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in _list(value)]


def _nodes_html(nodes: Sequence[str], limit: int = 200) -> str:
    shown = "".join(f"<code>{_e(n)}</code>" for n in nodes[:limit])
    more = f" … and {len(nodes) - limit} more" if len(nodes) > limit else ""
    return f'<span class="nodes">{shown}{more}</span>'


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- roofs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Roofs:
    """The roofline's two roofs: memory bandwidth and peak compute at one precision."""

    label: str
    bandwidth_bytes_per_s: float
    peak_flops: float
    source: str

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.bandwidth_bytes_per_s


# Datasheet dense figures (TFLOP/s without sparsity; fp32 on the FMA units), TB/s of HBM/GDDR.
_KNOWN_DEVICES: tuple[tuple[str, str, float, Mapping[str, float]], ...] = (
    ("h200", "NVIDIA H200", 4.8, {"fp16": 989.0, "bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("h100", "NVIDIA H100 SXM", 3.35, {"fp16": 989.0, "bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("a100", "NVIDIA A100 SXM", 2.039, {"fp16": 312.0, "bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("l40s", "NVIDIA L40S", 0.864, {"fp16": 362.0, "bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
)
_GENERIC = ("generic GPU (assumed)", 1.0, {"fp16": 100.0, "bf16": 100.0, "tf32": 50.0, "fp32": 20.0})


def roofs_for(report: Mapping[str, Any]) -> Roofs:
    """The roofs the page draws: the report's own when it read them from the GPU's properties, else
    the table's entry for the device's name, else the report's datasheet defaults, else a generic GPU."""
    precision = str(report.get("precision") or "fp32")
    own = _get(report, "profile", "roofline")
    own_bw, own_peak = _num(_get(own, "bandwidth_tb_per_s")), _num(_get(own, "peak_tflops"))
    own_ok = own_bw is not None and own_peak is not None and own_bw > 0 and own_peak > 0
    source = str(_get(own, "source") or "")
    if own_ok and source.startswith("torch.cuda") and own_bw is not None and own_peak is not None:
        label = f"{_get(own, 'device') or 'this GPU'}, {precision}"
        return Roofs(label, own_bw * 1e12, own_peak * 1e12, "the report, read from the GPU's properties")
    name = str(_get(report, "device", "name") or "").lower()
    for key, label, tb, peaks in _KNOWN_DEVICES:
        if key in name:
            peak = peaks.get(precision, peaks["fp32"])
            return Roofs(f"{label}, {precision}", tb * 1e12, peak * 1e12, "opfuse's table of known devices")
    if own_ok and own_bw is not None and own_peak is not None:
        label = f"{_get(own, 'device') or 'defaults'}, {precision}"
        return Roofs(label, own_bw * 1e12, own_peak * 1e12, "the report's stand-in figures (no GPU named)")
    glabel, gtb, gpeaks = _GENERIC
    peak = gpeaks.get(precision, gpeaks["fp32"])
    return Roofs(f"{glabel}, {precision}", gtb * 1e12, peak * 1e12, "a generic fallback (device not known)")


# -- sections --------------------------------------------------------------------------------------


def _card(key: str, value: str, detail: str = "", hero: bool = False) -> str:
    cls = "card hero" if hero else "card"
    d = f'<div class="d">{detail}</div>' if detail else ""
    return f'<div class="{cls}"><div class="k">{_e(key)}</div><div class="v">{value}</div>{d}</div>'


def _pair(before: str, after: str) -> str:
    return f"{before} → {after}"


def _verdict(report: Mapping[str, Any]) -> str:
    speedup = _num(report.get("speedup"))
    before, after = report.get("before"), report.get("after")
    cards = []
    if speedup is None:
        cards.append(_card("speedup", _nm(), "run a benchmark on a GPU to measure it", hero=True))
    else:
        cls = "pass" if speedup >= 1 else "fail"
        cards.append(
            _card("speedup", f'<span class="{cls}">{speedup:.2f}×</span>', "p50 before / after", True)
        )
    for pct in ("p50", "p99"):
        cards.append(
            _card(
                f"latency {pct}",
                _pair(_ms(_get(before, "latency_ms", pct)), _ms(_get(after, "latency_ms", pct))),
                "before → after",
            )
        )
    launches = _pair(_plain(_get(report, "kernels", "before")), _plain(_get(report, "kernels", "after")))
    counted = [_get(side, "kernel_launches_measured") for side in (before, after)]
    detail = "per inference, from the plans"
    if any(c is not None for c in counted):
        detail += f"; measured: {_pair(_plain(counted[0]), _plain(counted[1]))}"
    cards.append(_card("kernel launches", launches, detail))
    cards.append(
        _card(
            "peak memory",
            _pair(_bytes(_get(before, "peak_memory_bytes")), _bytes(_get(after, "peak_memory_bytes"))),
            "before → after",
        )
    )
    util = [_num(_get(side, "gpu_util_pct")) for side in (before, after)]
    cards.append(
        _card(
            "GPU utilization",
            _pair(*[_nm() if u is None else f"{u:.0f}%" for u in util]),
            "before → after, sampled while timing",
        )
    )
    device = report.get("device")
    kind, name = _get(device, "kind"), _get(device, "name")
    cap = _get(device, "capability")
    versions = ", ".join(
        f"{k} {_e(v)}" for k in ("torch", "triton") if (v := _get(device, k)) not in (None, "")
    )
    cards.append(
        _card(
            "device",
            _plain(name) if name is not None else _nm(),
            " · ".join(x for x in (_e(kind) if kind else "", f"sm {_e(cap)}" if cap else "", versions) if x),
        )
    )
    cards.append(_card("precision", _plain(report.get("precision"))))
    ver = report.get("verification")
    passed = _get(ver, "passed")
    if passed is None:
        vtext = _nm()
    else:
        vtext = '<span class="pass">passed</span>' if passed else '<span class="fail">failed</span>'
    basis = _get(ver, "basis")
    vdetail = " · ".join(
        x
        for x in (
            f"against {_e(_get(ver, 'reference'))}" if _get(ver, "reference") else "",
            f"basis {_e(basis)}" if basis else "",
            f"{_e(_get(ver, 'trials'))} trials" if _get(ver, "trials") is not None else "",
        )
        if x
    )
    cards.append(_card("verification", vtext, vdetail))
    coverage = _get(report, "fusion", "coverage")
    share = _num(_get(coverage, "share"))
    if share is not None:
        cards.append(
            _card(
                "fused coverage",
                f"{share * 100:.0f}%",
                f"{_plain(_get(coverage, 'fused'))} of {_plain(_get(coverage, 'compute_nodes'))} compute nodes",
            )
        )
    notes = []
    if kind == "cpu-interpreter":
        notes.append(
            "These kernels ran in Triton's interpreter on the CPU: times are interpreter wall time, "
            "not a speed claim. Compile on a GPU for real numbers."
        )
    if _get(ver, "note"):
        notes.append(f"Verification: {_e(_get(ver, 'note'))}")
    rolled = _node_names(_get(ver, "rolled_back"))
    if rolled:
        notes.append(f"Rolled back (ran unfused after failing verification): {_nodes_html(rolled)}")
    note_html = "".join(f'<div class="note">{n}</div>' for n in notes)
    return f'<section id="verdict"><div class="cards">{"".join(cards)}</div>{note_html}</section>'


@dataclass
class _TimeRow:
    label: str
    detail: str
    before: float | None
    after: float | None

    @property
    def largest(self) -> float:
        return max(self.before or 0.0, self.after or 0.0)


def _time_rows(report: Mapping[str, Any]) -> list[_TimeRow]:
    groups = _dicts(_get(report, "fusion", "groups"))
    ops = _dicts(_get(report, "profile", "ops"))
    after_ops = _dicts(_get(report, "profile", "after"))
    rows: list[_TimeRow] = []
    grouped: set[str] = set()
    for g in groups:
        nodes = _node_names(g.get("nodes"))
        grouped.update(nodes)
        label = f"{g.get('id', '?')} {g.get('kind') or ''} ({_count(len(nodes), 'node')})"
        detail = f"{g.get('rule') or ''}: " + ", ".join(nodes)
        rows.append(_TimeRow(label, detail, _num(g.get("time_ms_before")), _num(g.get("time_ms_after"))))
    after_by_node = {str(a.get("node")): _num(a.get("time_ms")) for a in after_ops}
    for op in ops:
        node = str(op.get("node"))
        if node in grouped:
            continue
        rows.append(
            _TimeRow(
                f"{node} ({op.get('op_type') or '?'})",
                f"unfused {op.get('op_type') or ''}: {node}",
                _num(op.get("time_ms")),
                after_by_node.get(node),
            )
        )
    rows.sort(key=lambda r: -r.largest)
    return rows


def _time_chart(rows: list[_TimeRow], limit: int = 30) -> str:
    shown, rest = rows[:limit], rows[limit:]
    if rest:
        before = sum(r.before or 0.0 for r in rest)
        after = sum(r.after or 0.0 for r in rest)
        shown = [*shown, _TimeRow(f"{len(rest)} more", "the smaller rows, summed", before, after)]
    top = max((r.largest for r in shown), default=0.0) or 1.0
    label_w, bar_w, row_h, bar_h = 300, 560, 34, 12
    width = label_w + bar_w + 110
    height = 24 + row_h * len(shown)
    parts = [
        f'<svg id="time-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="time before and after, largest first">'
    ]
    parts.append(
        f'<text x="{label_w}" y="14" fill="#5b6475">0</text>'
        f'<text x="{label_w + bar_w}" y="14" text-anchor="end" fill="#5b6475">{_e(_sig(top))} ms</text>'
    )
    for i, r in enumerate(shown):
        y = 24 + i * row_h
        parts.append(f"<g><title>{_e(r.detail)}</title>")
        parts.append(f'<text x="{label_w - 8}" y="{y + 16}" text-anchor="end">{_e(_short(r.label))}</text>')
        for j, (value, color) in enumerate(((r.before, "#9aa3b2"), (r.after, "#2f6fdf"))):
            by = y + 2 + j * (bar_h + 2)
            if value is None:
                parts.append(
                    f'<text x="{label_w + 4}" y="{by + 10}" fill="#5b6475" font-style="italic">'
                    f"{NOT_MEASURED}</text>"
                )
                continue
            w = max(1.0, bar_w * value / top)
            parts.append(
                f'<rect x="{label_w}" y="{by}" width="{w:.1f}" height="{bar_h}" fill="{color}" rx="2"/>'
                f'<text x="{label_w + w + 4:.1f}" y="{by + 10}">{_e(_sig(value))} ms</text>'
            )
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _time_section(report: Mapping[str, Any]) -> str:
    rows = _time_rows(report)
    head = '<h2 id="time">Where the time went</h2>'
    if not rows or all(r.before is None and r.after is None for r in rows):
        return f"{head}<p>{_nm()}: the report has no per-op or per-group times.</p>"
    before = [r.before for r in rows if r.before is not None]
    after = [r.after for r in rows if r.after is not None]
    timing = _get(report, "profile", "timing")
    sub = (
        f"Each fused group's time before (its ONNX ops one by one, grey) against after (its one kernel, "
        f"blue); unfused ops appear once each. Largest first. Sum before {_sig(sum(before))} ms, "
        f"after {_sig(sum(after))} ms."
    )
    if timing:
        sub += f" Timing: {_e(timing)}."
    legend = (
        '<div class="legend"><span><i style="background:#9aa3b2"></i>before (per op)</span>'
        '<span><i style="background:#2f6fdf"></i>after (fused)</span></div>'
    )
    return f'{head}<p class="sub">{sub}</p>{legend}{_time_chart(rows)}{_ops_table(report)}'


def _ops_table(report: Mapping[str, Any]) -> str:
    ops = _dicts(_get(report, "profile", "ops"))
    if not ops:
        return ""
    rows = []
    for op in sorted(ops, key=lambda o: -(_num(o.get("time_ms")) or 0.0)):
        cells = [f"<td><code>{_e(op.get('node'))}</code></td>", f"<td>{_e(op.get('op_type') or '')}</td>"]
        for key, fmt in (("time_ms", _ms), ("bytes", _bytes), ("flops", _plain), ("intensity", _plain)):
            v = _num(op.get(key))
            cells.append(f'<td class="n" data-v="{v if v is not None else -1}">{fmt(op.get(key))}</td>')
        cells.append(f"<td>{_plain(op.get('bound'))}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    head = "".join(
        f"<th>{h}</th>" for h in ("node", "op type", "time", "bytes", "FLOPs", "FLOP/byte", "bound")
    )
    return (
        f"<details><summary>Per-op profile before fusion ({len(ops)} ops; click a header to sort)"
        f'</summary><div class="body"><table class="sortable"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div></details>"
    )


def _groups_section(report: Mapping[str, Any], kernel_sources: Mapping[str, str]) -> str:
    groups = _dicts(_get(report, "fusion", "groups"))
    head = '<h2 id="groups">Fused groups</h2>'
    if not groups:
        return f"{head}<p>No fused groups: every op runs as its own kernel.</p>"
    items = []
    for g in sorted(groups, key=lambda g: -(_num(g.get("time_ms_before")) or 0.0)):
        nodes = _node_names(g.get("nodes"))
        kernel = g.get("kernel")
        source = kernel_sources.get(str(kernel)) if kernel is not None else None
        tags = "".join(
            f'<span class="tag">{_e(k)}: {_e(g.get(k))}</span>'
            for k in ("kind", "rule", "variant")
            if g.get(k) not in (None, "")
        )
        facts = (
            f"<table><tr><th>kernel</th><td><code>{_plain(kernel)}</code></td>"
            f"<th>time before</th><td>{_ms(g.get('time_ms_before'))}</td>"
            f"<th>time after</th><td>{_ms(g.get('time_ms_after'))}</td>"
            f"<th>bytes saved (est.)</th><td>{_bytes(g.get('bytes_saved_est'))}</td></tr></table>"
        )
        note = f'<div class="note">{_e(g.get("note"))}</div>' if g.get("note") else ""
        if source is not None:
            src = (
                f"<details><summary>generated kernel source <code>kernels/{_e(kernel)}.py</code> "
                f"({len(source.splitlines())} lines)</summary><pre><code>{_e(source)}</code></pre></details>"
            )
        else:
            src = f'<p class="sub">Kernel source: {_nm()} here (it is in the bundle, kernels/&lt;id&gt;.py).</p>'
        items.append(
            f"<details><summary><b>{_e(g.get('id', '?'))}</b> {tags} {_count(len(nodes), 'ONNX node')} · "
            f"{_ms(g.get('time_ms_before'))} → {_ms(g.get('time_ms_after'))}</summary>"
            f'<div class="body"><h3>ONNX nodes</h3>{_nodes_html(nodes)}{facts}{note}{src}</div></details>'
        )
    coverage = _get(report, "fusion", "coverage")
    sub = f'<p class="sub">{_count(len(groups), "group")}, largest time before first.'
    if _num(_get(coverage, "share")) is not None:
        sub += (
            f" {_plain(_get(coverage, 'fused'))} of {_plain(_get(coverage, 'compute_nodes'))} compute "
            "nodes run inside fused groups."
        )
    return f"{head}{sub}</p>{''.join(items)}"


def _reason_head(reason: str) -> str:
    """The kind of a reason: its text up to the first ':' or '(' (the rest names nodes)."""
    cut = min((i for i in (reason.find(":"), reason.find("(")) if i > 0), default=len(reason))
    return reason[:cut].strip() or reason


def _not_fused_section(report: Mapping[str, Any]) -> str:
    entries = _dicts(_get(report, "fusion", "not_fused"))
    head = '<h2 id="not-fused">Not fused, and why</h2>'
    if not entries:
        return f"{head}<p>Nothing was left unfused.</p>"
    by_reason: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for e in entries:
        key = (str(e.get("rule") or "none"), _reason_head(str(e.get("reason") or "no reason given")))
        by_reason.setdefault(key, []).append(e)
    blocks = []
    for (rule, reason), group in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        count = sum(len(_node_names(e.get("nodes"))) for e in group)
        rows = "".join(
            f"<tr><td>{_nodes_html(_node_names(e.get('nodes')))}</td><td>{_e(e.get('reason') or '')}</td></tr>"
            for e in group
        )
        blocks.append(
            f'<details><summary><b>{_e(reason)}</b> <span class="tag">rule: {_e(rule)}</span> '
            f'{_count(count, "node")}</summary><div class="body"><table><thead><tr><th>nodes</th><th>reason</th>'
            f"</tr></thead><tbody>{rows}</tbody></table></div></details>"
        )
    return f'{head}<p class="sub">{_count(len(entries), "entry", "entries")}, grouped by reason, most common first.</p>{"".join(blocks)}'


@dataclass
class _Point:
    name: str
    op_type: str
    intensity: float
    achieved: float  # FLOP/s
    fused: bool


def _points(report: Mapping[str, Any], key: str) -> tuple[list[_Point], int]:
    points, skipped = [], 0
    for op in _dicts(_get(report, "profile", key)):
        flops, nbytes, t = _num(op.get("flops")), _num(op.get("bytes")), _num(op.get("time_ms"))
        if not flops or not nbytes or not t or flops <= 0 or nbytes <= 0 or t <= 0:
            skipped += 1
            continue
        op_type = str(op.get("op_type") or "")
        points.append(_Point(str(op.get("node")), op_type, flops / nbytes, flops / (t / 1e3), key == "after"))
    return points, skipped


def _log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    step = max(1, (b - a) // 8)
    return [10.0**e for e in range(a, b + 1, step)]


def _si(value: float, unit: str) -> str:
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _roofline_section(report: Mapping[str, Any]) -> str:
    head = '<h2 id="roofline">Roofline</h2>'
    roofs = roofs_for(report)
    after, skipped_after = _points(report, "after")
    before, _ = _points(report, "ops")
    used = (
        f"Roofs: {_e(roofs.label)}: memory {roofs.bandwidth_bytes_per_s / 1e12:g} TB/s, compute "
        f"{roofs.peak_flops / 1e12:g} TFLOP/s, ridge {roofs.ridge:.1f} FLOP/byte; source: {_e(roofs.source)}."
    )
    if not after and not before:
        return f'{head}<p class="sub">{used}</p><p>{_nm()}: the report has no per-kernel bytes, FLOPs and times.</p>'
    pts = after + before
    xs = [p.intensity for p in pts] + [roofs.ridge]
    ys = [p.achieved for p in pts] + [roofs.peak_flops]
    xlo, xhi = 10 ** math.floor(math.log10(min(xs) / 2)), 10 ** math.ceil(math.log10(max(xs) * 4))
    ylo = 10 ** math.floor(math.log10(min(min(ys) / 2, roofs.bandwidth_bytes_per_s * xlo)))
    yhi = 10 ** math.ceil(math.log10(max(ys) * 2))
    w, h, ml, mb, mt, mr = 860, 420, 80, 44, 12, 20
    pw, ph = w - ml - mr, h - mt - mb

    def x(v: float) -> float:
        return ml + pw * (math.log10(v) - math.log10(xlo)) / (math.log10(xhi) - math.log10(xlo))

    def y(v: float) -> float:
        v = min(max(v, ylo), yhi)
        return mt + ph * (1 - (math.log10(v) - math.log10(ylo)) / (math.log10(yhi) - math.log10(ylo)))

    parts = [
        f'<svg id="roofline-chart" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" role="img" aria-label="roofline">',
        f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="#fbfcfd" stroke="#d9dde5"/>',
    ]
    for t in _log_ticks(xlo, xhi):
        parts.append(
            f'<line x1="{x(t):.1f}" y1="{mt}" x2="{x(t):.1f}" y2="{mt + ph}" stroke="#eceef2"/>'
            f'<text x="{x(t):.1f}" y="{mt + ph + 14}" text-anchor="middle">{_e(f"{t:g}")}</text>'
        )
    for t in _log_ticks(ylo, yhi):
        parts.append(
            f'<line x1="{ml}" y1="{y(t):.1f}" x2="{ml + pw}" y2="{y(t):.1f}" stroke="#eceef2"/>'
            f'<text x="{ml - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{_e(_si(t, "FLOP/s"))}</text>'
        )
    parts.append(
        f'<text x="{ml + pw / 2}" y="{h - 6}" text-anchor="middle">arithmetic intensity (FLOP/byte)</text>'
    )
    # The roof: bandwidth × intensity up to the ridge, then flat at the peak.
    x0 = xlo
    ridge = min(max(roofs.ridge, xlo), xhi)
    roof = f"M{x(x0):.1f},{y(roofs.bandwidth_bytes_per_s * x0):.1f} L{x(ridge):.1f},{y(roofs.peak_flops):.1f}"
    roof += f" L{x(xhi):.1f},{y(roofs.peak_flops):.1f}"
    parts.append(f'<path d="{roof}" fill="none" stroke="#c62828" stroke-width="2"/>')
    parts.append(
        f'<text x="{ml + pw - 4}" y="{y(roofs.peak_flops) - 6:.1f}" text-anchor="end" fill="#c62828">'
        f"compute {_e(_si(roofs.peak_flops, 'FLOP/s'))}</text>"
    )
    parts.append(
        f'<text x="{x(x0) + 6:.1f}" y="{y(roofs.bandwidth_bytes_per_s * x0) - 6:.1f}" fill="#c62828">'
        f"memory {roofs.bandwidth_bytes_per_s / 1e12:g} TB/s</text>"
    )
    for p in before:
        parts.append(
            f'<circle cx="{x(p.intensity):.1f}" cy="{y(p.achieved):.1f}" r="4" fill="none" stroke="#9aa3b2">'
            f"<title>before: {_e(p.name)} ({_e(p.op_type)}): {p.intensity:.3g} FLOP/byte, "
            f"{_e(_si(p.achieved, 'FLOP/s'))}</title></circle>"
        )
    for p in after:
        color = "#2f6fdf" if p.op_type == "FusedKernel" else "#e07b00"
        parts.append(
            f'<circle cx="{x(p.intensity):.1f}" cy="{y(p.achieved):.1f}" r="5" fill="{color}" '
            f'fill-opacity="0.8"><title>after: {_e(p.name)} ({_e(p.op_type)}): {p.intensity:.3g} FLOP/byte, '
            f"{_e(_si(p.achieved, 'FLOP/s'))}</title></circle>"
        )
    parts.append("</svg>")
    legend = (
        '<div class="legend"><span><i style="background:#2f6fdf"></i>fused kernel (after)</span>'
        '<span><i style="background:#e07b00"></i>unfused op (after)</span>'
        '<span><i style="border:1px solid #9aa3b2"></i>op before fusion</span>'
        '<span><i style="background:#c62828"></i>roofs</span></div>'
    )
    rows = []
    for p in sorted(after, key=lambda p: -p.achieved):
        roof_here = min(roofs.peak_flops, roofs.bandwidth_bytes_per_s * p.intensity)
        share = 100 * p.achieved / roof_here
        rows.append(
            f"<tr><td><code>{_e(_short(p.name, 90))}</code></td><td>{_e(p.op_type)}</td>"
            f'<td class="n" data-v="{p.intensity}">{p.intensity:.3g}</td>'
            f'<td class="n" data-v="{p.achieved}">{_e(_si(p.achieved, "FLOP/s"))}</td>'
            f'<td class="n" data-v="{share}">{share:.3g}%</td>'
            f"<td>{'memory' if p.intensity < roofs.ridge else 'compute'}</td></tr>"
        )
    table = ""
    if rows:
        table = (
            '<table class="sortable"><thead><tr><th>kernel (after)</th><th>op type</th><th>FLOP/byte</th>'
            "<th>achieved</th><th>of its roof</th><th>bound by</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
        )
    skipped = (
        f" {skipped_after} kernels without bytes, FLOPs or a time are not drawn." if skipped_after else ""
    )
    sub = (
        f'<p class="sub">Each kernel\'s arithmetic intensity (FLOPs over bytes moved) against the FLOP/s it '
        f"achieved. {used}{skipped}</p>"
    )
    return f"{head}{sub}{legend}{''.join(parts)}{table}"


def _verification_section(report: Mapping[str, Any]) -> str:
    head = '<h2 id="verification">Verification per output</h2>'
    outputs = _get(report, "verification", "outputs")
    if not isinstance(outputs, Mapping) or not outputs:
        return f"{head}<p>{_nm()}.</p>"
    rows = []
    for name, o in outputs.items():
        passed = _get(o, "passed")
        mark = (
            _nm()
            if passed is None
            else ('<span class="pass">passed</span>' if passed else '<span class="fail">failed</span>')
        )
        cells = "".join(
            f'<td class="n">{_plain(_num(_get(o, k)) if _get(o, k) is not None else None)}</td>'
            for k in ("max_abs_err", "rel_l2_err", "rtol", "atol")
        )
        # The unfused plan's error is there only where verification fell back to it (basis).
        baseline = _num(_get(o, "baseline_rel_l2_err"))
        cells += f'<td class="n">{"–" if baseline is None else _plain(baseline)}</td>'
        rows.append(f"<tr><td><code>{_e(name)}</code></td><td>{mark}</td>{cells}</tr>")
    hdr = "".join(
        f"<th>{h}</th>"
        for h in ("output", "result", "max abs err", "rel L2 err", "rtol", "atol", "unfused rel L2 err")
    )
    ref = _get(report, "verification", "reference")
    sub = f'<p class="sub">Against {_e(ref)} on random inputs.</p>' if ref else ""
    return f"{head}{sub}<table><thead><tr>{hdr}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _timings_section(report: Mapping[str, Any]) -> str:
    head = '<h2 id="timings">Compile time by stage</h2>'
    timings = report.get("timings_s")
    stages = [(str(k), _num(v)) for k, v in timings.items()] if isinstance(timings, Mapping) else []
    measured = [(k, v) for k, v in stages if v is not None]
    if not measured:
        return f"{head}<p>{_nm()}.</p>"
    total = sum(v for _, v in measured)
    top = max(v for _, v in measured) or 1.0
    label_w, bar_w, row_h = 110, 520, 22
    width, height = label_w + bar_w + 120, 8 + row_h * len(stages)
    parts = [
        f'<svg id="timings-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="compile time by stage">'
    ]
    for i, (k, v) in enumerate(stages):
        y = 4 + i * row_h
        parts.append(f'<text x="{label_w - 8}" y="{y + 13}" text-anchor="end">{_e(_short(k, 16))}</text>')
        if v is None:
            parts.append(f'<text x="{label_w + 4}" y="{y + 13}" font-style="italic">{NOT_MEASURED}</text>')
            continue
        bw = max(1.0, bar_w * v / top)
        parts.append(
            f'<rect x="{label_w}" y="{y + 2}" width="{bw:.1f}" height="14" fill="#6b8fd6" rx="2"/>'
            f'<text x="{label_w + bw + 4:.1f}" y="{y + 13}">{v:.3g} s</text>'
        )
    parts.append("</svg>")
    return f'{head}<p class="sub">Total {total:.3g} s.</p>{"".join(parts)}'


def _other_section(report: Mapping[str, Any]) -> str:
    memory = report.get("memory")
    tuning = report.get("tuning")
    rows = []
    if isinstance(memory, Mapping) and memory:
        for k in ("arena_bytes", "unshared_bytes", "max_live_bytes", "scratch_bytes"):
            if k in memory:
                rows.append(f"<tr><th>memory plan: {_e(k)}</th><td>{_bytes(memory.get(k))}</td></tr>")
    if isinstance(tuning, Mapping) and tuning:
        kernels = tuning.get("kernels")
        if isinstance(kernels, Mapping):
            rows.append(f"<tr><th>tuned kernels</th><td>{len(kernels)}</td></tr>")
        if tuning.get("error"):
            rows.append(f"<tr><th>tuning error</th><td>{_e(tuning.get('error'))}</td></tr>")
        unsafe = _node_names(tuning.get("unsafe_groups"))
        if unsafe:
            rows.append(f"<tr><th>unsafe groups (run unfused)</th><td>{_nodes_html(unsafe)}</td></tr>")
    if not rows:
        return ""
    return f'<h2 id="other">Memory and tuning</h2><table><tbody>{"".join(rows)}</tbody></table>'


# -- the page --------------------------------------------------------------------------------------


def render_html(
    report: Mapping[str, Any], kernel_sources: Mapping[str, str] | None = None, *, title: str | None = None
) -> str:
    """The report as one HTML page (a str). `kernel_sources`: kernel id -> generated source, shown
    under each fused group; without them the page says where the sources are. `title`: e.g. the model's
    name. Never raises on a report with fields missing or of the wrong type."""
    if not isinstance(report, Mapping):
        report = {}
    sources = {str(k): str(v) for k, v in (kernel_sources or {}).items()}
    heading = f"opfuse report: {title}" if title else "opfuse report"
    device = report.get("device")
    sub = " · ".join(
        _e(x)
        for x in (_get(device, "name"), _get(device, "kind"), report.get("precision"))
        if x not in (None, "")
    )
    sections = [
        _verdict(report),
        _time_section(report),
        _groups_section(report, sources),
        _not_fused_section(report),
        _roofline_section(report),
        _verification_section(report),
        _timings_section(report),
        _other_section(report),
    ]
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_e(CONTENT_SECURITY_POLICY)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer">'
        '<link rel="icon" href="data:,">'
        f"<title>{_e(heading)}</title><style>{_CSS}</style></head><body><main>"
        f'<h1>{_e(heading)}</h1><p class="sub">{sub}</p>'
        f"{''.join(sections)}"
        "<footer>Generated by opfuse from the job's report.json; the fields are described in "
        "docs/bundle.md. Charts are drawn into this file: it needs nothing from the network.</footer>"
        f"</main><script>{_SCRIPT}</script></body></html>\n"
    )


def kernel_sources_from_zip(
    archive: zipfile.ZipFile, max_member_bytes: int = 1024 * 1024, max_total_bytes: int = 16 * 1024 * 1024
) -> dict[str, str]:
    """kernels/<id>.py of a bundle as id -> text, for render_html. Members over `max_member_bytes`
    (as the archive declares and as read) and any beyond `max_total_bytes` in all are left out; bytes
    that are not UTF-8 are replaced. The text is shown escaped, never run."""
    out: dict[str, str] = {}
    total = 0
    for info in archive.infolist():
        name = info.filename
        if not (name.startswith("kernels/") and name.endswith(".py")) or name.count("/") != 1:
            continue
        if info.file_size > max_member_bytes or total + info.file_size > max_total_bytes:
            continue
        with archive.open(info) as f:
            data = f.read(max_member_bytes + 1)
        if len(data) > max_member_bytes:
            continue
        total += len(data)
        out[name[len("kernels/") : -len(".py")]] = data.decode("utf-8", "replace")
    return out
