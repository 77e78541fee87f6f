"""The report's views (opfuse.views): the HTML page and the Chrome/Perfetto trace, on real reports of
CPU compiles, on a GPU-like report with every field, on reports with fields missing, and on hostile
names that must come out as text. The page is also opened in headless Chromium (test_views_browser)."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import opfuse
from opfuse.views import CONTENT_SECURITY_POLICY, kernel_sources_from_zip, render_html, render_trace
from opfuse.views.html import roofs_for
from opfuse.views.trace import AFTER_PID, BEFORE_PID
from tests.browser import chromium, console_problems, full_page_screenshot, requested_urls, screenshot_dir
from tests.builders import TEST_DEVICE, conv_bn_relu, residual_mlp

HOSTILE = "<script>alert(1)</script>"


class Page(HTMLParser):
    """The parsed page: its tags, its text, the SVGs' ids, its script bodies."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False if tag == "script" else self._in_script

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)
        else:
            self.text.append(data)

    @property
    def all_text(self) -> str:
        return "".join(self.text)

    def ids(self, tag: str) -> set[str]:
        return {str(a.get("id")) for t, a in self.tags if t == tag and a.get("id")}


def _compile(
    model: Any, shapes: dict[str, list[int]], tmp: Path
) -> tuple[dict[str, Any], dict[str, str], Path]:
    cm = opfuse.compile(model, shapes, device=TEST_DEVICE)
    path = tmp / "bundle.opfuse.zip"
    cm.save(path)
    with zipfile.ZipFile(path) as z:
        report = json.loads(z.read("report.json"))
        sources = kernel_sources_from_zip(z)
    assert sources == {k.id: k.source for k in cm.plan.kernels.values()}
    return report, sources, path


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, str], Path]:
    return _compile(residual_mlp(), {"x": [4, 32]}, tmp_path_factory.mktemp("mlp"))


@pytest.fixture(scope="module")
def conv(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, str], Path]:
    return _compile(conv_bn_relu(), {"x": [2, 4, 8, 8]}, tmp_path_factory.mktemp("conv"))


