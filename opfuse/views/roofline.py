"""The HTML page's roofline: the device's two roofs (memory bandwidth, peak compute at the job's
precision) and each kernel's arithmetic intensity against the FLOP/s it achieved, drawn as SVG."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opfuse.views.values import (
    _dicts,
    _e,
    _get,
    _nm,
    _num,
    _short,
)

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


def roofline_section(report: Mapping[str, Any]) -> str:
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
