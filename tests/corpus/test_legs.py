"""The corpus legs' bookkeeping, on the CPU: shards, resume, the results file, the GPU merge.

No model runs here (tests/corpus/test_corpus.py runs the subset): these check that a run picks up
where the last one stopped, that shards split the rows once each, that the file keeps its GPU
columns when the CPU leg rewrites a row, and that the GPU leg's lines fill them.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from bench.corpus import gpu, models
from bench.corpus import run as cpu


def _rows(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    return cpu.read_rows(str(path))


def test_shards_split_the_rows_once_each() -> None:
    items = list(range(11))
    parts = [cpu.shard(items, f"{i}/3") for i in range(3)]
    assert sorted(x for p in parts for x in p) == items
    assert cpu.shard(items, "") == items
    with pytest.raises(SystemExit, match="--shard must look like 0/4"):
        cpu.shard(items, "two")
    with pytest.raises(SystemExit, match=r"the index must be 0\.\.2"):
        cpu.shard(items, "3/3")


def test_cpu_leg_resumes_after_the_rows_the_file_has(tmp_path: Path) -> None:
    out = tmp_path / "expected.csv"
    rows = models.select(["timm/test_vit", "transformers/bert"])
    cpu.update(str(out), [], rows)
    got = _rows(out)
    assert {k: v["status"] for k, v in got.items()} == {
        (r.name, e): "not_run" for r in rows for e in cpu.EXPORTERS
    }
    res = {"model": "transformers/bert", "family": "transformers", "exporter": "dynamo", "status": "ok"}
    cpu.update(str(out), [{**res, "launches": 16, "verified": True}])
    plan = cpu.todo(rows, list(cpu.EXPORTERS), _rows(out), force=False)
    assert [(r.name, e) for r, e in plan] == [
        ("timm/test_vit", ["dynamo", "torchscript"]),
        ("transformers/bert", ["torchscript"]),
    ]
    forced = cpu.todo(rows, ["dynamo"], _rows(out), force=True)
    assert [(r.name, e) for r, e in forced] == [
        ("timm/test_vit", ["dynamo"]),
        ("transformers/bert", ["dynamo"]),
    ]
    line = _rows(out)[("transformers/bert", "dynamo")]
    assert line["launches"] == "16" and line["verified"] == "true"
    with open(out, newline="") as f:
        assert next(csv.reader(f)) == cpu.COLUMNS


def test_interleave_puts_the_subset_first_then_takes_families_in_turns() -> None:
    order = cpu.interleave(models.ROWS)
    n_ci = sum(r.ci for r in models.ROWS)
    assert all(r.ci for r in order[:n_ci]) and not any(r.ci for r in order[n_ci:])
    assert {r.family for r in order[n_ci : n_ci + 3]} == set(models.FAMILIES)
    assert sorted(r.name for r in order) == sorted(r.name for r in models.ROWS)


def test_gpu_leg_parses_its_options() -> None:
    args = gpu.parse(["--shard", "1/4", "--batches", "1,32", "--rows", "timm/*"])
    assert args.batches == [1, 32] and args.shard == "1/4" and args.rows == "timm/*"
    assert gpu.parse([]).batches == list(gpu.BATCHES)
    with pytest.raises(SystemExit):
        gpu.parse(["--batches", "one"])
    with pytest.raises(SystemExit):
        gpu.parse(["--batches", "0"])


def test_gpu_leg_resumes_and_skips_a_line_cut_short(tmp_path: Path) -> None:
    out = tmp_path / "gpu.jsonl"
    recs = [
        {"model": "timm/test_vit", "batch": 1, "opfuse_ms": 0.5},
        {"model": "timm/test_vit", "batch": 32, "error": "RuntimeError: boom"},
        {"model": "transformers/bert", "batch": 1, "opfuse_ms": 0.4},
    ]
    out.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"model": "transformers/bert", "ba')
    done = gpu.read_done([str(out)])
    assert set(done) == {("timm/test_vit", 1), ("timm/test_vit", 32), ("transformers/bert", 1)}
    names = ["timm/test_vit", "transformers/bert", "torchvision/resnet18"]
    assert gpu.pending(names, [1, 32], done, force=False) == [
        ("transformers/bert", [32]),
        ("torchvision/resnet18", [1, 32]),
    ]
    assert gpu.pending(names[:1], [1, 32], done, force=True) == [("timm/test_vit", [1, 32])]


def test_gpu_merge_fills_the_default_exporters_gpu_columns(tmp_path: Path) -> None:
    expected = tmp_path / "expected.csv"
    rows = models.select(["timm/test_vit", "transformers/bert"])
    cpu.update(str(expected), [], rows)
    cpu.update(str(expected), [{"model": "timm/test_vit", "family": "timm", "exporter": "dynamo", "status": "ok", "launches": 9}])  # fmt: skip
    lines = tmp_path / "gpu.jsonl"
    base = {"model": "timm/test_vit", "date": "2026-12-01", "commit": "abc1234"}
    recs = [
        {**base, "batch": 1, "opfuse_ms": 0.25, "ratio_torch_compile": 0.8, "ratio_per_op": 0.5},
        {**base, "batch": 32, "opfuse_ms": 1.5, "ratio_torch_compile": 1.25, "ratio_per_op": 0.4},
        {"model": "transformers/bert", "batch": 1, "error": "RuntimeError: x", "date": "2026-12-01"},
    ]
    lines.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert gpu.merge([str(lines)], str(expected)) == 2
    got = _rows(expected)
    vit = got[("timm/test_vit", "dynamo")]
    assert (vit["ms_b1"], vit["ms_b32"]) == ("0.2500", "1.5000")
    assert vit["ratio_torch_compile"] == "0.800/1.250" and vit["ratio_per_op"] == "0.500/0.400"
    assert (vit["gpu_date"], vit["gpu_commit"]) == ("2026-12-01", "abc1234")
    assert vit["status"] == "ok" and vit["launches"] == "9"  # the CPU columns stay
    bert = got[("transformers/bert", "dynamo")]
    assert bert["ms_b1"] == "err" and bert["ms_b32"] == "" and bert["ratio_torch_compile"] == "err/-"
    assert got[("timm/test_vit", "torchscript")]["ms_b1"] == ""  # the GPU leg times the default export
    assert vit["gpu_verified"] == "" and vit["gpu_graph"] == ""  # these lines did not say
    # A compile-only run (verified and captured, not timed) fills its columns and keeps the timings.
    compiled = tmp_path / "gpu.jsonl.compile"
    comp = {**base, "commit": "def5678", "verified": True, "compile_s": 12.34}
    compiled.write_text(
        json.dumps({**comp, "batch": 1, "captured": True})
        + "\n"
        + json.dumps({**comp, "batch": 32, "verified": False, "captured": False})
        + "\n"
    )
    assert gpu.merge([str(compiled)], str(expected)) == 1
    vit = _rows(expected)[("timm/test_vit", "dynamo")]
    assert (vit["gpu_verified"], vit["gpu_graph"], vit["gpu_compile_s"]) == ("yes/no", "yes/no", "12.3/12.3")
    assert vit["ms_b1"] == "0.2500" and vit["gpu_commit"] == "abc1234"  # the timings' commit
    # The timed lines win over the compile phase's when both files are merged, compile file first.
    timed = {**base, "batch": 1, "opfuse_ms": 0.2, "verified": True, "cuda_graph": True, "commit": "def5678"}
    lines.write_text(json.dumps(timed) + "\n")
    assert gpu.merge([str(compiled), str(lines)], str(expected)) == 1
    vit = _rows(expected)[("timm/test_vit", "dynamo")]
    assert (vit["ms_b1"], vit["ms_b32"], vit["gpu_verified"]) == ("0.2000", "", "yes/no")
    assert vit["gpu_commit"] == "def5678"
    # A later A/B line with a rule switched off (--disable) is not the corpus's figure.
    ab = {**timed, "opfuse_ms": 9.0, "fusion_disable": ["gemm_reduction"], "commit": "fed9876"}
    lines.write_text(json.dumps(timed) + "\n" + json.dumps(ab) + "\n")
    assert gpu.merge([str(compiled), str(lines)], str(expected)) == 1
    vit = _rows(expected)[("timm/test_vit", "dynamo")]
    assert (vit["ms_b1"], vit["gpu_commit"]) == ("0.2000", "def5678")
    # The CPU leg rewriting a row keeps what the GPU leg measured.
    cpu.update(str(expected), [{"model": "timm/test_vit", "family": "timm", "exporter": "dynamo", "status": "ok", "launches": 8}])  # fmt: skip
    vit = _rows(expected)[("timm/test_vit", "dynamo")]
    assert vit["launches"] == "8" and vit["ms_b1"] == "0.2000" and vit["gpu_graph"] == "yes/no"


def test_gpu_merge_keeps_earlier_figures_of_a_row_the_runs_time_limit_stopped(tmp_path: Path) -> None:
    expected = tmp_path / "expected.csv"
    rows = models.select(["timm/test_vit", "transformers/bert"])
    cpu.update(str(expected), [], rows)
    timed = tmp_path / "a.jsonl"
    base = {"model": "timm/test_vit", "date": "2026-12-01", "commit": "abc1234", "verified": True}
    timed.write_text(
        "".join(
            json.dumps({**base, "batch": b, "opfuse_ms": 0.25, "ratio_torch_compile": 0.8}) + "\n"
            for b in (1, 32)
        )
    )
    gpu.merge([str(timed)], str(expected))
    later = tmp_path / "b.jsonl"
    stopped = {"date": "2026-12-02", "commit": "def5678", "error": "not ready to time in 150 s (--timeout)"}
    later.write_text(
        "".join(
            json.dumps({**stopped, "model": m, "batch": b, "over_limit": True}) + "\n"
            for m in ("timm/test_vit", "transformers/bert")
            for b in (1, 32)
        )
    )
    assert gpu.merge([str(later)], str(expected)) == 1  # bert only: test_vit keeps its figures
    got = _rows(expected)
    vit = got[("timm/test_vit", "dynamo")]
    assert (vit["ms_b1"], vit["ratio_torch_compile"], vit["gpu_commit"]) == (
        "0.2500",
        "0.800/0.800",
        "abc1234",
    )
    bert = got[("transformers/bert", "dynamo")]
    assert (bert["ms_b1"], bert["gpu_verified"], bert["gpu_commit"]) == ("err", "err/err", "def5678")
    # A failure of the row itself (not the limit) replaces the earlier figures.
    later.write_text(
        json.dumps({**stopped, "model": "timm/test_vit", "batch": 1, "error": "RuntimeError: x"}) + "\n"
    )
    assert gpu.merge([str(later)], str(expected)) == 1
    assert _rows(expected)[("timm/test_vit", "dynamo")]["ms_b1"] == "err"


def test_summary_gives_the_shares_and_groups_failures_by_reason(tmp_path: Path) -> None:
    out = tmp_path / "expected.csv"
    rows = models.select(["timm/test_vit", "transformers/bert"])
    cpu.update(str(out), [], rows)
    base = {"family": "timm", "exported": True, "compiled": True, "verified": True}
    ok = {**base, "status": "ok", "launches_per_node": 0.25, "fused_coverage": 0.9}
    crash = {"exported": True, "compiled": False, "verified": False, "status": "crash"}
    cpu.update(
        str(out),
        [
            {**ok, "model": "timm/test_vit", "exporter": "dynamo"},
            {**ok, "model": "timm/test_vit", "exporter": "torchscript", "launches_per_node": 0.16},
            {
                **crash,
                "model": "transformers/bert",
                "exporter": "dynamo",
                "error": "ValueError: shape (2,) of '/h.0/a'",
            },
            {
                **crash,
                "model": "transformers/bert",
                "exporter": "torchscript",
                "error": "ValueError: shape (3,) of '/h.1/b'",
            },
        ],
    )
    text = cpu.summary(str(out))
    assert "4 rows (2 models, each with dynamo, torchscript), 4 run" in text
    assert "exported 4/4 (100%), compiled 2/4 (50%), verified 2/4 (50%)" in text
    assert "geomean over 2 verified rows: 0.200" in text
    assert "2 crash: ValueError: shape (N,) of '…'" in text


def test_summary_gives_the_gpu_figures_the_targets_name() -> None:
    def row(
        model: str, ratio: str, per_op: str, commit: str, date: str, status: str = "ok"
    ) -> dict[str, str]:
        return {
            "model": model,
            "status": status,
            "ratio_torch_compile": ratio,
            "ratio_per_op": per_op,
            "gpu_commit": commit,
            "gpu_date": date,
        }

    rows = [
        row("timm/a", "0.500/2.000", "0.1/0.2", "aaa", "2026-12-01"),
        row("timm/b", "1.200/0.800", "0.1/1.3", "bbb", "2026-12-02"),
        row("timm/c", "1.000/0.500", "0.1/0.1", "bbb", "2026-12-02"),
        row("timm/d", "err/err", "", "bbb", "2026-12-02"),
        row("timm/e", "err/err", "", "aaa", "2026-12-01", status="export_failed"),
        row("timm/f", "", "", "", ""),  # never timed
    ]
    text = "\n".join(cpu.gpu_summary(rows, worst=2))
    # geomeans over a, b and c: (0.5 * 1.2 * 1.0) ** (1/3) and (2.0 * 0.8 * 0.5) ** (1/3)
    assert "3 rows timed at both batches" in text and "geomean 0.843 (b1) / 0.928 (b32)" in text
    assert "batches above 1.10: 2: timm/a b32 2.000, timm/b b1 1.200" in text
    assert "rows slower than opfuse's per-op plan: 1: timm/b" in text
    assert "export failed: 1: timm/e" in text and "no ratio from the GPU leg: 1: timm/d" in text
    worst = text.split("the 2 worst (larger ratio first):\n")[1].splitlines()
    assert [w.split()[0] for w in worst[:2]] == ["timm/a", "timm/b"]
    assert "rows by GPU commit, newest first: bbb 3 (2026-12-02), aaa 2 (2026-12-01)" in text
    assert cpu.gpu_summary([row("timm/f", "", "", "", "")]) == []


def test_gpu_leg_jobs_compile_first_and_share_the_output(tmp_path: Path) -> None:
    import threading

    args = gpu.parse(["--jobs", "4", "--out", str(tmp_path / "g.jsonl")])
    assert args.jobs == 4 and args.export_dir == str(tmp_path / "g.jsonl") + ".exports"
    with pytest.raises(SystemExit):
        gpu.parse(["--jobs", "0"])
    out = str(tmp_path / "out.jsonl")

    def write(i: int) -> None:
        gpu.append_line(out, {"model": f"m{i}", "batch": 1, "pad": "x" * 5000})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(gpu.read_done([out])) == {(f"m{i}", 1) for i in range(6)}  # no line torn


def test_gpu_leg_runs_waves_of_jobs_and_compile_only_times_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    calls: list[tuple[str, tuple[int, ...], str]] = []

    def fake_row(name, batches, out_path, args, phase="all", deadline=None):  # type: ignore[no-untyped-def]
        calls.append((name, tuple(batches), phase))
        for b in batches:
            gpu.append_line(out_path, {"model": name, "batch": b, "phase": phase})

    def fake_wave(wave, out_path, args):  # type: ignore[no-untyped-def]
        for name, batches in wave:
            fake_row(name, batches, out_path, args, "wave")

    monkeypatch.setattr(gpu, "run_row", fake_row)
    monkeypatch.setattr(gpu, "run_wave", fake_wave)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = str(tmp_path / "g.jsonl")
    rows = "timm/test_vit,transformers/bert"
    gpu.main(["--rows", rows, "--jobs", "2", "--out", out])
    assert sorted(calls) == [("timm/test_vit", (1, 32), "wave"), ("transformers/bert", (1, 32), "wave")]
    calls.clear()
    gpu.main(["--rows", rows, "--jobs", "2", "--out", out])  # all done: nothing runs again
    assert calls == []
    gpu.main(["--rows", rows, "--compile-only", "--out", str(tmp_path / "c.jsonl")])
    assert sorted(c[2] for c in calls) == ["compile", "compile"]
    assert os.path.exists(str(tmp_path / "c.jsonl.compile"))
    # --new-only: rows --expected already has GPU figures for are left out.
    expected = tmp_path / "expected.csv"
    cpu.update(str(expected), [], models.select(rows.split(",")))
    line = {"model": "timm/test_vit", "batch": 1, "opfuse_ms": 0.2, "commit": "abc1234"}
    (tmp_path / "m.jsonl").write_text(json.dumps(line) + "\n")
    gpu.merge([str(tmp_path / "m.jsonl")], str(expected))
    calls.clear()
    gpu.main(["--rows", rows, "--compile-only", "--new-only", "--expected", str(expected), "--out", str(tmp_path / "n.jsonl")])  # fmt: skip
    assert [c[0] for c in calls] == ["transformers/bert"]


# A stand-in for a row's process in a wave: it follows measure_row's protocol (ready, wait for go,
# then its lines) and logs when it timed, so the test sees that no two timings overlap.
_ROW = """
import json, os, sys, time
name, out, sync, log, mode = sys.argv[1:6]
slug = name.replace("/", "--")
if mode == "crash":
    sys.exit(3)