def gpu_report() -> dict[str, Any]:
    """A report as a GPU compile and benchmark write it, every field of docs/bundle.md set."""

    def side(p50: float, launches: int, peak: int, util: float) -> dict[str, Any]:
        return {
            "latency_ms": {"p50": p50, "p90": p50 * 1.1, "p99": p50 * 1.3, "mean": p50 * 1.05},
            "throughput_per_s": 1000 / p50,
            "peak_memory_bytes": peak,
            "kernel_launches_measured": launches,
            "gpu_util_pct": util,
            "iterations": 200,
            "cuda_graph": launches < 10,
        }

    ops: list[dict[str, Any]] = [
        {"node": "fc1", "op_type": "MatMul", "time_ms": 0.0412, "bytes": 8_400_000, "flops": 2_147_483_648},
        {"node": "fc1_bias", "op_type": "Add", "time_ms": 0.0131, "bytes": 12_582_912, "flops": 2_097_152},
        {"node": "gelu", "op_type": "Gelu", "time_ms": 0.0117, "bytes": 8_388_608, "flops": 16_777_216},
        {"node": "fc2", "op_type": "MatMul", "time_ms": 0.0398, "bytes": 8_400_000, "flops": 2_147_483_648},
        {"node": "softmax", "op_type": "Softmax", "time_ms": 0.0093, "bytes": 8_388_608, "flops": 10_485_760},
    ]
    for op in ops:
        op["intensity"] = round(op["flops"] / op["bytes"], 3)
        op["bound"] = "compute" if op["intensity"] > 206 else "memory"
    after: list[dict[str, Any]] = [
        {"node": "fc1, fc1_bias, gelu", "op_type": "FusedKernel", "time_ms": 0.0433, "bytes": 8_400_000},
        {"node": "fc2", "op_type": "MatMul", "time_ms": 0.0398, "bytes": 8_400_000, "flops": 2_147_483_648},
        {"node": "softmax", "op_type": "Softmax", "time_ms": 0.0093, "bytes": 8_388_608, "flops": 10_485_760},
    ]
    after[0]["flops"] = 2_166_358_016
    for op in after:
        op["intensity"] = round(op["flops"] / op["bytes"], 3)
        op["bound"] = "memory"
    return {
        "device": {
            "kind": "cuda",
            "name": "NVIDIA H200",
            "capability": "9.0",
            "torch": "2.11",
            "triton": "3.6",
        },
        "precision": "fp16",
        "kernels": {"before": 5, "after": 3},
        "compute_nodes": 5,
        "before": side(0.1151, 5, 50_331_648, 61.5),
        "after": side(0.0924, 3, 33_554_432, 78.25),
        "after_stepwise": side(0.0951, 3, 33_554_432, 70.0),
        "speedup": 0.1151 / 0.0924,
        "peers": {},
        "verification": {
            "passed": True,
            "reference": "onnxruntime-cpu",
            "trials": 2,
            "basis": "unfused_precision",
            "note": "fp16 held to the unfused plan's error",
            "outputs": {
                "y": {
                    "max_abs_err": 0.0031,
                    "rel_l2_err": 0.00123,
                    "rtol": 0.02,
                    "atol": 0.001,
                    "passed": True,
                    "baseline_rel_l2_err": 0.00119,
                },
                "probs": {
                    "max_abs_err": 2e-4,
                    "rel_l2_err": 4e-4,
                    "rtol": 0.02,
                    "atol": 1e-3,
                    "passed": True,
                },
            },
            "rolled_back": [],
        },
        "fusion": {
            "groups": [
                {
                    "id": "m0",
                    "kind": "gemm",
                    "rule": "gemm_epilogue",
                    "nodes": ["fc1", "fc1_bias", "gelu"],
                    "kernel": "k0",
                    "variant": "template",
                    "note": "tuned: BLOCK_M=128",
                    "bytes_saved_est": 16_777_216,
                    "time_ms_before": 0.066,
                    "time_ms_after": 0.0433,
                }
            ],
            "not_fused": [
                {
                    "rule": "gemm_epilogue",
                    "nodes": ["fc2"],
                    "reason": "a lone MatMul: nothing to fuse with it",
                },
                {"rule": "none", "nodes": ["softmax"], "reason": "no rule takes Softmax here (axis 0)"},
            ],
            "coverage": {"compute_nodes": 5, "fused": 3, "share": 0.6},
            "passes": {"fired": {"gelu": 1}, "onnx_optimizer": "applied"},
        },
        "profile": {
            "ops": ops,
            "after": after,
            "timing": "cuda events per step",
            "roofline": {
                "device": "NVIDIA H200",
                "source": "torch.cuda device properties",
                "precision": "fp16",
                "peak_tflops": 989.4,
                "bandwidth_tb_per_s": 4.8,
                "ridge_flop_per_byte": 206.1,
            },
        },
        "memory": {
            "arena_bytes": 16_777_216,
            "unshared_bytes": 25_165_824,
            "max_live_bytes": 16_777_216,
            "buffers": 2,
            "scratch_bytes": 0,
        },
        "tuning": {
            "kernels": {"k0": {"config": {"BLOCK_M": 128}, "ms": 0.043, "candidates": 12}},
            "cache_hits": 0,
        },
        "timings_s": {
            "load": 0.41,
            "fuse": 0.02,
            "codegen": 0.01,
            "profile": 1.2,
            "tune": 14.5,
            "verify": 0.9,
            "benchmark": 3.3,
        },
    }


