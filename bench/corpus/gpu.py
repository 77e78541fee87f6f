"""The corpus's GPU leg: opfuse against torch.compile + CUDA graph, fp16, batch 1 and 32, on one GPU.

    PYTHONPATH=. python -m bench.corpus.gpu --out bench/out/corpus-gpu.jsonl            # every row
    PYTHONPATH=. python -m bench.corpus.gpu --jobs 8 --out bench/out/corpus-gpu.jsonl   # waves of 8
    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i PYTHONPATH=. python -m bench.corpus.gpu \\
        --shard $i/4 --out bench/out/corpus-gpu.$i.jsonl & done; wait                  # four GPUs
    PYTHONPATH=. python -m bench.corpus.gpu --merge bench/out/corpus-gpu.*.jsonl        # fill expected.csv

For each row (the default exporter: `torch.onnx.export(m, args, path)`, external data and all) and
batch: opfuse compiles it for the GPU in fp16 and verifies it, then, in the same process and with
the same protocol (bench/run.py's CUDA-event timing, median of many iterations, inputs rotated):
opfuse's fused plan, opfuse's own per-op plan (the report's "before"), and torch.compile + CUDA
graph of the same module in fp16. One JSON line per row and batch is appended as soon as it is
measured, so a run cut short keeps its rows; rows already in the output are skipped (--force
reruns them). Each row runs in a subprocess of its own with a time limit: a crash, a hang or a
poisoned CUDA context stops that row only. `--jobs N`: rows compile N at once, then are timed one
at a time while the others wait (`run_wave`); `--compile-only` times nothing. `--merge` fills the
GPU columns of expected.csv (bench/corpus/README.md) for the default exporter's rows.

This module imports nothing that needs a GPU until a row runs: its argument parsing, resume and
merge logic are tested on the CPU (tests/corpus/test_legs.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.corpus.run import (
    EXPECTED,
    HERE,
    commit,
    interleave,
    locked,
    one_line,
    read_rows,
    shard,
    write_rows,
)
from opfuse.runtime.timing_lock import TIMING_LOCK_ENV

BATCHES = (1, 32)
PRECISION = "fp16"
EXPORTER = "dynamo"  # the GPU leg times the default export
ROW_TIMEOUT_S = 1800.0


def append_line(path: str, rec: dict[str, Any]) -> None:
    """One JSON line, appended under a lock (rows of several jobs share the file)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(json.dumps(rec) + "\n")
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_done(paths: Iterable[str], corpus_only: bool = False) -> dict[tuple[str, int], dict[str, Any]]:
    """The measured (model, batch) of earlier runs' JSON lines; the last line of a key wins, and a
    line that is not JSON (a run killed mid-write) is skipped. `corpus_only`: lines of A/B runs
    with rules switched off (--disable) are skipped too."""
    done: dict[tuple[str, int], dict[str, Any]] = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if corpus_only and isinstance(rec, dict) and rec.get("fusion_disable"):
                    continue
                if isinstance(rec, dict) and "model" in rec and "batch" in rec:
                    done[(rec["model"], int(rec["batch"]))] = rec
    return done


def pending(
    names: list[str], batches: list[int], done: dict[tuple[str, int], dict[str, Any]], force: bool
) -> list[tuple[str, list[int]]]:
    """(row, batches still to measure) for each row with any left. A batch whose line holds an
    error is measured again only with --force (the error is a result: the merge records it)."""
    out = []
    for name in names:
        left = [b for b in batches if force or (name, b) not in done]
        if left:
            out.append((name, left))
    return out


def selected(patterns: list[str], family: str | None) -> list[str]:
    """The rows to run, in the order to run them: the rows named, as named, where every pattern is
    a row's name (the worst rows first, say: a call that stops after one wave runs those); else
    the matches with the CI rows first and the families in turns (run.interleave)."""
    from bench.corpus.models import select

    rows = select(patterns, family=family)
    if patterns and not family and not any(ch in p for p in patterns for ch in "*?["):
        return list(dict.fromkeys(patterns))
    return [r.name for r in interleave(rows)]