time.sleep(0.2 if mode == "fast" else 0.6)
if mode == "hang":
    time.sleep(60)
with open(log, "a") as f:
    f.write(f"ready {name} {time.monotonic()}\\n")
open(os.path.join(sync, slug + ".ready"), "w").close()
while not os.path.exists(os.path.join(sync, slug + ".go")):
    time.sleep(0.01)
with open(log, "a") as f:
    f.write(f"start {name} {time.monotonic()}\\n")
time.sleep(0.2)
with open(log, "a") as f:
    f.write(f"end {name} {time.monotonic()}\\n")
with open(out, "a") as f:
    f.write(json.dumps({"model": name, "batch": 1, "opfuse_ms": 0.1}) + "\\n")
"""


def test_a_wave_times_its_rows_one_at_a_time_and_records_the_ones_that_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    script, log, out = tmp_path / "row.py", tmp_path / "log.txt", str(tmp_path / "g.jsonl")
    script.write_text(_ROW)
    modes = {"a/fast": "fast", "b/slow": "slow", "c/crash": "crash", "d/hang": "hang"}
    log.write_text("")

    def command(name, batches, out_path, args, phase):  # type: ignore[no-untyped-def]
        return [sys.executable, str(script), name, out_path, "SYNC", str(log), modes[name]]

    real_popen = gpu.subprocess.Popen

    syncs: list[str] = []

    def popen(cmd, **kw):  # type: ignore[no-untyped-def]
        sync = cmd[-1]  # run_wave appends --sync-dir DIR
        syncs.append(sync)
        return real_popen([c if c != "SYNC" else sync for c in cmd[:-2]], **kw)

    monkeypatch.setattr(gpu, "_command", command)
    monkeypatch.setattr(gpu.subprocess, "Popen", popen)
    args = gpu.parse(["--jobs", "4", "--timeout", "5", "--out", out])
    gpu.run_wave([(n, [1]) for n in modes], out, args)
    assert syncs and not os.path.exists(syncs[0])  # the wave's sync folder is gone
    got = gpu.read_done([out])
    assert got[("a/fast", 1)]["opfuse_ms"] == 0.1 and got[("b/slow", 1)]["opfuse_ms"] == 0.1
    assert "exited with status 3" in got[("c/crash", 1)]["error"] and "over_limit" not in got[("c/crash", 1)]
    assert "not ready to time in 5 s" in got[("d/hang", 1)]["error"] and got[("d/hang", 1)]["over_limit"]
    assert got[("d/hang", 1)]["commit"] and got[("d/hang", 1)]["date"]  # the merge files it as run
    events = [line.split() for line in log.read_text().splitlines()]
    spans = {name: float(t) for kind, name, t in events if kind == "start"}
    ends = {name: float(t) for kind, name, t in events if kind == "end"}
    assert set(spans) == {"a/fast", "b/slow"}
    first, second = sorted(spans, key=spans.get)  # type: ignore[arg-type]
    assert ends[first] <= spans[second]  # one timing at a time
    # No timing starts while a row of the wave is still compiling (the slow one readies last).
    readies = {name: float(t) for kind, name, t in events if kind == "ready"}
    assert min(spans.values()) >= max(readies.values())


def test_a_record_names_its_commit_and_marks_a_source_that_differs_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of a checkout whose opfuse/ differs from its HEAD (the device machine's copy of the
    working tree; uncommitted work) says so, so no record claims a commit it did not run."""
    import shutil
    import subprocess

    monkeypatch.setenv("OPFUSE_COMMIT", "abc1234")
    assert cpu.commit() == "abc1234"
    monkeypatch.delenv("OPFUSE_COMMIT")
    root = tmp_path / "checkout"
    (root / "opfuse").mkdir(parents=True)
    (root / "bench" / "corpus").mkdir(parents=True)
    (root / "opfuse" / "a.py").write_text("x = 1\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    monkeypatch.setattr(cpu, "HERE", str(root / "bench" / "corpus"))
    assert cpu.commit() == head
    (root / "bench" / "corpus" / "expected.csv").write_text("rows\n")  # the corpus's own output: not opfuse
    assert cpu.commit() == head
    (root / "opfuse" / "a.py").write_text("x = 2\n")
    assert cpu.commit() == head + "+changes"
    shutil.rmtree(root / ".git")
    assert cpu.commit() == "unknown"


def test_a_gpu_record_names_the_planned_groups_that_ran_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`unfused_groups` of a real compile's report where one group runs unfused (the planner's
    guard of tests/unit/passes/test_sibling_convs.py taken away): its rule, first node and why;
    nothing for the same model compiled as planned."""
    import opfuse
    from opfuse.fusion.rules.base import PlanState
    from tests.unit.passes.test_sibling_convs import hrnet_fuse

    shapes = {"x": [1, 4, 8, 8], "z": [1, 4, 4, 4]}
    planned = opfuse.compile(hrnet_fuse(), input_shapes=shapes, verify=False).report
    # The planner's own notes (a lone anchor, a refusal) are no group run unfused.
    assert planned["fusion"]["not_fused"] and gpu.unfused_groups(planned) == []
    monkeypatch.setattr(PlanState, "read", lambda self: set())
    got = gpu.unfused_groups(opfuse.compile(hrnet_fuse(), input_shapes=shapes, verify=False).report)
    assert [g[:2] for g in got] == [["conv_epilogue+layout_prologue+resize_gather", "Transpose#ncl1"]]
    assert "no step of the plan writes" in got[0][2]


def test_new_only_times_the_rows_compiled_on_a_gpu_but_never_timed() -> None:
    """`--new-only`: a timing run takes the rows with no GPU figures and those a compile-only run
    left untimed (a commit, no ms); a compile-only run only the rows never on a GPU."""
    expected = {
        ("a", gpu.EXPORTER): {"gpu_commit": "abc", "ms_b1": "0.1"},  # timed
        ("b", gpu.EXPORTER): {"gpu_commit": "abc", "ms_b1": ""},  # compiled only
        ("c", gpu.EXPORTER): {"gpu_commit": "", "ms_b1": ""},  # never on a GPU
    }
    names = ["a", "b", "c", "d"]  # d: not in the file
    assert gpu.new_rows(names, expected, compile_only=False) == ["b", "c", "d"]
    assert gpu.new_rows(names, expected, compile_only=True) == ["c", "d"]


def test_gpu_leg_runs_the_rows_named_in_their_order() -> None:
    """Rows named one by one run as named (a call that times one wave times the first ones); a
    glob or a family takes the CI rows first and the families in turns."""
    named = ["timm/sequencer2d_s", "torchvision/resnext50_32x4d", "transformers/bert", "timm/sequencer2d_s"]
    assert gpu.selected(named, None) == named[:3]
    mixed = gpu.selected(["timm/sequencer2d_s", "transformers/b*"], None)
    assert mixed[0] == "transformers/bert" and "timm/sequencer2d_s" in mixed  # bert: a CI row
    assert gpu.selected([], "torchvision") == [
        r.name for r in cpu.interleave(models.select(family="torchvision"))
    ]
    with pytest.raises(KeyError):
        gpu.selected(["timm/no_such_model"], None)


def test_paired_timing_warms_the_contenders_in_turns_then_alternates_their_rounds() -> None:
    """opfuse's graph and its peer are timed in rounds, taking turns with the order reversed each
    round, after running in turns for the warm-up time: each round's figure is kept in order."""
    from bench.run import paired_ms

    calls: list[str] = []
    figures = {"opfuse": iter([1.0, 2.0, 3.0]), "peer": iter([4.0, 5.0, 6.0])}

    def contender(name: str):  # type: ignore[no-untyped-def]
        return lambda: calls.append(name)

    def timer(fn, iters, warmup):  # type: ignore[no-untyped-def]
        before = len(calls)
        for i in range(warmup + iters):
            fn(i)
        assert len(calls) == before + warmup + iters
        return next(figures[calls[-1]])

    out = paired_ms(
        {"opfuse": contender("opfuse"), "peer": contender("peer")}, 4, rounds=3, warm_s=0.0, timer=timer
    )
    assert out == {"opfuse": [1.0, 2.0, 3.0], "peer": [4.0, 5.0, 6.0]}
    assert calls[:2] == ["opfuse", "peer"]  # the warm-up: each once, in turns, when warm_s is spent
    timed = calls[2:]
    blocks = [timed[i * 5][0] for i in range(6)]  # 1 warm-up + 4 timed runs a block
    assert blocks == ["o", "p", "p", "o", "o", "p"]


def test_a_kernel_profile_sums_each_kernels_device_time_a_call() -> None:
    """--profile's table: device events only, summed by kernel name and divided by the calls, the
    most time first; --profile reaches the row's worker."""
    from types import SimpleNamespace

    cuda, cpu = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")
    events = [
        SimpleNamespace(name="fused_conv", device_type=cuda, device_time=6.0),
        SimpleNamespace(name="fused_conv", device_type=cuda, device_time=4.0),
        SimpleNamespace(name="gemv", device_type=cuda, device_time=7.0),
        SimpleNamespace(name="cudaGraphLaunch", device_type=cpu, device_time=0.0),
    ]
    assert gpu.kernel_table(events, runs=2) == [[5.0, 1.0, "fused_conv"], [3.5, 0.5, "gemv"]]
    args = gpu.parse(["--profile"])
    assert "--profile" in gpu._command("timm/resnet18", [1], "out.jsonl", args, "wave")
    assert "--profile" not in gpu._command("timm/resnet18", [1], "out.jsonl", gpu.parse([]), "wave")