def _checked_page(report: Mapping[str, Any], sources: Mapping[str, str] | None = None, **kw: Any) -> Page:
    text = render_html(report, sources, **kw)
    assert text.startswith("<!DOCTYPE html>")
    page = Page(text)
    # Self-contained: no element loads anything, one script (the one the CSP hash allows).
    for tag, attrs in page.tags:
        for attr in ("src", "href", "action", "data", "srcset", "poster"):
            value = attrs.get(attr)
            assert value is None or value.startswith(("data:", "#")), (tag, attr, value)
    assert [t for t, _ in page.tags].count("script") == 1
    csp = [a for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert len(csp) == 1 and csp[0]["content"] == CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY and "img-src data:" in CONTENT_SECURITY_POLICY
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text)  # only the SVG namespace
    return page


def test_page_of_a_real_mlp_compile(mlp: tuple[dict[str, Any], dict[str, str], Path]) -> None:
    report, sources, _ = mlp
    page = _checked_page(report, sources, title="residual_mlp.onnx")
    text = page.all_text
    assert {"time-chart", "roofline-chart", "timings-chart"} <= page.ids("svg")
    # Verdict: CPU runs have no GPU numbers, and say so.
    assert "not measured" in text and "cpu-interpreter" in text and "not a speed claim" in text
    assert f"{report['kernels']['before']} → {report['kernels']['after']}" in text
    assert "passed" in text and "onnxruntime-cpu" in text
    # Every fused group with each of its nodes, its rule and its kernel's full source.
    for group in report["fusion"]["groups"]:
        assert group["rule"] in text and group["id"] in text
        for node in group["nodes"]:
            assert node in text
        assert sources[group["kernel"]] in text  # unescaped again by the parser: byte for byte
    for entry in report["fusion"]["not_fused"]:
        assert entry["reason"] in text
    for op in report["profile"]["ops"]:
        assert op["node"] in text
    for stage in report["timings_s"]:
        assert stage in text
    for name in report["verification"]["outputs"]:
        assert name in text
    # The roofs are named: the report's stand-in figures, since a CPU names no GPU.
    roof = report["profile"]["roofline"]
    assert (
        f"compute {roof['peak_tflops']:g} TFLOP/s" in text and f"{roof['bandwidth_tb_per_s']:g} TB/s" in text
    )


def test_page_of_a_real_conv_compile(conv: tuple[dict[str, Any], dict[str, str], Path]) -> None:
    report, sources, _ = conv
    page = _checked_page(report, sources)
    text = page.all_text
    assert report["fusion"]["groups"], "conv + BN + relu fuses"
    for group in report["fusion"]["groups"]:
        assert group["kind"] in text and sources[group["kernel"]] in text
    for op in report["profile"]["ops"]:
        assert op["node"] in text and op["op_type"] in text
    # One circle per kernel that moved bytes and did FLOPs, before and after.
    drawn = [a for t, a in page.tags if t == "circle"]
    expected = [
        op
        for key in ("ops", "after")
        for op in report["profile"][key]
        if op.get("flops") and op.get("bytes") and op.get("time_ms")
    ]
    assert len(drawn) == len(expected) > 0


def test_time_chart_pairs_groups_and_ops_largest_first(
    mlp: tuple[dict[str, Any], dict[str, str], Path],
) -> None:
    report, _, _ = mlp
    svg = render_html(report).split('<svg id="time-chart"', 1)[1].split("</svg>", 1)[0]
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', svg)  # one per row (the axis has a fill)
    grouped = {n for g in report["fusion"]["groups"] for n in g["nodes"]}
    unfused = [op for op in report["profile"]["ops"] if op["node"] not in grouped]
    assert len(labels) == len(report["fusion"]["groups"]) + len(unfused)
    after = {a["node"]: a["time_ms"] for a in report["profile"]["after"]}
    rows = [(g["time_ms_before"], g["time_ms_after"]) for g in report["fusion"]["groups"]]
    rows += [(op["time_ms"], after.get(op["node"], 0.0)) for op in unfused]
    largest = sorted((max(r) for r in rows), reverse=True)
    widths = re.findall(r'<g><title>.*?</title>.*?width="([\d.]+)".*?width="([\d.]+)"', svg)
    drawn = [max(float(a), float(b)) for a, b in widths]
    assert drawn == sorted(drawn, reverse=True)
    assert (
        abs(drawn[0] - 560) < 0.2
        and abs(drawn[-1] / drawn[0] - max(largest[-1] / largest[0], 1 / 560)) < 0.01
    )


