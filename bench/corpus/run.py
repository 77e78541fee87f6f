"""The corpus's CPU leg: export every row both ways, compile it with opfuse, verify it in the interpreter.

    PYTHONPATH=. python -m bench.corpus.run                          # every row not in the file yet
    PYTHONPATH=. python -m bench.corpus.run --rows 'timm/*' --force  # rerun some rows
    PYTHONPATH=. python -m bench.corpus.run --shard 0/2 &  PYTHONPATH=. python -m bench.corpus.run --shard 1/2
    PYTHONPATH=. python -m bench.corpus.run --check-plans --rows 'timm/*'  # plans against the file, fast

For each row and exporter (`dynamo`: `torch.onnx.export(m, args, path)` with its defaults, which
writes the weights beside the model as external data; `torchscript`: the same with dynamo=False):
export into a temporary folder, `onnx.load` it (with its data), `opfuse.compile(..., device="cpu")`
(Triton's interpreter), and keep what opfuse's report says: verified against onnxruntime, launches
per compute node, fused coverage; and what the compile raised, as one line. Each model runs in a
subprocess of its own with a time limit, so a crash or a hang of one row never stops the run. The
results file (bench/corpus/expected.csv) is rewritten after every row, sorted, under a lock: shards
can share it, and a run cut short keeps what it measured. Rows already in it are skipped (--force
reruns them); rows of the registry not run yet are listed with status "not_run".

--check-plans compiles nothing and writes nothing: it exports and plans each selected row
(bench/corpus/plans.py) and compares the planned launches with the file's.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import functools
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = os.path.join(HERE, "expected.csv")
EXPORTERS = ("dynamo", "torchscript")
# The file's columns, in order. The GPU leg (bench/corpus/gpu.py) fills the last nine.
COLUMNS = [
    "model",
    "family",
    "exporter",
    "status",
    "exported",
    "compiled",
    "verified",
    "gpu_only_verify",
    "compute_nodes",
    "anchors",
    "launches",
    "launches_per_node",
    "fused_coverage",
    "unsupported_ops",
    "rel_l2",
    "cuda_graph",
    "export_s",
    "compile_s",
    "error",
    "cpu_commit",
    "ms_b1",
    "ms_b32",
    "ratio_torch_compile",
    "ratio_per_op",
    "gpu_verified",
    "gpu_graph",
    "gpu_compile_s",
    "gpu_date",
    "gpu_commit",
]
GPU_COLUMNS = COLUMNS[-9:]
# status: ok (compiled and verified), compiled (gpu_only_verify: compiled, verified on the GPU),
# not_verified (compiled, verification failed), export_failed, unsupported (opfuse refused an op it
# lacks), model_error (opfuse refused the model for another reason), crash (the compile raised
# something else: an internal error), timeout, not_run.
STATUSES = (
    "ok",
    "compiled",
    "not_verified",
    "export_failed",
    "unsupported",
    "model_error",
    "crash",
    "timeout",
    "not_run",
)
ROW_TIMEOUT_S = 900.0
# Compute-bound ops, each a kernel (or, for the recurrent layers, a library call) of its own that
# no fusion rule merges with another: the launch target is at most these plus a tenth of the
# compute nodes.
ANCHOR_OPS = frozenset(
    {
        "MatMul",
        "Gemm",
        "Conv",
        "ConvTranspose",
        "Attention",
        "Einsum",
        "opfuse.ConvNHWC",
        "LSTM",
        "GRU",
        "RNN",
    }
)


def one_line(exc: BaseException, limit: int = 240) -> str:
    """`Type: message` on one line, cut to `limit` characters (the file keeps reasons short)."""
    text = " ".join(str(exc).split())
    out = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."


@functools.cache
def register_torchscript_symbolics() -> None:
    """Teach the TorchScript exporter (dynamo=False) what transformers' decoders need and it lacks,
    the way users get past it: torch.onnx.register_custom_op_symbolic. Their masks look for packed
    sequences in position_ids (masking_utils.find_packed_sequence_indices) with torch.diff, which the
    exporter does not know ("Exporting the operator 'aten::diff' to ONNX ... is not supported"), and
    then `(diff != 1).cumsum(-1)`, which it exports as a CumSum of bools, invalid ONNX (torch sums
    bools as int64). Once per process; registered at opset 11 (Slice and Concat take negative axes),
    so the exporter's default opset (20) finds them too."""
    import torch
    from torch.onnx import symbolic_helper as sh
    from torch.onnx import symbolic_opset11

    @sh.parse_args("v", "i", "i", "v", "v")
    def diff(g: Any, x: Any, n: int, dim: int, prepend: Any, append: Any) -> Any:
        """torch.diff: concatenate prepend, x and append along dim, then x[1:] - x[:-1] along dim,
        n times."""
        if n < 1:
            raise NotImplementedError(f"aten::diff symbolic: n={n} is not supported (only n >= 1)")
        if sh._is_bool(x):
            raise NotImplementedError("aten::diff symbolic: bool inputs (logical_xor) are not supported")

        def ints(*v: int) -> Any:
            return g.op("Constant", value_t=torch.tensor(v, dtype=torch.int64))

        parts = [t for t in (prepend, x, append) if not sh._is_none(t)]
        out = g.op("Concat", *parts, axis_i=dim) if len(parts) > 1 else x
        for _ in range(n):
            hi = g.op("Slice", out, ints(1), ints(sys.maxsize), ints(dim))
            lo = g.op("Slice", out, ints(0), ints(-1), ints(dim))
            out = g.op("Sub", hi, lo)
        return out

    def cumsum(g: Any, x: Any, dim: Any, dtype: Any = None) -> Any:
        """The exporter's own cumsum, with bools cast to int64 first, as torch sums them."""
        if sh._is_bool(x) and sh._is_none(dtype):
            x = g.op("Cast", x, to_i=torch.onnx.TensorProtoDataType.INT64)
        return symbolic_opset11.cumsum(g, x, dim, dtype)

    torch.onnx.register_custom_op_symbolic("aten::diff", diff, 11)
    torch.onnx.register_custom_op_symbolic("aten::cumsum", cumsum, 11)