def new_rows(
    names: list[str], expected: dict[tuple[str, str], dict[str, str]], compile_only: bool
) -> list[str]:
    """`--new-only`: the rows `expected` has no GPU figures of this run's kind for. A compile-only
    run takes the rows never compiled on a GPU; a timing run also those compiled there but never
    timed (no `ms_b1`: a compile-only run, or one stopped before its timing)."""
    key = "gpu_commit" if compile_only else "ms_b1"
    return [n for n in names if not (expected.get((n, EXPORTER)) or {}).get(key)]


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 and a == a and b == b:
        return a / b
    return None


def _fmt(v: float | None, digits: int = 3) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _yes_no(rec: dict[str, Any], key: str) -> str:
    if not rec:
        return ""
    if "error" in rec:
        return "err"
    v = rec.get(key)
    return "" if v is None else ("yes" if v else "no")


def _captured(rec: dict[str, Any]) -> bool | None:
    """Whether the fused plan ran as one CUDA graph: the timed run's word, else the compile
    phase's capture."""
    if "cuda_graph" in rec:
        return bool(rec["cuda_graph"])
    if "captured" in rec:
        return bool(rec["captured"])
    return None


def gpu_columns(recs: dict[int, dict[str, Any]]) -> dict[str, str]:
    """A row's GPU columns from its per-batch records ({batch: record}). A record of the compile
    phase alone (`--compile-only`: compiled, verified and captured, not timed) gives the
    verification, graph and compile-time columns and leaves the timing columns empty."""
    b1, b32 = recs.get(1, {}), recs.get(32, {})

    def pair(vals: list[str]) -> str:
        return "" if not any(vals) else "/".join(v or "-" for v in vals)

    def num(key: str, digits: int = 3) -> str:
        return pair([_fmt(r.get(key), digits) if "error" not in r else "err" for r in (b1, b32)])

    def one(r: dict[str, Any]) -> str:
        return "err" if "error" in r else _fmt(r.get("opfuse_ms"), 4)

    graph = [{**r, "g": _captured(r)} for r in (b1, b32)]
    any_rec = b1 or b32
    return {
        "ms_b1": one(b1) if b1 else "",
        "ms_b32": one(b32) if b32 else "",
        "ratio_torch_compile": num("ratio_torch_compile"),
        "ratio_per_op": num("ratio_per_op"),
        "gpu_verified": pair([_yes_no(r, "verified") for r in (b1, b32)]),
        "gpu_graph": pair([_yes_no(r, "g") for r in graph]),
        "gpu_compile_s": num("compile_s", 1),
        "gpu_date": str(any_rec.get("date", "")),
        "gpu_commit": str(any_rec.get("commit", "")),
    }


TIMING_COLUMNS = ("ms_b1", "ms_b32", "ratio_torch_compile", "ratio_per_op")


def merge(paths: list[str], out: str = EXPECTED) -> int:
    """Fill the GPU columns of `out`'s default-exporter rows from the JSON lines in `paths` (a
    later file's line for the same row and batch wins: pass the `.compile` file first); returns
    how many rows it filled. The CPU columns are left as they are, and so are a row's earlier
    timings where the new lines hold none (a `--compile-only` run). A row the run's time limit
    stopped (its lines `over_limit` only) keeps any earlier GPU figures: the limit is the run's,
    not the row's fault; a row with none gets the error."""
    by_model: dict[str, dict[int, dict[str, Any]]] = {}
    for (model, batch), rec in read_done(paths, corpus_only=True).items():
        by_model.setdefault(model, {})[batch] = rec
    filled = 0
    with locked(out):
        rows = read_rows(out)
        for model, recs in sorted(by_model.items()):
            key = (model, EXPORTER)
            if key not in rows:
                print(f"{model}: not a row of {out} (skipped)", file=sys.stderr)
                continue
            if all(r.get("over_limit") for r in recs.values()) and rows[key].get("gpu_commit"):
                print(f"{model}: over the run's time limit; its earlier GPU figures kept", file=sys.stderr)
                continue
            cols = gpu_columns(recs)
            timed = any(cols[c] and cols[c] != "err" for c in TIMING_COLUMNS)
            if not timed and any(rows[key].get(c) for c in TIMING_COLUMNS):
                cols = {c: v for c, v in cols.items() if c in ("gpu_verified", "gpu_graph", "gpu_compile_s")}
            rows[key].update(cols)
            filled += 1
        write_rows(out, rows)
    return filled