def test_gpu_report_shows_every_number() -> None:
    report = gpu_report()
    page = _checked_page(report, {"k0": "def launch(x):\n    return x  # k0 & <done>\n"})
    text = page.all_text
    assert "not measured" not in text
    assert "1.25×" in text  # 0.1151 / 0.0924
    for side in ("before", "after"):
        lat = report[side]["latency_ms"]
        assert f"{lat['p50']:.3g} ms" in text and f"{lat['p99']:.3g} ms" in text
        assert f"{report[side]['gpu_util_pct']:.0f}%" in text
    assert "5 → 3" in text and "48.00 MiB → 32.00 MiB" in text
    assert "NVIDIA H200" in text and "sm 9.0" in text and "fp16" in text
    assert "basis unfused_precision" in text and "fp16 held to the unfused plan" in text
    assert "def launch(x):\n    return x  # k0 & <done>\n" in text
    assert "no rule takes Softmax here" in text and "a lone MatMul" in text
    assert "60%" in text and "3 of 5 compute nodes" in text
    assert "NVIDIA H200, fp16: memory 4.8 TB/s, compute 989.4 TFLOP/s" in text
    assert "read from the GPU's properties" in text
    for stage, seconds in report["timings_s"].items():
        assert stage in text and f"{seconds:.3g} s" in text
    table = render_html(report).split('id="verification"', 1)[1].split("</table>", 1)[0]
    for name, out in report["verification"]["outputs"].items():
        row = table.split(f"<tr><td><code>{name}</code></td>", 1)[1].split("</tr>", 1)[0]
        cells = re.findall(r'<td class="n">([^<]*)</td>', row)
        keys = ("max_abs_err", "rel_l2_err", "rtol", "atol", "baseline_rel_l2_err")
        expected = [out.get(k) for k in keys]
        got = [None if c == "–" else float(c) for c in cells]
        assert got == [None if v is None else pytest.approx(v, rel=5e-3) for v in expected]
    # The fused kernel's point: intensity 2166358016 / 8400000 ≈ 258 FLOP/byte, 50 TFLOP/s.
    assert "258" in text and "50 TFLOP/s" in text


