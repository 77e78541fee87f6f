"""The corpus's GPU leg: opfuse against torch.compile + CUDA graph, fp16, batch 1 and 32, on one GPU.

    PYTHONPATH=. python -m bench.corpus.gpu --out bench/out/corpus-gpu.jsonl            # every row
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
poisoned CUDA context stops that row only. `--merge` fills the GPU columns of expected.csv (ms_b1,
ms_b32, ratio_torch_compile and ratio_per_op as "batch 1/batch 32", gpu_date, gpu_commit) for the
default exporter's rows.

This module imports nothing that needs a GPU until a row runs: its argument parsing, resume and
merge logic are tested on the CPU (tests/corpus/test_legs.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.corpus.run import EXPECTED, HERE, interleave, locked, one_line, read_rows, shard, write_rows

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


def read_done(paths: Iterable[str]) -> dict[tuple[str, int], dict[str, Any]]:
    """The measured (model, batch) of earlier runs' JSON lines; the last line of a key wins, and a
    line that is not JSON (a run killed mid-write) is skipped."""
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
    timings where the new lines hold none (a `--compile-only` run)."""
    by_model: dict[str, dict[int, dict[str, Any]]] = {}
    for (model, batch), rec in read_done(paths).items():
        by_model.setdefault(model, {})[batch] = rec
    filled = 0
    with locked(out):
        rows = read_rows(out)
        for model, recs in sorted(by_model.items()):
            key = (model, EXPORTER)
            if key not in rows:
                print(f"{model}: not a row of {out} (skipped)", file=sys.stderr)
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


def _compile_record(out_path: str, name: str, batch: int) -> dict[str, Any]:
    """The compile phase's line for this row and batch (`--jobs`), or {}."""
    return read_done([out_path + ".compile"]).get((name, batch), {}) if out_path else {}


def measure_row(
    name: str,
    batches: list[int],
    out_path: str,
    iters: int,
    warmup: int,
    tune_s: float,
    phase: str,
    export_dir: str,
    peer: bool = True,
) -> None:
    """One row's batches. phase "all": compile, verify and time; "compile": compile, verify and
    capture the CUDA graph once, and compile torch.compile's peer (`peer`), timing nothing (rows
    run in parallel: the caches warm up); "time": compile again with warm caches, then the timings
    (rows run one at a time). The timing pass does not verify again where the compile phase
    verified the same plan with no group rolled back (same plan: the same launches; its line
    carries that verification); otherwise it verifies as "all" does."""
    import onnx
    import torch

    import opfuse
    from bench.corpus.models import BY_NAME
    from bench.run import _commit, graphed, source_digest, time_cuda

    row = BY_NAME[name]
    module, example = row.build()
    meta = {
        "model": name,
        "precision": PRECISION,
        "exporter": EXPORTER,
        "phase": phase,
        "gpu": torch.cuda.get_device_name(0),
        "commit": os.environ.get("OPFUSE_COMMIT") or _commit(),
        "opfuse_source": source_digest(),
        "date": time.strftime("%Y-%m-%d"),
    }
    timed = phase != "compile"
    for batch in batches:
        rec: dict[str, Any] = {**meta, "batch": batch}
        t_row = time.perf_counter()
        try:
            ex = _batched(example, batch)
            proto = onnx.load(_exported(module, ex, name, batch, export_dir))
            inits = {i.name for i in proto.graph.initializer}
            names = [i.name for i in proto.graph.input if i.name not in inits]
            shapes = {n: list(t.shape) for n, t in zip(names, ex.values(), strict=False)}
            before = _compile_record(out_path, name, batch) if phase == "time" else {}
            reuse = bool(before.get("verified")) and not (before.get("verification") or {}).get("rolled_back")
            t0 = time.perf_counter()
            cm = opfuse.compile(
                proto,
                input_shapes=shapes,
                precision=PRECISION,
                device="cuda",
                tune_budget_s=tune_s,
                verify=not reuse,
            )
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            r = cm.report
            rec.update(
                verified=bool(r["verification"]["passed"]),
                kernels_before=r["kernels"].get("before"),
                kernels_after=r["kernels"]["after"],
                compute_nodes=r.get("compute_nodes"),
                cuda_graph_outlook=r.get("cuda_graph"),
                verification=_verification(r),
            )
            if reuse:  # the compile phase's verification of this plan stands, and its compile time
                same = before.get("kernels_after") == rec["kernels_after"]
                rec.update(
                    verified=same,
                    verification={**before.get("verification", {}), "in": "compile phase"},
                    compile_s=before.get("compile_s"),
                    warm_compile_s=rec["compile_s"],
                )
                if not same:
                    rec["verification"]["note"] = (
                        f"the timed plan has {rec['kernels_after']} launches, the verified one "
                        f"{before.get('kernels_after')}: not the plan that was verified"
                    )
            if timed:
                cm.benchmark(iters=iters, warmup=warmup)
                rec.update(
                    opfuse_ms=r["after"]["latency_ms"]["p50"],
                    stepwise_ms=(r.get("after_stepwise") or {}).get("latency_ms", {}).get("p50"),
                    per_op_ms=r["before"]["latency_ms"]["p50"],
                    cuda_graph=r["after"].get("cuda_graph"),
                    cuda_graph_error=r["after"].get("cuda_graph_error"),
                )
                rec["ratio_per_op"] = _ratio(rec["opfuse_ms"], rec["per_op_ms"])
            else:  # capture once: the plan runs as one CUDA graph, or the reason it cannot
                import numpy as np

                from opfuse.verify.reference import random_inputs

                cm.run(random_inputs(cm.plan.inputs, np.random.default_rng(5)))
                rec.update(captured=cm.cuda_graph_error is None, cuda_graph_error=cm.cuda_graph_error)
            del cm
            if timed or peer:
                rec.update(_torch_compile(module, ex, iters, warmup, graphed, time_cuda, timed))
            if timed:
                rec["ratio_torch_compile"] = _ratio(rec["opfuse_ms"], rec.get("torch_compile_cudagraph_ms"))
        except Exception as exc:
            traceback.print_exc()
            rec["error"] = one_line(exc, 400)
        rec["wall_s"] = round(time.perf_counter() - t_row, 1)
        torch.cuda.empty_cache()
        append_line(out_path, rec)
        print(json.dumps(rec), flush=True)


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