# --- one row, on the GPU --------------------------------------------------------------------------


def _batched(example: dict[str, Any], batch: int) -> dict[str, Any]:
    return {k: v.repeat(batch, *([1] * (v.dim() - 1))) for k, v in example.items()}


def _fresh(example: dict[str, Any], gen: Any) -> dict[str, Any]:
    """New inputs like `example`: normal floats; integers (token ids) within the example's range."""
    import torch

    out = {}
    for k, v in example.items():
        if v.is_floating_point():
            out[k] = torch.randn(v.shape, generator=gen, dtype=v.dtype)
        else:
            hi = max(1, int(v.max()) + 1)
            out[k] = torch.randint(0, hi, v.shape, generator=gen, dtype=v.dtype)
    return out


def _exported(module: Any, ex: dict[str, Any], name: str, batch: int, export_dir: str) -> str:
    """The row's default export at this batch, made once under `export_dir` and reused (the
    timing pass reads what the compile pass wrote: the exporter is deterministic here anyway)."""
    from bench.corpus.run import export

    where = os.path.join(export_dir, f"{name.replace('/', '--')}-b{batch}")
    path = os.path.join(where, "m.onnx")
    if not os.path.exists(os.path.join(where, "done")):
        os.makedirs(where, exist_ok=True)
        export(module, ex, path, EXPORTER)
        open(os.path.join(where, "done"), "w").close()
    return path


class _Batch:
    """One batch of a row, prepared: its line so far, opfuse's compiled model and torch.compile's
    graph replay (None where either failed: the line says why)."""

    def __init__(self, rec: dict[str, Any]) -> None:
        self.rec = rec
        self.cm: Any = None
        self.peer: Any = None