@pytest.mark.parametrize(
    ("name", "precision", "label", "tb", "tflops"),
    [
        ("NVIDIA H200", "fp16", "NVIDIA H200", 4.8, 989.0),
        ("NVIDIA H100 80GB HBM3", "bf16", "NVIDIA H100 SXM", 3.35, 989.0),
        ("NVIDIA A100-SXM4-80GB", "tf32", "NVIDIA A100 SXM", 2.039, 156.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", "NVIDIA A100 SXM", 2.039, 19.5),
        ("Some Future GPU", "fp16", "generic GPU (assumed)", 1.0, 100.0),
    ],
)
def test_roofs_come_from_the_table_by_device_name(
    name: str, precision: str, label: str, tb: float, tflops: float
) -> None:
    roofs = roofs_for({"device": {"kind": "cuda", "name": name}, "precision": precision})
    assert roofs.label == f"{label}, {precision}"
    assert roofs.bandwidth_bytes_per_s == pytest.approx(tb * 1e12)
    assert roofs.peak_flops == pytest.approx(tflops * 1e12)
    text = Page(render_html({"device": {"name": name}, "precision": precision})).all_text
    assert f"memory {tb:g} TB/s, compute {tflops:g} TFLOP/s" in text


def _hostile_report() -> dict[str, Any]:
    report = gpu_report()
    evil = [HOSTILE, '"><img src=x onerror=alert(2)>', "</pre></details><b>bold</b>", "a&b<c>"]
    report["device"]["name"] = HOSTILE
    report["precision"] = "<em>fp16</em><iframe>"
    report["fusion"]["groups"][0]["nodes"] = evil
    report["fusion"]["groups"][0]["rule"] = HOSTILE
    report["fusion"]["groups"][0]["id"] = "<u>m0</u>"
    report["fusion"]["groups"][0]["note"] = "<marquee>"
    report["fusion"]["not_fused"] = [{"rule": "<x>", "nodes": evil, "reason": f"because {HOSTILE}: yes"}]
    for op, name in zip(report["profile"]["ops"], evil * 2, strict=False):
        op["node"], op["op_type"] = name, f"<{name}>"
    report["profile"]["after"][1]["node"] = HOSTILE
    report["profile"]["timing"] = HOSTILE
    report["verification"]["outputs"] = {HOSTILE: report["verification"]["outputs"]["y"]}
    report["verification"]["note"] = HOSTILE
    report["verification"]["reference"] = HOSTILE
    report["timings_s"] = {HOSTILE: 1.0}
    report["tuning"]["error"] = HOSTILE
    return report


def test_text_from_the_report_is_escaped_everywhere() -> None:
    report = _hostile_report()
    source = f"# {HOSTILE}\n</code></pre><script>alert(3)</script>\n"
    text = render_html(report, {"k0": source}, title=HOSTILE)
    page = _checked_page(report, {"k0": source}, title=HOSTILE)
    # No element came from the report: the one script is ours, no element has an event handler.
    tags = [t for t, _ in page.tags]
    for tag in ("img", "u", "em", "iframe", "marquee", "x"):
        assert tag not in tags, tag
    assert all(not k.startswith("on") for _, attrs in page.tags for k in attrs)
    assert tags.count("script") == 1 and "alert" not in page.scripts[0]
    assert "<script>alert" not in text and "onerror=alert(2)>" not in text.replace("&quot;", '"')
    # ... and all of it is there as text.
    shown = page.all_text
    for s in (HOSTILE, '"><img src=x onerror=alert(2)>', "</pre></details><b>bold</b>", "a&b<c>", source):
        assert s in shown, s
    trace = render_trace(report)
    assert HOSTILE in json.dumps(trace)  # JSON, not markup: the trace viewer shows it as text


@pytest.mark.parametrize(
    "report",
    [
        {},
        {"device": {"kind": "cpu-interpreter"}},
        {"speedup": None, "before": None, "after": {"latency_ms": None}, "kernels": {"before": 3}},
        {
            "speedup": float("nan"),
            "before": {"latency_ms": {"p50": float("inf")}},
            "timings_s": {"load": None},
        },
        {
            "profile": {"ops": [{"node": "a"}, {"node": "b", "time_ms": "fast"}], "after": None},
            "fusion": None,
        },
        {"fusion": {"groups": [{"nodes": None}, "junk", {"id": 3, "kernel": 7}], "not_fused": [{}]}},
        {"verification": {"outputs": {"y": None}, "passed": None, "rolled_back": "m0"}},
        {
            "profile": {
                "ops": [{"node": "z", "time_ms": 1.0, "bytes": 0, "flops": 10}],
                "roofline": {"peak_tflops": 0},
            }
        },
        {"memory": {"arena_bytes": "x"}, "tuning": {"kernels": [], "unsafe_groups": None}, "precision": 16},
        ["not", "a", "mapping"],
    ],
)
def test_missing_or_odd_fields_read_not_measured(report: Any) -> None:
    page = _checked_page(report)
    assert "not measured" in page.all_text
    trace = render_trace(report)
    json.dumps(trace, allow_nan=False)
    assert all(e["ph"] in ("M", "X") for e in trace["traceEvents"])


def test_trace_of_a_real_compile_lays_each_step_end_to_end(
    mlp: tuple[dict[str, Any], dict[str, str], Path],
) -> None:
    report, _, _ = mlp
    trace = json.loads(json.dumps(render_trace(report), allow_nan=False))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {BEFORE_PID: "before (per-op)", AFTER_PID: "after (fused)"}
    before = [e for e in events if e["ph"] == "X" and e["pid"] == BEFORE_PID]
    after = [e for e in events if e["ph"] == "X" and e["pid"] == AFTER_PID]
    ops = report["profile"]["ops"]
    assert [e["args"]["nodes"] for e in before] == [[op["node"]] for op in ops]
    for e, op in zip(before, ops, strict=True):
        assert e["dur"] == pytest.approx(op["time_ms"] * 1000, rel=1e-12)
        assert e["args"]["op_type"] == op["op_type"]
        assert (e["args"]["bytes"], e["args"]["flops"]) == (op["bytes"], op["flops"])
    assert len(after) == len(report["profile"]["after"])
    for e, step in zip(after, report["profile"]["after"], strict=True):
        assert e["dur"] == pytest.approx(step["time_ms"] * 1000, rel=1e-12)
    groups = {g["id"]: g for g in report["fusion"]["groups"]}
    fused = [e for e in after if e["cat"] == "fused"]
    assert sorted(e["args"]["group"] for e in fused) == sorted(groups)
    for e in fused:
        g = groups[e["args"]["group"]]
        assert e["args"]["nodes"] == g["nodes"] and e["args"]["rule"] == g["rule"]
        assert e["dur"] == pytest.approx(g["time_ms_after"] * 1000, rel=1e-12)
    for lane in (before, after):  # end to end from 0, no gaps, no overlaps
        assert lane[0]["ts"] == 0
        for a, b in itertools.pairwise(lane):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], rel=1e-12)
    assert sum(e["dur"] for e in before) == pytest.approx(1000 * sum(op["time_ms"] for op in ops))