def export(module: Any, example: dict[str, Any], path: str, exporter: str) -> None:
    """The way users export: torch.onnx.export with its defaults (dynamo), or with dynamo=False (with
    the symbolics of register_torchscript_symbolics)."""
    import warnings

    import torch

    args = tuple(example.values())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(module, args, path)
        elif exporter == "torchscript":
            register_torchscript_symbolics()
            torch.onnx.export(module, args, path, dynamo=False)
        else:
            raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")


def coverage(report: dict[str, Any]) -> float | None:
    """The share of compute nodes inside fused groups: the report's own figure where it gives one,
    else counted from its groups."""
    fusion = report.get("fusion") or {}
    cov = fusion.get("coverage")
    if isinstance(cov, dict) and cov.get("share") is not None:
        return float(cov["share"])
    compute = report.get("compute_nodes")
    if not compute:
        return None
    fused = sum(len(g.get("nodes", [])) + len(g.get("prologue", [])) for g in fusion.get("groups", []))
    return round(min(1.0, fused / compute), 4)


def input_shapes(proto: Any, example: dict[str, Any]) -> dict[str, list[int]]:
    """The exported graph's inputs (those that are not weights) with the example's shapes, in order."""
    inits = {i.name for i in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    return {n: list(t.shape) for n, t in zip(names, example.values(), strict=False)}


def run_one(
    module: Any, example: dict[str, Any], exporter: str, workdir: str, verify: bool = True, audit: bool = True
) -> dict[str, Any]:
    """Export, load, compile and verify one model with one exporter; a dict of the file's columns
    (those the CPU leg fills). Never raises for the model's sake: what failed is in status/error.
    `audit`: run the plan once more under the CUDA-graph capture audit (opfuse/runtime/capture.py)
    and fill `cuda_graph` ("yes", or what would touch the host mid-run)."""
    import onnx

    import opfuse
    from opfuse.errors import ModelError
    from opfuse.frontend.unsupported import unsupported_ops
    from opfuse.runtime.ops import SUPPORTED_OPS

    out: dict[str, Any] = {"exporter": exporter, "exported": False, "compiled": False, "verified": False}
    path = os.path.join(workdir, f"{exporter}.onnx")
    t0 = time.perf_counter()
    try:
        export(module, example, path, exporter)
        proto = onnx.load(path)  # reads the external data beside it
    except Exception as exc:
        out.update(status="export_failed", error=one_line(exc), export_s=round(time.perf_counter() - t0, 1))
        return out
    out.update(exported=True, export_s=round(time.perf_counter() - t0, 1))
    missing = unsupported_ops(proto, SUPPORTED_OPS)
    out["unsupported_ops"] = " ".join(sorted(missing))
    shapes = input_shapes(proto, example)
    t0 = time.perf_counter()
    try:
        cm = opfuse.compile(proto, input_shapes=shapes, device="cpu", verify=verify)
    except ModelError as exc:
        status = "unsupported" if "does not support" in str(exc) else "model_error"
        error = one_line(exc)
        refused = _onnxruntime_refuses(path) if status == "model_error" else None
        if refused is not None:  # the exporter wrote an invalid model: not opfuse's to compile
            status, error = "export_failed", f"the export is invalid (onnxruntime refuses it too: {refused})"
        out.update(status=status, error=error, compile_s=round(time.perf_counter() - t0, 1))
        return out
    except Exception as exc:
        traceback.print_exc()
        out.update(status="crash", error=one_line(exc), compile_s=round(time.perf_counter() - t0, 1))
        return out
    out["compile_s"] = round(time.perf_counter() - t0, 1)
    r = cm.report
    ver = r.get("verification") or {}
    errs = [o.get("rel_l2_err") for o in (ver.get("outputs") or {}).values()]
    errs = [float(e) for e in errs if isinstance(e, (int, float))]
    compute = r.get("compute_nodes") or 0
    launches = (r.get("kernels") or {}).get("after")
    out.update(
        compiled=True,
        verified=bool(ver.get("passed")) if verify else False,
        compute_nodes=compute,
        anchors=sum(1 for op in (r.get("profile") or {}).get("ops", []) if op.get("op_type") in ANCHOR_OPS),
        launches=launches,
        launches_per_node=round(launches / compute, 4) if compute and launches is not None else None,
        fused_coverage=coverage(r),
        rel_l2=f"{max(errs):.2e}" if errs else None,
    )
    if audit:
        out["cuda_graph"] = capture_column(cm, shapes)
    if not verify:
        out["status"] = "compiled"
    elif out["verified"]:
        out["status"] = "ok"
    else:
        bad = [k for k, o in (ver.get("outputs") or {}).items() if not o.get("passed", True)]
        out.update(status="not_verified", error=f"verification failed on {bad or 'its outputs'}")
    return out


def _onnxruntime_refuses(path: str) -> str | None:
    """Why onnxruntime cannot load the exported model (one line), or None where it can."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as exc:
        text = one_line(exc, 400)
        return text.split(" failed:", 1)[-1].strip()[:200]  # past "Load model from <tmp path>"
    return None


def capture_column(cm: Any, shapes: dict[str, list[int]]) -> str:
    """ "yes" where the plan can be one CUDA graph (no static blocker, and the audit of a run here
    finds no host read or host copy), else the first reason."""
    import numpy as np

    from opfuse.runtime.capture import audit, host_blockers
    from opfuse.runtime.executor import Executor
    from opfuse.verify.reference import random_inputs

    blockers = host_blockers(cm.plan)
    if blockers:
        return "no: " + blockers[0][:160]
    try:
        feeds = random_inputs(cm.plan.inputs, np.random.default_rng(0))
        found = audit(Executor(cm.plan, "cpu", host_copies=True), feeds)
    except Exception as exc:  # the audit is a measurement: its failure is a row's note, not a crash
        return "audit failed: " + one_line(exc, 160)
    return "yes" if not found else "no: " + found[0][:160]


# --- the results file -----------------------------------------------------------------------------


def read_rows(path: str) -> dict[tuple[str, str], dict[str, str]]:
    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        return {(r["model"], r["exporter"]): r for r in csv.DictReader(f)}


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isnan(v):
        return ""
    return str(v)


def write_rows(path: str, rows: Mapping[tuple[str, str], Mapping[str, Any]]) -> None:
    """Sorted by model then exporter, stable columns; written whole, then renamed into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        for key in sorted(rows):
            w.writerow({c: _cell(rows[key].get(c)) for c in COLUMNS})
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    # The lock lives outside the tree (one per results file), so the folder holds only the file.
    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    with open(os.path.join(tempfile.gettempdir(), f"opfuse-corpus-{digest}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def placeholder(row: Any, exporter: str) -> dict[str, Any]:
    return {
        "model": row.name,
        "family": row.family,
        "exporter": exporter,
        "status": "not_run",
        "gpu_only_verify": row.gpu_only_verify,
    }


def update(path: str, results: Iterable[dict[str, Any]], registry: Iterable[Any] = ()) -> None:
    """Merge `results` (each a row of the file) into the file; the GPU columns of a row are kept;
    every (row, exporter) of `registry` missing from the file is added as not_run."""
    with locked(path):
        rows: dict[tuple[str, str], dict[str, Any]] = dict(read_rows(path))
        for row in registry:
            for e in EXPORTERS:
                rows.setdefault((row.name, e), placeholder(row, e))
        for res in results:
            key = (res["model"], res["exporter"])
            old = rows.get(key, {})
            rows[key] = {**res, **{c: old.get(c) for c in GPU_COLUMNS if old.get(c)}}
        write_rows(path, rows)


def shard(items: list[Any], spec: str) -> list[Any]:
    """`i/n`: every n-th item from the i-th (0-based); '' keeps all."""
    if not spec:
        return items
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise SystemExit(
            f"--shard must look like 0/4 (shard index / number of shards), got {spec!r}"
        ) from None
    if not (n > 0 and 0 <= i < n):
        raise SystemExit(f"--shard {spec}: the index must be 0..{n - 1}")
    return items[i::n]


def interleave(rows: list[Any]) -> list[Any]:
    """CI rows first, then the families in turns (a run cut short has covered each of them)."""
    rank: dict[str, int] = {}
    keyed = []
    for r in rows:
        rank[r.family] = rank.get(r.family, -1) + 1
        keyed.append((not r.ci, rank[r.family], r.family, r.name, r))
    return [k[-1] for k in sorted(keyed, key=lambda k: k[:4])]


def todo(
    rows: list[Any], exporters: list[str], done: dict[tuple[str, str], dict[str, str]], force: bool
) -> list[tuple[Any, list[str]]]:
    """(row, exporters still to run) for each row that has any: a row is done once the file has it
    with any status but not_run."""
    out = []
    for row in rows:
        left = [
            e
            for e in exporters
            if force or done.get((row.name, e), {}).get("status", "not_run") in ("", "not_run")
        ]
        if left:
            out.append((row, left))
    return out


def commit() -> str:
    """$OPFUSE_COMMIT (a snapshot outside git), else git's HEAD of this checkout, marked
    "+changes" where opfuse/ differs from it (uncommitted work, or a copy of the working tree
    whose .git lags behind it, as on the device machine); "unknown" without either. A record's
    opfuse_source digest names the source exactly."""
    if os.environ.get("OPFUSE_COMMIT"):
        return os.environ["OPFUSE_COMMIT"]
    root = os.path.dirname(os.path.dirname(HERE))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=False, cwd=root
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = head and git("status", "--porcelain", "--untracked-files=no", "--", "opfuse")
    except OSError:
        return "unknown"
    return (head + "+changes" if changed else head) or "unknown"


# --- one model in a subprocess --------------------------------------------------------------------


def worker(name: str, exporters: list[str], result_path: str) -> None:
    """Build one row and run it with each exporter; one JSON line per exporter, as each ends."""
    import torch

    from bench.corpus.models import BY_NAME

    torch.set_num_threads(max(1, int(os.environ.get("OPFUSE_CORPUS_THREADS", "1"))))
    row = BY_NAME[name]
    base = {"model": row.name, "family": row.family, "gpu_only_verify": row.gpu_only_verify}
    try:
        module, example = row.build()
    except Exception as exc:
        traceback.print_exc()
        with open(result_path, "a") as f:
            for e in exporters:
                res = {
                    **base,
                    "exporter": e,
                    "status": "export_failed",
                    "error": "building: " + one_line(exc),
                }
                f.write(json.dumps(res) + "\n")
        return
    for e in exporters:
        # Inside the parent's folder: a row killed at its time limit leaves nothing behind.
        with tempfile.TemporaryDirectory(prefix="export-", dir=os.path.dirname(result_path) or None) as d:
            res = {**base, **run_one(module, example, e, d, verify=not row.gpu_only_verify)}
        with open(result_path, "a") as f:
            f.write(json.dumps(res) + "\n")
        print(json.dumps(res), flush=True)


def run_row(row: Any, exporters: list[str], timeout_s: float, log: Any) -> list[dict[str, Any]]:
    """The row in a subprocess; exporters it did not finish (a timeout, a crash of the process)
    get status timeout or crash."""
    with tempfile.TemporaryDirectory(prefix="opfuse-corpus-row-") as d:
        result = os.path.join(d, "result.jsonl")
        cmd = [sys.executable, "-m", "bench.corpus.run", "--worker", row.name]
        cmd += ["--exporter", ",".join(exporters), "--result", result]
        env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
        # As the test suite runs (tests/conftest.py): a kernel that reads what no kernel wrote fails.
        env.setdefault("OPFUSE_POISON_BUFFERS", "1")
        root = os.path.dirname(os.path.dirname(HERE))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
        status, why = "", ""
        try:
            rc = proc.wait(timeout=timeout_s)
            if rc != 0:
                status, why = "crash", f"the row's process exited with status {rc} (see the run's log)"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            status, why = "timeout", f"not finished in {timeout_s:.0f} s (--timeout)"
        results = []
        if os.path.exists(result):
            with open(result) as f:
                results = [json.loads(line) for line in f if line.strip()]
        got = {r["exporter"] for r in results}
        for e in exporters:
            if e not in got:
                res = placeholder(row, e)
                res.update(status=status or "crash", error=why or "the row's process wrote no result")
                res["compile_s"] = round(time.perf_counter() - t0, 1)
                results.append(res)
        return results


def _reason_key(row: Mapping[str, str]) -> str:
    """A failure's reason with the row's own names taken out, so like failures group together."""
    import re

    err = row.get("error", "")
    if row["status"] == "unsupported" and row.get("unsupported_ops"):
        return "unsupported ops: " + row["unsupported_ops"]
    # Node and tensor names (they hold a '/' or a digit) differ by row; op names stay.
    err = re.sub(r"'(?!aten::)[^']*[/\d][^']*'|\"(?!aten::)[^\"]*[/\d][^\"]*\"", "'…'", err)
    err = re.sub(r"\d+", "N", err)
    return err[:120]


def summary(path: str) -> str:
    """The file's figures: rows run, exported / compiled / verified shares, the geomean of launches
    per compute node over verified rows, and the failures grouped by status and reason."""
    rows = list(read_rows(path).values())
    ran = [r for r in rows if r["status"] not in ("", "not_run")]
    n_models = len({r["model"] for r in rows})
    lines = [f"{len(rows)} rows ({n_models} models, each with {', '.join(EXPORTERS)}), {len(ran)} run"]
    if not ran:
        return "\n".join(lines)

    def share(key: str) -> str:
        n = sum(r[key] == "true" for r in ran)
        return f"{n}/{len(ran)} ({100 * n / len(ran):.0f}%)"

    lines.append(f"exported {share('exported')}, compiled {share('compiled')}, verified {share('verified')}")
    compiled = [r for r in ran if r["compiled"] == "true"]
    if compiled:
        n_ok = sum(r["verified"] == "true" for r in compiled)
        lines.append(f"verified among compiled: {n_ok}/{len(compiled)}")
    lpn = [float(r["launches_per_node"]) for r in ran if r["verified"] == "true" and r["launches_per_node"]]
    if lpn:
        geo = math.exp(sum(math.log(max(v, 1e-9)) for v in lpn) / len(lpn))
        lines.append(f"launches per compute node, geomean over {len(lpn)} verified rows: {geo:.3f}")
    over = [
        f"{r['model']}[{r['exporter'][0]}] {r['launches']}>{r['anchors']}+{0.1 * int(r['compute_nodes']):.1f}"
        for r in ran
        if r["launches"]
        and r["anchors"]
        and r["compute_nodes"]
        and int(r["launches"]) > int(r["anchors"]) + 0.1 * int(r["compute_nodes"])
    ]
    if over:
        lines.append(
            f"launches above anchors + 10% of compute nodes: {len(over)} rows: " + ", ".join(over[:12])
        )
    cov = [float(r["fused_coverage"]) for r in ran if r["verified"] == "true" and r["fused_coverage"]]
    if cov:
        lines.append(f"fused coverage, mean over {len(cov)} verified rows: {sum(cov) / len(cov):.3f}")
    for exporter in EXPORTERS:
        sub = [r for r in ran if r["exporter"] == exporter]
        if sub:
            ok = sum(r["status"] == "ok" for r in sub)
            lines.append(f"  {exporter}: {ok}/{len(sub)} ok")
    lines += gpu_summary(rows)
    groups: dict[tuple[str, str], list[str]] = {}
    for r in ran:
        if r["status"] not in ("ok", "compiled"):
            groups.setdefault((r["status"], _reason_key(r)), []).append(f"{r['model']}[{r['exporter'][0]}]")
    lines.append("failures by reason:")
    for (status, why), names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        lines.append(f"  {len(names):3d} {status}: {why}\n        {shown}")
    return "\n".join(lines)


def _pair(cell: str) -> tuple[float, float] | None:
    """A GPU column's "batch 1/batch 32" as two numbers; None where either batch has none."""
    try:
        one, thirty_two = (float(x) for x in cell.split("/"))
    except ValueError:
        return None
    return one, thirty_two


def gpu_summary(rows: list[dict[str, str]], worst: int = 10, limit: float = 1.10) -> list[str]:
    """The GPU leg's figures, as the issue's targets name them: the rows timed at both batches and
    the geomean of their ratio to torch.compile + CUDA graph at each batch, the batches above
    `limit`, the rows slower than opfuse's own per-op plan, the `worst` rows by their larger
    ratio with the commit and date that measured them, and how many rows each of the newest
    commits measured."""
    timed = [(r, p) for r in rows if (p := _pair(r.get("ratio_torch_compile", ""))) is not None]
    if not timed:
        return []
    lines = []
    geo = [math.exp(sum(math.log(p[i]) for _, p in timed) / len(timed)) for i in (0, 1)]
    lines.append(
        f"GPU: {len(timed)} rows timed at both batches, ratio to torch.compile + CUDA graph geomean "
        f"{geo[0]:.3f} (b1) / {geo[1]:.3f} (b32)"
    )
    # A row without a ratio: its export failed (on the device's torch too), or the GPU leg's run
    # of it did (opfuse's compile, or the peer's: bench/RESULTS.md says which).
    untimed = [r for r in rows if r.get("gpu_commit") and _pair(r.get("ratio_torch_compile", "")) is None]
    for what, sub in (
        ("export failed", [r for r in untimed if r["status"] == "export_failed"]),
        ("no ratio from the GPU leg", [r for r in untimed if r["status"] != "export_failed"]),
    ):
        if sub:
            lines.append(f"  {what}: {len(sub)}: " + ", ".join(r["model"] for r in sub))
    above = [f"{r['model']} b{b} {p[i]:.3f}" for r, p in timed for i, b in ((0, 1), (1, 32)) if p[i] > limit]
    lines.append(f"  batches above {limit:.2f}: {len(above)}" + (f": {', '.join(above)}" if above else ""))
    slower = [r["model"] for r in rows if (p := _pair(r.get("ratio_per_op", ""))) and max(p) > 1.0]
    lines.append(
        f"  rows slower than opfuse's per-op plan: {len(slower)}"
        + (f": {', '.join(slower)}" if slower else "")
    )
    lines.append(f"  the {worst} worst (larger ratio first):")
    for r, p in sorted(timed, key=lambda rp: -max(rp[1]))[:worst]:
        lines.append(f"    {r['model']:<44} {p[0]:.3f}/{p[1]:.3f}  {r['gpu_commit']} {r['gpu_date']}")
    by_commit: dict[str, tuple[str, int]] = {}
    for r in rows:
        if r.get("gpu_commit"):
            date, n = by_commit.get(r["gpu_commit"], ("", 0))
            by_commit[r["gpu_commit"]] = (max(date, r.get("gpu_date", "")), n + 1)
    newest = sorted(by_commit.items(), key=lambda kv: kv[1], reverse=True)[:3]
    lines.append("  rows by GPU commit, newest first: " + ", ".join(f"{c} {n} ({d})" for c, (d, n) in newest))
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows", default="", help="comma-separated names or globs, e.g. 'timm/*,torchvision/resnet18'"
    )
    ap.add_argument("--family", default=None, help="timm, transformers or torchvision")
    ap.add_argument("--exporter", default=",".join(EXPORTERS), help="dynamo, torchscript or both (default)")
    ap.add_argument("--shard", default="", help="i/n: run every n-th row from the i-th")
    ap.add_argument(
        "--out",
        "--expected",
        dest="out",
        default=EXPECTED,
        help="the results file (default bench/corpus/expected.csv); --check-plans only reads it",
    )
    ap.add_argument("--force", action="store_true", help="rerun rows already in the file")
    ap.add_argument("--timeout", type=float, default=ROW_TIMEOUT_S, help="seconds per row and exporter")
    ap.add_argument("--list", action="store_true", help="print the selected rows and exit")
    ap.add_argument("--summary", action="store_true", help="print the file's figures and exit")
    ap.add_argument(
        "--check-plans",
        action="store_true",
        help="compile nothing: export and plan each selected row (seconds a row) and print its "
        "launches in the file, the planned launches and ok, differs or error (rows the file has as "
        "not compiled are skipped); exit 1 where any row differs or fails, never rewrite the file. "
        "A compile can keep fewer groups than the plan forms (groups rolled back or run unfused), "
        "so a row that differs is a row to run again (make corpus ROWS=...), not necessarily a bug",
    )
    ap.add_argument(
        "--run-alternatives",
        action="store_true",
        help="with --check-plans: also run each row's plan with every group in its alternative form "
        "(what tuning on the GPU may choose) on random inputs against onnxruntime; an error a "
        "compile's verification would not pass fails the row. gpu_only_verify rows are planned only",
    )
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # one row, in its own process
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    exporters = [e for e in args.exporter.split(",") if e]
    bad = [e for e in exporters if e not in EXPORTERS]
    if bad:
        raise SystemExit(f"--exporter: unknown {', '.join(bad)}; choose from {', '.join(EXPORTERS)}")
    if args.worker:
        worker(args.worker, exporters, args.result)
        return
    if args.summary:
        print(summary(args.out))
        return

    from bench.corpus.models import ROWS, select

    try:
        rows = select(args.rows.split(","), family=args.family)
    except KeyError as exc:
        raise SystemExit(str(exc.args[0])) from None
    if args.list:
        for r in rows:
            print(r.name)
        return
    if args.check_plans:
        from bench.corpus.plans import check_plans

        if not os.path.exists(args.out):
            raise SystemExit(f"--check-plans: {args.out} does not exist (--expected names the file)")
        rc = check_plans(
            shard(rows, args.shard), exporters, read_rows(args.out), run_alternatives=args.run_alternatives
        )
        if rc:
            raise SystemExit(rc)
        return
    update(args.out, [], ROWS)
    plan = shard(todo(interleave(rows), exporters, read_rows(args.out), args.force), args.shard)
    print(f"{len(plan)} rows to run ({sum(len(e) for _, e in plan)} row-exporters) -> {args.out}", flush=True)
    commit_id = commit()
    for i, (row, left) in enumerate(plan):
        t0 = time.perf_counter()
        print(f"--- [{i + 1}/{len(plan)}] {row.name} {','.join(left)}", flush=True)
        results = run_row(row, left, args.timeout * len(left), sys.stdout)
        for res in results:
            res["cpu_commit"] = commit_id
        update(args.out, results)
        said = ", ".join(f"{r['exporter']}: {r['status']}" for r in results)
        print(f"    {said} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