def _prepare(
    example: dict[str, Any], b: _Batch, path: str, tune_s: float, timed: bool, disable: tuple[str, ...] = ()
) -> None:
    """Compile and verify with opfuse (fp16, on the GPU) and capture its CUDA graph once; nothing
    is timed here."""
    import numpy as np
    import onnx

    import opfuse
    from opfuse.verify.reference import random_inputs

    proto = onnx.load(path)
    inits = {i.name for i in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    shapes = {n: list(t.shape) for n, t in zip(names, example.values(), strict=False)}
    t0 = time.perf_counter()
    cm = opfuse.compile(
        proto,
        input_shapes=shapes,
        precision=PRECISION,
        device="cuda",
        tune_budget_s=tune_s,
        fusion_disable=disable,
    )
    b.rec["compile_s"] = round(time.perf_counter() - t0, 2)
    r = cm.report
    b.rec.update(
        verified=bool(r["verification"]["passed"]),
        kernels_before=r["kernels"].get("before"),
        kernels_after=r["kernels"]["after"],
        compute_nodes=r.get("compute_nodes"),
        cuda_graph_outlook=r.get("cuda_graph"),
        verification=_verification(r),
        # Where the fused plan's time goes (the compile's per-step profile, µs) and what tuning
        # chose for each group that has an alternative: what a slow row is read by.
        steps_us=[
            [str(s.get("node"))[:60], round(1000 * float(s.get("time_ms") or 0.0), 1)]
            for s in (r.get("profile") or {}).get("after") or []
            if s.get("op_type") != "Reshape"
        ],
        variants={gid: v.get("choice") for gid, v in ((r.get("tuning") or {}).get("variants") or {}).items()},
        # The choices timed a second time (close at first): [template, vendor] first, then the
        # medians that decided, ms.
        retimed={
            gid: [*v["retimed"]["first_ms"], v["template_ms"], v["vendor_ms"]]
            for gid, v in ((r.get("tuning") or {}).get("variants") or {}).items()
            if v.get("retimed")
        },
        # The planned groups that run unfused after all (a fault of opfuse's, a kernel the GPU
        # could not compile, a group verification rolled back), each with why: what makes the
        # GPU's launches exceed the CPU leg's plan.
        unfused=unfused_groups(r),
        # Where a cold compile's time goes: the stages, and within tuning the parallel compile of
        # every kernel (and its workers), the config search, the template/vendor timings; and how
        # far the search got (`summary`: kernels timed, cached, left at their start config).
        timings_s=r.get("timings_s"),
        tuning_s={
            k: (r.get("tuning") or {}).get(k)
            for k in (
                "compile_s",
                "compile_workers",
                "configs_s",
                "variants_s",
                "retime",
                "retime_error",
                "summary",
            )
        },
    )
    cm.run(random_inputs(cm.plan.inputs, np.random.default_rng(5)))  # captures the CUDA graph
    b.rec.update(captured=cm.cuda_graph_error is None, cuda_graph_error=cm.cuda_graph_error)
    b.cm = cm if timed else None


def unfused_groups(report: dict[str, Any]) -> list[list[str]]:
    """[rule, first node, reason] of each planned group the compile ran unfused or rolled back."""
    return [
        [str(nf.get("rule")), str((nf.get("nodes") or [""])[0]), str(nf.get("reason"))[:200]]
        for nf in (report.get("fusion") or {}).get("not_fused") or []
        if nf.get("fault") or nf.get("rolled_back")
    ]


def _verification(report: dict[str, Any]) -> dict[str, Any]:
    """What a failed verification needs to be understood: the worst output against its tolerance,
    the groups rolled back, the note."""
    ver = report.get("verification") or {}
    outs = ver.get("outputs") or {}
    worst = max(outs.items(), key=lambda kv: kv[1].get("rel_l2_err") or 0.0, default=None)
    out: dict[str, Any] = {"rolled_back": len(ver.get("rolled_back") or [])}
    if worst is not None:
        name, o = worst
        out.update(
            worst=name, **{k: o.get(k) for k in ("rel_l2_err", "max_abs_err", "rtol", "atol", "passed")}
        )
        if "baseline_rel_l2_err" in o:
            out["baseline_rel_l2_err"] = o["baseline_rel_l2_err"]
    if ver.get("note"):
        out["note"] = str(ver["note"])[:300]
    return out


def _time(b: _Batch, iters: int, warmup: int, profile: bool = False) -> None:
    """The timings, with the GPU to this process alone: opfuse's fused plan (its CUDA graph), its
    step-by-step run and its per-op plan (CompiledModel.benchmark, one protocol: `ratio_per_op`),
    and torch.compile's graph. Where both are captured graphs, the two are timed again in turns
    (bench.run.paired_ms, each on one set of inputs): `opfuse_ms`, `torch_compile_cudagraph_ms`
    and their ratio are those medians, `paired_rounds_ms` each round's, and `benchmark_ms` the
    protocol's figure for opfuse's graph. With `profile` (--profile) the line also holds each
    graph's kernels (`opfuse_kernels`, `peer_kernels`: kernel_profile)."""
    import numpy as np

    from bench.run import paired_ms, time_cuda
    from opfuse.verify.reference import random_inputs

    rec = b.rec
    if b.cm is not None:
        r = b.cm.benchmark(iters=iters, warmup=warmup)
        rec.update(
            opfuse_ms=r["after"]["latency_ms"]["p50"],
            stepwise_ms=(r.get("after_stepwise") or {}).get("latency_ms", {}).get("p50"),
            per_op_ms=r["before"]["latency_ms"]["p50"],
            cuda_graph=r["after"].get("cuda_graph"),
            cuda_graph_error=r["after"].get("cuda_graph_error"),
        )
        rec["ratio_per_op"] = _ratio(rec["opfuse_ms"], rec["per_op_ms"])
    default = rec.get("torch_compile_mode", "default") == "default"
    if b.cm is not None and b.peer is not None and rec.get("cuda_graph") and default:
        env = b.cm.executor.prepare_inputs(random_inputs(b.cm.plan.inputs, np.random.default_rng(7)))
        runner = b.cm._graph_runner(env)  # the graph the benchmark timed, captured at the first run
        runner.stage(env)
        rounds = paired_ms({"opfuse": runner.replay, "torch_compile": b.peer}, iters)
        rec["benchmark_ms"] = rec["opfuse_ms"]
        rec["opfuse_ms"] = float(np.median(rounds["opfuse"]))
        rec["torch_compile_cudagraph_ms"] = float(np.median(rounds["torch_compile"]))
        rec["paired_rounds_ms"] = {k: [round(v, 5) for v in vs] for k, vs in rounds.items()}
        if profile:
            rec["opfuse_kernels"] = kernel_profile(runner.replay)
            rec["peer_kernels"] = kernel_profile(b.peer)
    elif b.peer is not None:
        replay = b.peer
        rec["torch_compile_cudagraph_ms"] = time_cuda(lambda i: replay(), iters, warmup)
    ratio = _ratio(rec.get("opfuse_ms"), rec.get("torch_compile_cudagraph_ms"))
    if default:
        rec["ratio_torch_compile"] = ratio
    else:  # torch.compile's pieces between host reads: not the whole-graph peer the column compares
        rec["ratio_torch_compile"] = None
        rec["ratio_torch_compile_reduce_overhead"] = ratio


def kernel_profile(fn: Callable[[], Any], runs: int = 20) -> list[list[Any]]:
    """What the GPU runs for `fn` (a graph's replay), by torch's profiler over `runs` calls after
    five unprofiled: [us a call, launches a call, kernel name], the most time first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    return kernel_table(prof.events(), runs)


def kernel_table(events: Iterable[Any], runs: int) -> list[list[Any]]:
    """The device events of `runs` calls summed by kernel name: [us a call, launches a call, name
    (120 characters)], the most time first."""
    total: dict[str, list[float]] = {}
    for e in events:
        if getattr(e.device_type, "name", "") != "CUDA":
            continue
        t = total.setdefault(e.name, [0.0, 0.0])
        t[0] += float(e.device_time)
        t[1] += 1
    rows = [[round(us / runs, 2), round(n / runs, 2), name[:120]] for name, (us, n) in total.items()]
    return sorted(rows, key=lambda r: (-r[0], r[2]))


def measure_row(
    name: str,
    batches: list[int],
    out_path: str,
    iters: int,
    warmup: int,
    tune_s: float,
    phase: str,
    export_dir: str,
    sync_dir: str = "",
    disable: tuple[str, ...] = (),
    profile: bool = False,
) -> None:
    """One row's batches, in three steps: export each batch; compile, verify and capture each with
    opfuse, then compile and capture torch.compile's peer of the module (fp16, the same inputs);
    then time them all. phase "compile" stops before the peer and the timings (--compile-only).
    With `sync_dir` (--jobs: rows of a wave compile at once), the row says it is ready and waits
    for its turn before timing, so the timings never share the GPU with another row's work."""
    import torch

    from bench.corpus.models import BY_NAME
    from bench.run import source_digest

    row = BY_NAME[name]
    module, example = row.build()
    meta = {
        "model": name,
        "precision": PRECISION,
        "exporter": EXPORTER,
        "phase": phase,
        "gpu": torch.cuda.get_device_name(0),
        "commit": commit(),
        "opfuse_source": source_digest(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if disable:  # an A/B run: never merged into expected.csv (merge skips these lines)
        meta["fusion_disable"] = list(disable)
    timed = phase != "compile"
    prepared: list[_Batch] = []
    for batch in batches:  # opfuse's side first: the exporter wants the module on the CPU in fp32
        b = _Batch({**meta, "batch": batch})
        b.rec["t0"] = time.perf_counter()
        try:
            ex = _batched(example, batch)
            path = _exported(module, ex, name, batch, export_dir)
            _prepare(ex, b, path, tune_s, timed, disable)
        except Exception as exc:
            traceback.print_exc()
            b.rec["error"] = one_line(exc, 400)
        prepared.append(b)
    if timed:
        m = module.cuda().half()
        for b in prepared:
            if b.cm is not None:
                b.rec.update(_peer(m, _batched(example, b.rec["batch"]), b))
    if sync_dir:
        _wait_turn(sync_dir, name)
    for b in prepared:
        if timed and "error" not in b.rec:
            try:
                _time(b, iters, warmup, profile)
            except Exception as exc:
                traceback.print_exc()
                b.rec["error"] = one_line(exc, 400)
        b.rec["wall_s"] = round(time.perf_counter() - b.rec.pop("t0"), 1)
        append_line(out_path, b.rec)
        print(json.dumps(b.rec), flush=True)
    torch.cuda.empty_cache()


def _slug(name: str) -> str:
    return name.replace("/", "--")


def _wait_turn(sync_dir: str, name: str) -> None:
    """Say this row is ready to be timed, and wait until the wave's scheduler says go."""
    open(os.path.join(sync_dir, _slug(name) + ".ready"), "w").close()
    go = os.path.join(sync_dir, _slug(name) + ".go")
    parent = os.getppid()
    while not os.path.exists(go):
        if os.getppid() != parent:  # the scheduler is gone: nobody will say go
            raise SystemExit(f"{name}: the wave's scheduler exited before this row's turn")
        time.sleep(0.05)


def _peer(m: Any, example: dict[str, Any], b: _Batch) -> dict[str, Any]:
    """torch.compile (default mode, static shapes) of the fp16 module, captured as one CUDA graph
    on inputs of bench/run.py's kind; the replay is kept on `b` for the timings. A module whose
    compiled form cannot be captured whole (a graph break that reads a value back to the host,
    as BART's fp16 overflow check does) gets torch.compile's own CUDA graphs instead:
    mode="reduce-overhead" captures the pieces between the breaks (`torch_compile_mode` says so,
    `torch_compile_graph_error` why the whole capture failed). Its ratio is kept apart
    (`ratio_torch_compile_reduce_overhead`): the host reads between the pieces are in its time."""
    import torch

    from bench.run import graphed

    gen = torch.Generator().manual_seed(3)
    static = {
        k: (v.cuda().half() if v.is_floating_point() else v.cuda()) for k, v in _fresh(example, gen).items()
    }
    rec: dict[str, Any] = {}
    for mode in ("default", "reduce-overhead"):
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                compiled = torch.compile(m, dynamic=False, mode=mode)
                compiled(*static.values())
                torch.cuda.synchronize()
                rec["torch_compile_s"] = round(time.perf_counter() - t0, 2)

                def call(c: Any = compiled) -> Any:
                    with torch.no_grad():
                        return c(*static.values())

                if mode == "default":
                    b.peer = graphed(call)
                else:
                    for _ in range(3):  # cudagraph trees record on the first calls
                        call()
                    b.peer = call
            rec["torch_compile_mode"] = mode
            return rec
        except Exception as exc:
            key = "torch_compile_graph_error" if mode == "default" else "torch_compile_error"
            rec[key] = one_line(exc, 300)
            torch._dynamo.reset()
    return rec


def _command(name: str, batches: list[int], out_path: str, args: argparse.Namespace, phase: str) -> list[str]:
    cmd = [sys.executable, "-m", "bench.corpus.gpu", "--worker", name, "--out", out_path, "--phase", phase]
    cmd += ["--export-dir", args.export_dir, "--batches", ",".join(map(str, batches))]
    cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup), "--tune-budget", str(args.tune_budget)]
    if args.disable:
        cmd += ["--disable", args.disable]
    if args.profile:
        cmd.append("--profile")
    return cmd


def _env(args: argparse.Namespace, parallel: bool) -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(HERE))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    env.pop("TRITON_INTERPRET", None)
    if args.jobs > 1:  # N rows share the host's cores: each gets its share, in every pool
        share = str(max(1, (os.cpu_count() or 2) // args.jobs))
        env.setdefault("OPFUSE_REFERENCE_THREADS", share)
        env.setdefault("OMP_NUM_THREADS", share)
        if parallel:
            env.setdefault("OPFUSE_COMPILE_WORKERS", share)
            # The rows compile together but time one at a time: their profiles, template-vs-library
            # timings and benchmarks take turns on the GPU (opfuse/runtime/timing_lock.py).
            env.setdefault(
                TIMING_LOCK_ENV, os.path.join(tempfile.gettempdir(), f"opfuse-timing-{os.getuid()}.lock")
            )
    return env


def _failed(
    out_path: str, name: str, batches: list[int], phase: str, why: str, over_limit: bool = False
) -> None:
    """A line for each batch the row's process did not write, with the commit and date of the
    run (the merge files the row as run, with this error). `over_limit`: the run's own time limit
    (--timeout) stopped the row, which says how long it takes here, not that it fails: the line
    says so (`over_limit`), and the merge keeps a row's earlier figures for it."""
    got = read_done([out_path])
    meta: dict[str, Any] = {"precision": PRECISION, "phase": phase, "date": time.strftime("%Y-%m-%d")}
    meta["commit"] = commit()
    if over_limit:
        meta["over_limit"] = True
    for b in batches:
        if (name, b) not in got:
            append_line(out_path, {"model": name, "batch": b, **meta, "error": why})


def run_row(
    name: str,
    batches: list[int],
    out_path: str,
    args: argparse.Namespace,
    phase: str = "all",
    deadline: float | None = None,
) -> None:
    """The row in a subprocess of its own, killed after --timeout seconds (a line per batch says
    so) or at `deadline` (time.monotonic(): the end of the call's --stop-after), which records
    nothing, so the next run takes the row again."""
    root = os.path.dirname(os.path.dirname(HERE))
    limit, cut = args.timeout, False
    if deadline is not None and deadline - time.monotonic() < limit:
        limit, cut = max(1.0, deadline - time.monotonic()), True
    cmd, env = _command(name, batches, out_path, args, phase), _env(args, phase == "compile")
    try:
        rc = subprocess.run(cmd, env=env, cwd=root, timeout=limit, check=False).returncode
        why = f"the row's process exited with status {rc}" if rc else ""
    except subprocess.TimeoutExpired:
        if cut:
            print(f"{name}: stopped at --stop-after; not recorded", flush=True)
            return
        _failed(out_path, name, batches, phase, f"not finished in {args.timeout:.0f} s (--timeout)", True)
        return
    if why:
        _failed(out_path, name, batches, phase, why)


TIME_LIMIT_S = 180.0  # a ready row's timings


def run_wave(wave: list[tuple[str, list[int]]], out_path: str, args: argparse.Namespace) -> None:
    """Rows compiled at once, each in its own process (--timeout seconds to get ready), then
    timed one at a time while the others wait: nothing else runs on the GPU during a timing."""
    root = os.path.dirname(os.path.dirname(HERE))
    sync = tempfile.mkdtemp(prefix="opfuse-wave-")
    env = _env(args, True)
    procs = {
        name: subprocess.Popen(
            [*_command(name, batches, out_path, args, "wave"), "--sync-dir", sync], env=env, cwd=root
        )
        for name, batches in wave
    }
    try:
        _run_wave(wave, procs, sync, out_path, args)
    finally:  # a scheduler that stops early (KeyboardInterrupt, a kill) leaves no row behind
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(sync, ignore_errors=True)


def _run_wave(
    wave: list[tuple[str, list[int]]],
    procs: dict[str, subprocess.Popen[bytes]],
    sync: str,
    out_path: str,
    args: argparse.Namespace,
) -> None:
    start, ready = time.monotonic(), []
    waiting = dict(wave)
    while waiting:
        for name in list(waiting):
            if os.path.exists(os.path.join(sync, _slug(name) + ".ready")):
                ready.append(name)
            elif procs[name].poll() is not None:
                rc = procs[name].returncode
                _failed(out_path, name, waiting[name], "wave", f"the row's process exited with status {rc}")
            elif time.monotonic() - start > args.timeout:
                procs[name].kill()
                procs[name].wait()
                why = f"not ready to time in {args.timeout:.0f} s (--timeout)"
                _failed(out_path, name, waiting[name], "wave", why, over_limit=True)
            else:
                continue
            del waiting[name]
        time.sleep(0.1)
    batches_of = dict(wave)
    for name in ready:
        print(f"--- time {name} at {time.monotonic() - start:.0f} s into the wave", flush=True)
        open(os.path.join(sync, _slug(name) + ".go"), "w").close()
        try:
            rc = procs[name].wait(timeout=TIME_LIMIT_S)
            if rc:
                _failed(
                    out_path, name, batches_of[name], "wave", f"the row's process exited with status {rc}"
                )
        except subprocess.TimeoutExpired:
            procs[name].kill()
            procs[name].wait()
            _failed(out_path, name, batches_of[name], "wave", f"timings not done in {TIME_LIMIT_S:.0f} s")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows", default="", help="comma-separated names or globs, or @FILE (one a line); default every row"
    )
    ap.add_argument("--family", default=None, help="timm, transformers or torchvision")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--shard", default="", help="i/n: every n-th row from the i-th (one process per GPU)")
    ap.add_argument("--out", default="bench/out/corpus-gpu.jsonl", help="JSON lines, appended to")
    ap.add_argument("--force", action="store_true", help="measure rows already in --out again")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tune-budget", type=float, default=60.0, help="opfuse tuning seconds per model")
    ap.add_argument("--disable", default="", help="opfuse rules to switch off, comma-separated (A/B runs)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also list each graph's kernels (torch's profiler): the lines' opfuse_kernels and peer_kernels",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="N > 1: rows in waves of N: compile N at once, then time them one at a time",
    )
    ap.add_argument(
        "--export-dir", default="", help="where exports are kept for reuse (default: --out + '.exports')"
    )
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="compile, verify and capture each row on the GPU (N at once with --jobs N), time nothing",
    )
    ap.add_argument(
        "--new-only", action="store_true", help="only the rows --expected has no GPU figures for yet"
    )
    ap.add_argument("--phase", default="all", choices=["all", "compile", "wave"], help=argparse.SUPPRESS)
    ap.add_argument("--sync-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--stop-after", type=float, default=0.0, help="start no row after this many seconds")
    ap.add_argument("--timeout", type=float, default=ROW_TIMEOUT_S, help="seconds per row (all its batches)")
    ap.add_argument("--merge", nargs="+", metavar="JSONL", help="fill expected.csv's GPU columns and exit")
    ap.add_argument("--expected", default=EXPECTED, help="the file --merge fills")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        ap.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not args.batches or any(b < 1 for b in args.batches):
        ap.error("--batches: each batch must be at least 1")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    args.export_dir = args.export_dir or args.out + ".exports"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.merge:
        n = merge(args.merge, args.expected)
        print(f"filled the GPU columns of {n} rows of {args.expected}")
        return
    if args.worker:
        measure_row(
            args.worker,
            args.batches,
            args.out,
            args.iters,
            args.warmup,
            args.tune_budget,
            args.phase,
            args.export_dir,
            args.sync_dir,
            tuple(x for x in args.disable.split(",") if x),
            args.profile,
        )
        return
    try:
        patterns = [p for p in args.rows.split(",") if p]
        if args.rows.startswith("@"):  # a file of names or globs, one a line
            with open(args.rows[1:]) as f:
                patterns = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        names = selected(patterns, args.family)
    except KeyError as exc:
        raise SystemExit(str(exc.args[0])) from None
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/corpus/gpu.py measures on a CUDA GPU; on the CPU run bench/corpus/run.py")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    if args.new_only:
        names = new_rows(names, read_rows(args.expected), args.compile_only)
    names = shard(names, args.shard)
    start = time.monotonic()
    stop = args.stop_after or math.inf

    def elapsed() -> float:
        return time.monotonic() - start

    if args.compile_only:  # N rows at once, nothing timed; rows start before --stop-after
        out = args.out + ".compile"
        todo = pending(names, args.batches, read_done([out]), args.force)
        print(f"{len(todo)} rows to compile, {args.jobs} at once -> {out}", flush=True)

        def one(item: tuple[int, tuple[str, list[int]]]) -> None:
            i, (name, batches) = item
            if elapsed() < stop:
                print(f"--- compile [{i + 1}/{len(todo)}] {name} batches {batches}", flush=True)
                run_row(name, batches, out, args, "compile")

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, enumerate(todo)))
        return
    plan = pending(names, args.batches, read_done([args.out]), args.force)
    print(f"{len(plan)} rows to measure, {args.jobs} at once -> {args.out}", flush=True)
    for i in range(0, len(plan), args.jobs):  # a wave starts before --stop-after
        if elapsed() >= stop:
            break
        wave = plan[i : i + args.jobs]
        print(
            f"--- [{i + 1}-{i + len(wave)}/{len(plan)}] at {elapsed():.0f} s: {[n for n, _ in wave]}",
            flush=True,
        )
        if args.jobs == 1:
            run_row(*wave[0], args.out, args, "all")
        else:
            run_wave(wave, args.out, args)


if __name__ == "__main__":
    main()