def test_trace_without_a_fused_profile_places_groups_where_they_start() -> None:
    report = gpu_report()
    del report["profile"]["after"]
    after = [e for e in render_trace(report)["traceEvents"] if e["ph"] == "X" and e["pid"] == AFTER_PID]
    assert [e["name"] for e in after] == ["m0 gemm", "fc2 (MatMul)", "softmax (Softmax)"]
    assert [e["dur"] for e in after] == pytest.approx([43.3, 39.8, 9.3])
    assert after[0]["args"]["nodes"] == ["fc1", "fc1_bias", "gelu"]


def test_bundle_holds_the_page(mlp: tuple[dict[str, Any], dict[str, str], Path]) -> None:
    report, sources, path = mlp
    with zipfile.ZipFile(path) as z:
        page_text = z.read("report.html").decode()
        title = (json.loads(z.read("manifest.json")).get("source") or {}).get("name")
    assert page_text == render_html(report, sources, title=str(title) if title else None)
    shown = Page(page_text).all_text
    for source in sources.values():
        assert source in shown


def test_kernel_sources_from_zip_leave_out_what_is_too_large(tmp_path: Path) -> None:
    path = tmp_path / "b.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("kernels/k0.py", "print('k0')\n")
        z.writestr("kernels/k1.py", "x" * 2048)
        z.writestr("kernels/sub/k2.py", "nested")
        z.writestr("kernels/k3.py", b"\xff\xfebad utf-8")
        z.writestr("plan.json", "{}")
    with zipfile.ZipFile(path) as z:
        got = kernel_sources_from_zip(z, max_member_bytes=1024)
    assert got == {"k0": "print('k0')\n", "k3": "\ufffd\ufffdbad utf-8"}


def test_views_import_nothing_but_the_standard_library() -> None:
    code = (
        "import sys, opfuse.views; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'triton', 'onnx', 'numpy', 'onnxruntime'} or (m.startswith('opfuse.') and "
        "not m.startswith('opfuse.views') and m != 'opfuse.errors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- in a real browser -----------------------------------------------------------------------------


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path) as driver:
        yield driver