def _torch_compile(
    module: Any,
    example: dict[str, Any],
    iters: int,
    warmup: int,
    graphed: Any,
    time_cuda: Any,
    timed: bool = True,
) -> dict[str, Any]:
    """torch.compile + CUDA graph of the module itself, fp16, the inputs of bench/run.py's peers
    (`timed` False: compiled and run once, which fills inductor's caches for the timing pass)."""
    import torch

    gen = torch.Generator().manual_seed(3)
    m = module.cuda().half()

    def cast(d: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.cuda().half() if v.is_floating_point() else v.cuda()) for k, v in d.items()}

    static = cast(_fresh(example, gen))
    try:
        with torch.no_grad():
            torch._dynamo.reset()
            t0 = time.perf_counter()
            compiled = torch.compile(m)
            compiled(*static.values())
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            if not timed:
                return {"torch_compile_s": round(compile_s, 2)}
            replay = graphed(lambda: compiled(*static.values()))
            ms = time_cuda(lambda i: replay(), iters, warmup)
        return {"torch_compile_cudagraph_ms": ms, "torch_compile_s": round(compile_s, 2)}
    except Exception as exc:
        return {"torch_compile_error": one_line(exc, 300)}
    finally:
        module.cpu().float()


def run_row(
    name: str,
    batches: list[int],
    out_path: str,
    args: argparse.Namespace,
    phase: str = "all",
    deadline: float | None = None,
) -> None:
    """The row in a subprocess of its own, killed after --timeout seconds (a line per batch says
    so) or at `deadline` (time.monotonic(): the end of the call's share for this phase), which
    records nothing, so the next run takes the row again."""
    cmd = [sys.executable, "-m", "bench.corpus.gpu", "--worker", name, "--out", out_path, "--phase", phase]
    cmd += ["--export-dir", args.export_dir]
    cmd += [
        "--batches",
        ",".join(map(str, batches)),
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
    ]
    cmd += ["--tune-budget", str(args.tune_budget)]
    if args.compile_only:
        cmd.append("--compile-only")
    root = os.path.dirname(os.path.dirname(HERE))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    env.pop("TRITON_INTERPRET", None)
    if phase == "compile" and args.jobs > 1:
        env.setdefault("OPFUSE_COMPILE_WORKERS", str(max(1, (os.cpu_count() or 2) // args.jobs)))
    limit, cut = args.timeout, False
    if deadline is not None and deadline - time.monotonic() < limit:
        limit, cut = max(1.0, deadline - time.monotonic()), True
    try:
        rc = subprocess.run(cmd, env=env, cwd=root, timeout=limit, check=False).returncode
        why = f"the row's process exited with status {rc}" if rc else ""
    except subprocess.TimeoutExpired:
        if cut:
            print(f"{name}: stopped at the end of the {phase} phase (--stop-after); not recorded", flush=True)
            return
        why = f"not finished in {args.timeout:.0f} s (--timeout)"
    if not why:
        return
    got = read_done([out_path])
    for b in batches:
        if (name, b) not in got:
            append_line(
                out_path, {"model": name, "batch": b, "precision": PRECISION, "phase": phase, "error": why}
            )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="", help="comma-separated names or globs (default: every row)")
    ap.add_argument("--family", default=None, help="timm, transformers or torchvision")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--shard", default="", help="i/n: every n-th row from the i-th (one process per GPU)")
    ap.add_argument("--out", default="bench/out/corpus-gpu.jsonl", help="JSON lines, appended to")
    ap.add_argument("--force", action="store_true", help="measure rows already in --out again")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tune-budget", type=float, default=60.0, help="opfuse tuning seconds per model")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="N > 1: first compile N rows at once (no timing; caches warm up), then time them one at a time",
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
    ap.add_argument("--phase", default="all", choices=["all", "compile", "time"], help=argparse.SUPPRESS)
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
            peer=not args.compile_only,
        )
        return
    from bench.corpus.models import select

    try:
        names = [r.name for r in interleave(select(args.rows.split(","), family=args.family))]
    except KeyError as exc:
        raise SystemExit(str(exc.args[0])) from None
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/corpus/gpu.py measures on a CUDA GPU; on the CPU run bench/corpus/run.py")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    if args.new_only:
        done_rows = read_rows(args.expected)
        names = [n for n in names if not (done_rows.get((n, EXPORTER)) or {}).get("gpu_commit")]
    names = shard(names, args.shard)
    start = time.monotonic()
    stop = args.stop_after or math.inf
    # --stop-after S: with --jobs and timing, rows start compiling in the first half of S and are
    # cut at 0.6 S; the timings start before S. --compile-only: rows start before S.
    parallel = args.compile_only or args.jobs > 1
    compile_start, compile_end = (stop, None) if args.compile_only else (0.5 * stop, 0.6 * stop)

    def elapsed() -> float:
        return time.monotonic() - start

    ok: set[tuple[str, int]] | None = None
    if parallel:  # compile in parallel first, then time one row at a time on warm caches
        compile_out = args.out + ".compile"
        todo = pending(names, args.batches, {**read_done([compile_out]), **read_done([args.out])}, args.force)
        print(f"{len(todo)} rows to compile, {args.jobs} at once -> {compile_out}", flush=True)
        deadline = None if compile_end is None or math.isinf(compile_end) else start + compile_end

        def one(item: tuple[int, tuple[str, list[int]]]) -> None:
            i, (name, batches) = item
            if elapsed() < compile_start:
                print(f"--- compile [{i + 1}/{len(todo)}] {name} batches {batches}", flush=True)
                run_row(name, batches, compile_out, args, "compile", deadline)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, enumerate(todo)))
        if args.compile_only:
            return
        compiled = read_done([compile_out])
        ok = {k for k, rec in compiled.items() if "error" not in rec}
    plan = pending(names, args.batches, read_done([args.out]), args.force)
    if ok is not None:  # time what compiled; a compile's error is that batch's line
        plan = [(n, [b for b in bs if (n, b) in ok]) for n, bs in plan]
        plan = [(n, bs) for n, bs in plan if bs]
    phase = "time" if args.jobs > 1 else "all"
    print(f"{len(plan)} rows to measure -> {args.out}", flush=True)
    for i, (name, batches) in enumerate(plan):
        if elapsed() >= stop:
            break
        print(f"--- [{i + 1}/{len(plan)}] {name} batches {batches} at {elapsed():.0f} s", flush=True)
        run_row(name, batches, args.out, args, phase)


if __name__ == "__main__":
    main()
