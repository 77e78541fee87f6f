"""Time opfuse against its peers on one GPU, in one run, with one protocol.

    PYTHONPATH=. python bench/run.py --models resnet50,bert-base --batches 1,32 --precision fp16 --out results.json
    PYTHONPATH=. python bench/run.py --precision fp16,fp32 --gpus 2   # the whole zoo, two GPUs, one run

For each model and batch: ONNX per-op eager (opfuse's unfused plan), opfuse (fused), the source
module eager and eager + CUDA graph, torch.compile and torch.compile + CUDA graph. CUDA events,
warm-up, median of many iterations, inputs rotated among several sets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import opfuse
from bench.corpus.run import commit
from bench.zoo import ZOO, build, export_onnx
from opfuse.runtime.graph_capture import graph_capture

TUNE_BUDGET_S = 60.0  # set by main(): --tune-budget
WARM = False  # set by main(): --warm
DISABLE: list[str] = []  # set by main(): --disable
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def time_cuda(fn: Callable[[int], Any], iters: int, warmup: int) -> float:
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]))


# The paired timing: rounds of `iters` runs per contender, and how long they run in turns first.
PAIRED_ROUNDS = 6
PAIRED_WARM_S = 0.25


def paired_ms(
    fns: dict[str, Callable[[], Any]],
    iters: int,
    rounds: int = PAIRED_ROUNDS,
    warm_s: float = PAIRED_WARM_S,
    timer: Callable[[Callable[[int], Any], int, int], float] = time_cuda,
) -> dict[str, list[float]]:
    """Each of `fns` (a captured graph's replay) timed in `rounds` rounds of `iters` runs, taking
    turns, the order reversed each round; name -> each round's median ms, in round order.

    Timed one after the other, the same plans came out up to 30% apart between two runs on one
    H100 (hgnet_tiny's ratio 1.12 in a wave, 0.79 alone), likely the clocks a card keeps after
    waiting idle, which a few milliseconds of runs do not raise: a ratio of two figures timed
    apart held that spread. Here the contenders first run in turns for `warm_s` seconds, and a
    change of clocks during the rounds falls on all of them."""
    names = list(fns)
    deadline = time.perf_counter() + warm_s
    while True:
        for name in names:
            fns[name]()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if time.perf_counter() >= deadline:
            break
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(timer(_indexed(fns[name]), iters, 1))
    return out


def _indexed(fn: Callable[[], Any]) -> Callable[[int], Any]:
    """`fn` as time_cuda calls it (with the iteration's index, unused)."""
    return lambda i: fn()


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with graph_capture(g):
        fn()
    return g.replay


def peers(zm: Any, precision: str, iters: int, warmup: int, modes: list[str]) -> dict[str, dict[str, Any]]:
    dtype = DTYPES[precision]
    module = zm.module.cuda().to(dtype) if dtype != torch.float32 else zm.module.cuda()
    sets = [
        {k: (v.cuda().to(dtype) if v.is_floating_point() else v.cuda()) for k, v in _fresh(zm).items()}
        for _ in range(3)
    ]
    static = {k: v.clone() for k, v in sets[0].items()}
    out: dict[str, dict[str, Any]] = {}
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    with torch.no_grad():

        def eager(i: int) -> Any:
            return module(*sets[i % 3].values())

        out["eager"] = {"ms": time_cuda(eager, iters, warmup)}
        try:
            replay = graphed(lambda: module(*static.values()))
            out["eager_cudagraph"] = {"ms": time_cuda(lambda i: replay(), iters, warmup)}
        except Exception as exc:
            out["eager_cudagraph"] = {"error": repr(exc)[:200]}
        for mode in modes:
            key = "torch_compile" if mode == "default" else f"torch_compile_{mode}"
            try:
                torch._dynamo.reset()
                t0 = time.perf_counter()
                compiled = torch.compile(module, mode=None if mode == "default" else mode)
                compiled(*static.values())
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0

                def on_set(i: int, c: Any = compiled) -> Any:
                    return c(*sets[i % 3].values())

                def on_static(c: Any = compiled) -> Any:
                    return c(*static.values())

                out[key] = {"ms": time_cuda(on_set, iters, warmup), "compile_s": compile_s}
                replay = graphed(on_static)

                def replayed(i: int, r: Any = replay) -> Any:
                    return r()

                out[key + "_cudagraph"] = {"ms": time_cuda(replayed, iters, warmup), "compile_s": compile_s}
            except Exception as exc:
                out[key] = {"error": repr(exc)[:300]}
    return out


def _fresh(zm: Any) -> dict[str, torch.Tensor]:
    return {
        k: (torch.randn_like(v) if v.is_floating_point() else torch.randint_like(v, 0, 1000))
        for k, v in zm.example.items()
    }


def bench_one(
    name: str, batch: int, precision: str, iters: int, warmup: int, modes: list[str]
) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "batch": batch, "precision": precision}
    zm = build(name, batch)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.onnx")
        t0 = time.perf_counter()
        export_onnx(zm, path)
        row["export_s"] = round(time.perf_counter() - t0, 2)
        shapes = {k: list(v.shape) for k, v in zm.example.items()}

        def compile_timed(prefix: str) -> opfuse.CompiledModel:
            t0 = time.perf_counter()
            cm = opfuse.compile(
                path,
                input_shapes=shapes,
                precision=precision,
                device="cuda",
                tune_budget_s=TUNE_BUDGET_S,
                fusion_disable=DISABLE,
            )
            row[f"{prefix}_compile_s"] = round(time.perf_counter() - t0, 2)
            row[f"{prefix}_stages_s"] = _stages(cm.report)
            return cm

        try:
            cm = compile_timed("opfuse")
            if WARM:  # again, with the tuning and Triton caches the first compile filled
                cm = compile_timed("opfuse_warm")
            cm.benchmark(iters=iters, warmup=warmup)
            r = cm.report
            if os.environ.get("OPFUSE_BENCH_REPORTS"):
                out_dir = os.environ["OPFUSE_BENCH_REPORTS"]
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, f"{name}-b{batch}-{precision}.json"), "w") as f:
                    json.dump(r, f, default=str)
            row.update(
                onnx_eager_ms=r["before"]["latency_ms"]["p50"],
                opfuse_ms=r["after"]["latency_ms"]["p50"],
                kernels_before=r["kernels"]["before"],
                kernels_after=r["kernels"]["after"],
                launches_measured_before=r["before"]["kernel_launches_measured"],
                launches_measured_after=r["after"]["kernel_launches_measured"],
                peak_mem_before=r["before"]["peak_memory_bytes"],
                peak_mem_after=r["after"]["peak_memory_bytes"],
                verified=r["verification"]["passed"],
                groups=len(r["fusion"]["groups"]),
                rel_l2=max((o["rel_l2_err"] for o in r["verification"]["outputs"].values()), default=None),
                baseline_rel_l2=max(
                    (o.get("baseline_rel_l2_err", 0.0) for o in r["verification"]["outputs"].values()),
                    default=0.0,
                ),
                vacuous=any(
                    "atol alone" in o.get("reason", "") for o in r["verification"]["outputs"].values()
                ),
                tuning=(r.get("tuning") or {}).get("summary"),
            )
        except Exception as exc:
            row["opfuse_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            traceback.print_exc()
    row["peers"] = peers(zm, precision, iters, warmup, modes)
    return row


def _stages(report: dict[str, Any]) -> dict[str, Any]:
    """Where a compile's seconds went: its stages, and the parallel kernel compile within tuning."""
    tuning = report.get("tuning") or {}
    return {
        **report.get("timings_s", {}),
        **{f"tuning_{k}": tuning[k] for k in ("compile_s", "compile_workers", "cache_hits") if k in tuning},
    }


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan


def _mb(nbytes: Any) -> str:
    return f"{nbytes / 2**20:.0f}" if isinstance(nbytes, (int, float)) else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    hdr = (
        f"{'model':<20}{'b':>4} {'prec':<5}{'onnx-eager':>11}{'opfuse':>9}{'eager':>8}{'eager+G':>9}"
        f"{'tc':>8}{'tc+G':>8}{'vs tc+G':>8}{'x onnx':>7}{'kern b/a':>11}{'peak MB b/a':>13}"
        f"{'compile s':>10}{'warm s':>7}{'tc s':>6}"
    )
    print(hdr)
    ratios = []
    for r in rows:
        p = r.get("peers", {})

        def ms(key: str, p: dict[str, Any] = p) -> float:
            return float(p.get(key, {}).get("ms", math.nan))

        tcg = ms("torch_compile_cudagraph")
        ours = r.get("opfuse_ms", math.nan)
        ratio = ours / tcg if tcg == tcg and ours == ours else math.nan
        if ratio == ratio and r.get("verified") is not False and not r.get("vacuous"):
            ratios.append(ratio)
        print(
            f"{r['model']:<20}{r['batch']:>4} {r['precision']:<5}{r.get('onnx_eager_ms', math.nan):>11.3f}"
            f"{ours:>9.3f}{ms('eager'):>8.3f}{ms('eager_cudagraph'):>9.3f}{ms('torch_compile'):>8.3f}{tcg:>8.3f}"
            f"{ratio:>8.2f}{r.get('onnx_eager_ms', math.nan) / ours:>7.1f}"
            f"{str(r.get('kernels_before')) + '/' + str(r.get('kernels_after')):>11}"
            f"{_mb(r.get('peak_mem_before')) + '/' + _mb(r.get('peak_mem_after')):>13}"
            f"{_num(r.get('opfuse_compile_s')):>10.1f}"
            f"{_num(r.get('opfuse_warm_compile_s')):>7.1f}"
            f"{float(p.get('torch_compile', {}).get('compile_s', math.nan)):>6.0f}"
        )
        if r.get("verified") is False:
            print(
                f"    UNVERIFIED: opfuse's output differs from onnxruntime (rel L2 {r.get('rel_l2')}); not a result"
            )
        if r.get("baseline_rel_l2"):
            print(
                f"    verified against the unfused plan's own {r['precision']} error: rel L2 {r.get('rel_l2'):.4f}, "
                f"unfused {r['baseline_rel_l2']:.4f} (both against onnxruntime in fp32)"
            )
        if r.get("vacuous"):
            print("    VACUOUS: verified only because the reference output is ~0; not a result")
        spent = (r.get("tuning") or {}).get("budget_spent", 0)
        if spent:
            print(
                f"    untuned: the tuning budget ran out before {spent} of {r['tuning']['kernels']} kernels"
            )
        if "opfuse_error" in r:
            print(f"    opfuse error: {r['opfuse_error'][:200]}")
    if ratios:
        print(
            f"geometric mean opfuse / (torch.compile + CUDA graph): {math.exp(np.mean(np.log(ratios))):.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--compile-modes", default="default", help="torch.compile modes, e.g. default,max-autotune"
    )
    ap.add_argument("--out", default="bench/out/results.json")
    ap.add_argument("--tune-budget", type=float, default=60.0, help="opfuse tuning seconds per model")
    ap.add_argument(
        "--disable", default="", help="opfuse fusion/pass rules to disable, comma-separated (A/B runs)"
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="compile each model twice and benchmark the second (warm tuning and Triton caches); "
        "the table shows both compile times",
    )
    ap.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="spread the rows over this many GPUs of the machine (one process each, in one run); "
        "the merged table is printed at the end",
    )
    ap.add_argument("--shard", default="", help=argparse.SUPPRESS)  # i/n: the rows of one GPU process
    ap.add_argument(
        "--print",
        nargs="+",
        metavar="JSON",
        help="print one table from the results files of earlier runs (e.g. one per GPU) and exit",
    )
    args = ap.parse_args()
    if args.print:
        merged: list[dict[str, Any]] = []
        for path in args.print:
            with open(path) as f:
                data = json.load(f)
            print(json.dumps(data["meta"]))
            merged += data["rows"]
        print_table(merged)
        return
    global TUNE_BUDGET_S, WARM, DISABLE
    TUNE_BUDGET_S = args.tune_budget
    WARM = args.warm
    DISABLE = [x for x in args.disable.split(",") if x]
    if not torch.cuda.is_available():
        sys.exit("bench/run.py needs a CUDA GPU")
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "opfuse": opfuse.__version__,
        "commit": commit(),
        "opfuse_source": source_digest(),  # names the code even where git's HEAD is stale
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
    }
    todo = [
        (name, int(batch), precision)
        for name in args.models.split(",")
        for batch in args.batches.split(",")
        for precision in args.precision.split(",")
    ]
    if args.gpus > 1:
        _run_shards(args.gpus, args.out, todo)
        return
    if args.shard:
        i, n = (int(v) for v in args.shard.split("/"))
        todo = shard_rows(todo, n)[i]
    rows: list[dict[str, Any]] = []
    for name, batch, precision in todo:
        print(f"--- {name} batch {batch} {precision}", flush=True)
        try:
            rows.append(
                bench_one(name, batch, precision, args.iters, args.warmup, args.compile_modes.split(","))
            )
        except Exception as exc:
            traceback.print_exc()
            rows.append({"model": name, "batch": batch, "precision": precision, "error": repr(exc)[:300]})
        torch.cuda.empty_cache()
        # Each row is kept as soon as it is measured: a run cut short still leaves its rows.
        _write(args.out, meta, rows)
        print_table(rows[-1:])
    print(json.dumps(meta))
    print_table(rows)


