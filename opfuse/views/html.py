"""The report as one self-contained HTML page: inline CSS, charts drawn here as inline SVG, one small
inline script (table sorting) allowed by its hash. Nothing is fetched when the page is viewed.

Standard library only. Every string that comes from the report (node names, op types, reasons,
kernel sources) is escaped with html.escape; a field the report lacks reads "not measured".
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opfuse.views.roofline import Roofs, roofline_section, roofs_for
from opfuse.views.values import (
    NOT_MEASURED,
    _bytes,
    _count,
    _dicts,
    _e,
    _get,
    _ms,
    _nm,
    _node_names,
    _nodes_html,
    _num,
    _plain,
    _short,
    _sig,
)

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "SCRIPT_HASH",
    "Roofs",
    "kernel_sources_from_zip",
    "render_html",
    "roofs_for",
]

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
        roofline_section(report),
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