def _open_and_check(driver: Any, page: Path, shot: Path) -> None:
    """Open `page`; no console message of level warning or worse, no request but the file itself;
    then a full-page screenshot."""
    from selenium.webdriver.common.by import By

    driver.get("about:blank")
    driver.get_log("browser"), driver.get_log("performance")  # what came before this page
    driver.get(page.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    assert driver.find_element(By.ID, "verdict").is_displayed()
    for chart in ("time-chart", "roofline-chart", "timings-chart"):
        assert driver.find_element(By.ID, chart).tag_name == "svg"
    # The inline script runs under the page's CSP: a click on a header sorts the table.
    driver.execute_script("document.querySelectorAll('details').forEach(function (d) { d.open = true; })")
    header = driver.find_element(By.CSS_SELECTOR, "#time ~ details table.sortable th:nth-child(3)")
    column = "#time ~ details table.sortable tbody td:nth-child(3)"
    header.click()
    first = [float(td.get_attribute("data-v")) for td in driver.find_elements(By.CSS_SELECTOR, column)]
    assert first == sorted(first, reverse=True) and header.get_attribute("data-dir") == "desc"
    header.click()
    again = [float(td.get_attribute("data-v")) for td in driver.find_elements(By.CSS_SELECTOR, column)]
    assert again == sorted(again)
    driver.execute_script("document.querySelectorAll('details').forEach(function (d) { d.open = false; })")
    assert console_problems(driver) == []
    urls = requested_urls(driver)  # data: URLs (the empty favicon) are no request to anywhere
    assert set(urls) == {page.as_uri()}, urls
    full_page_screenshot(driver, shot)


def test_pages_in_headless_chromium(
    browser: Any, mlp: tuple[dict[str, Any], dict[str, str], Path], tmp_path: Path
) -> None:
    """The bundle's report.html of a real compile, and a GPU-like report, as a person sees them;
    the screenshots go to OPFUSE_SCREENSHOT_DIR (default: this test's tmp dir)."""
    shots = screenshot_dir(tmp_path)
    _, _, bundle = mlp
    page = tmp_path / "report.html"
    with zipfile.ZipFile(bundle) as z:
        page.write_bytes(z.read("report.html"))
    _open_and_check(browser, page, shots / "report_cpu_residual_mlp.png")
    gpu = tmp_path / "gpu.html"
    gpu.write_text(
        render_html(gpu_report(), {"k0": "def launch(x):\n    return x\n"}, title="mlp (GPU-like)")
    )
    _open_and_check(browser, gpu, shots / "report_gpu_like.png")
    hostile = tmp_path / "hostile.html"
    hostile.write_text(render_html(_hostile_report(), {"k0": f"# {HOSTILE}\n"}, title=HOSTILE))
    _open_and_check(browser, hostile, shots / "report_hostile_names.png")
    # A script from the report would have changed the title or raised an alert (no alert is open).
    assert browser.title == f"opfuse report: {HOSTILE}"


def test_cli_compile_writes_the_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnx
    from typer.testing import CliRunner

    import client.cli as cli

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tmp_path / "mlp.onnx"
    onnx.save(residual_mlp(), model)
    bundle, page = tmp_path / "mlp.opfuse.zip", tmp_path / "mlp.html"
    args = ["compile", str(model), "-o", str(bundle), "-s", "x=2x32", "--device", "cpu", "--html", str(page)]
    result = CliRunner().invoke(cli.app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["html"] == str(page)
    with zipfile.ZipFile(bundle) as z:
        report = json.loads(z.read("report.json"))
        sources = kernel_sources_from_zip(z)
    text = page.read_text(encoding="utf-8")
    assert text == render_html(report, sources, title="mlp.onnx")
    shown = _checked_page(report, sources, title="mlp.onnx").all_text
    assert "opfuse report: mlp.onnx" in shown and all(s in shown for s in sources.values())
    human = CliRunner().invoke(cli.app, args)
    assert human.exit_code == 0 and f"saved {page}" in human.stdout.replace("\n", "")