# Rough relative cost of a row (export, compile, peers): transformers export slowly, fp32 and
# batch 32 time longer. Used only to balance the GPUs of one run.
_COST = {"cnn": 1.0, "transformer": 1.6}


def shard_rows(todo: list[tuple[str, int, str]], n: int) -> list[list[tuple[str, int, str]]]:
    """Deal the rows to `n` processes, costliest first, each to the least loaded (LPT)."""

    def cost(row: tuple[str, int, str]) -> float:
        name, batch, precision = row
        kind = (
            "cnn"
            if name in ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny")
            else "transformer"
        )
        return _COST[kind] * (1.3 if batch > 1 else 1.0) * (1.2 if precision == "fp32" else 1.0)

    shards: list[list[tuple[str, int, str]]] = [[] for _ in range(n)]
    load = [0.0] * n
    for row in sorted(todo, key=cost, reverse=True):
        i = load.index(min(load))
        shards[i].append(row)
        load[i] += cost(row)
    return shards


def _run_shards(n: int, out: str, todo: list[tuple[str, int, str]]) -> None:
    """One process per GPU (CUDA_VISIBLE_DEVICES), all at once; then the merged table."""
    base: list[str] = []
    skip = False
    for a in sys.argv[1:]:  # the same command without --gpus (as "--gpus N" or "--gpus=N")
        if skip:
            skip = False
        elif a == "--gpus":
            skip = True
        elif not a.startswith("--gpus="):
            base.append(a)
    stem, ext = os.path.splitext(out)
    outs = [f"{stem}.gpu{i}{ext or '.json'}" for i in range(n)]
    procs = []
    for i in range(n):
        cmd = [sys.executable, sys.argv[0], *base, "--shard", f"{i}/{n}", "--out", outs[i]]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i)}
        with open(f"{stem}.gpu{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    for p in procs:
        p.wait()
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    for path in outs:
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            meta = meta or data["meta"]
            rows += data["rows"]
    order = {row: i for i, row in enumerate(todo)}
    rows.sort(key=lambda r: order.get((r["model"], r["batch"], r["precision"]), len(order)))
    meta = {**meta, "command": " ".join(sys.argv), "gpus": n}
    _write(out, meta, rows)
    print(json.dumps(meta))
    print_table(rows)


def _write(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def source_digest() -> str:
    """sha256 over opfuse's Python sources (paths and contents), first 12 hex digits."""
    root = os.path.dirname(os.path.abspath(opfuse.__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


if __name__ == "__main__":
    main()
