"""The child process that runs one job: opfuse.compile → benchmark (CUDA only) → bundle + report.

    python -m workers.pipeline --model M --options-json J --out DIR [--memory-limit-bytes N]
                               [--limits-json L]

It also runs forked from the worker's forkserver (`run_forked`), with progress over a pipe.
The model is untrusted: before anything else the process caps its own memory (an rlimit), then
reads and checks the model under a time limit and against node-count, depth and tensor-size
limits (workers.limits), and only then compiles. stdout carries only progress, one JSON object per
line: {"stage": ..., "progress": ...}. At the end DIR holds bundle.zip and report.json (written
last), or error.json {error, kind: "model"|"memory"|"bug"|"internal"}. The worker kills this process
(its whole process group) on cancel, lease loss or timeout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TextIO

from opfuse.errors import ModelError
from workers.limits import (
    GiB,
    MemoryLimitError,
    ModelLimits,
    apply_memory_limit,
    check_model_limits,
    read_model_proto,
    time_limit,
)

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


@dataclass
class PipelineOptions:
    """The job's options (the JobCreate body) as `opfuse.compile` arguments."""

    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    precision: str = "fp32"
    fusion_disable: list[str] = field(default_factory=list)
    rtol: float | None = None
    atol: float | None = None
    device: str | None = None  # None: cuda when available, else cpu

    @classmethod
    def from_job(cls, options: Mapping[str, Any]) -> PipelineOptions:
        shapes = options.get("input_shapes") or {}
        if not isinstance(shapes, Mapping):
            raise ModelError("input_shapes must map input names to lists of ints")
        try:
            input_shapes = {str(k): [int(d) for d in v] for k, v in shapes.items()}
        except (TypeError, ValueError):
            raise ModelError(f"input_shapes must map input names to lists of ints, got {shapes!r}") from None
        precision = str(options.get("precision") or "fp32")
        if precision not in PRECISIONS:
            raise ModelError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        fusion = options.get("fusion") or {}
        verify = options.get("verify") or {}
        target = options.get("target")
        device = None
        if isinstance(target, str) and target.split(":")[0] in ("cpu", "cuda"):
            device = target.split(":")[0]
        elif isinstance(target, Mapping) and str(target.get("device", "")).split(":")[0] in ("cpu", "cuda"):
            device = str(target["device"]).split(":")[0]
        return cls(
            input_shapes=input_shapes,
            precision=precision,
            fusion_disable=[str(r) for r in fusion.get("disable") or []],
            rtol=_float_or_none(verify.get("rtol")),
            atol=_float_or_none(verify.get("atol")),
            device=device,
        )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays, paths and the like, as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, default=_jsonable))
    os.replace(tmp, path)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the worker dies, so no orphan keeps the GPU busy."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


class ProgressReporter:
    """Writes {"stage", "progress"} lines to the worker, flushed, skipping exact repeats."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._last: tuple[str, float] | None = None

    def __call__(self, stage: str, progress: float) -> None:
        # Overall progress only moves forward, whatever order the stages report in.
        floor = self._last[1] if self._last else 0.0
        current = (stage, max(floor, round(min(max(float(progress), 0.0), 1.0), 4)))
        if current == self._last:
            return
        self._last = current
        self._stream.write(json.dumps({"stage": current[0], "progress": current[1]}) + "\n")
        self._stream.flush()


def check_untrusted_model(
    model: Path, options: PipelineOptions, limits: ModelLimits, memory_limit_bytes: int | None
) -> None:
    """Read the model and check it against the worker's limits, in `limits.load_timeout_s`."""
    with time_limit(limits.load_timeout_s, "reading and checking the model"):
        proto = read_model_proto(model, limits)
        check_model_limits(proto, options.input_shapes, limits, memory_limit_bytes)


def run_pipeline(
    model: Path,
    options: PipelineOptions,
    out: Path,
    progress: ProgressReporter,
    limits: ModelLimits | None = None,
    memory_limit_bytes: int | None = None,
) -> None:
    """Check the model against the limits, then compile, verify, benchmark on a GPU, and write
    bundle.zip then report.json into `out`."""
    progress("loading", 0.0)
    check_untrusted_model(model, options, limits or ModelLimits(), memory_limit_bytes)

    import torch

    import opfuse

    cuda = torch.cuda.is_available()
    device = options.device or ("cuda" if cuda else "cpu")
    cm = opfuse.compile(
        str(model),
        input_shapes=options.input_shapes,
        precision=options.precision,
        device=device,
        fusion_disable=options.fusion_disable,
        rtol=options.rtol,
        atol=options.atol,
        verify=True,
        progress=progress,
    )
    if device == "cuda" and cuda:
        progress("benchmarking", 0.96)
        cm.benchmark()
    progress("packaging", 0.98)
    cm.save(out / "bundle.zip")
    _write_json(out / "report.json", cm.report)
    progress("packaging", 1.0)


def _cuda_possible() -> bool:
    """Whether this process may use a GPU: the worker sets CUDA_VISIBLE_DEVICES="" for CPU jobs."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")


_OOM_WORDS = ("can't allocate memory", "cannot allocate memory", "out of memory", "std::bad_alloc")


def _is_out_of_memory(exc: BaseException) -> bool:
    # torch's CPU allocator raises RuntimeError, not MemoryError, when the rlimit is reached.
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _OOM_WORDS)
    )


def _out_of_memory_message(exc: BaseException, memory_limit_bytes: int | None) -> str:
    detail = f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else 'allocation failed'})"
    if "cuda" in str(exc).lower():
        return (
            f"the job ran out of GPU memory {detail}; try smaller input shapes or a lower precision, "
            "or target a GPU kind with more memory"
        )
    limit = (
        f"this worker's limit of {memory_limit_bytes / GiB:g} GB per job (--job-memory-gb)"
        if memory_limit_bytes
        else "the memory of this machine"
    )
    return (
        f"the job ran out of memory: it needs more than {limit} {detail}; try smaller input shapes "
        "or a lower precision, or ask the operator for workers with more memory"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.pipeline", description=__doc__)
    parser.add_argument("--model", required=True, type=Path, help="the ONNX file")
    parser.add_argument("--options-json", required=True, help="the job's options (JobCreate body) as JSON")
    parser.add_argument("--out", required=True, type=Path, help="directory for bundle.zip / report.json")
    parser.add_argument(
        "--memory-limit-bytes", type=int, default=None, help="cap this process's memory (rlimit)"
    )
    parser.add_argument("--limits-json", default=None, help="workers.limits.ModelLimits fields as JSON")
    return parser


def limits_json(limits: ModelLimits) -> str:
    """`limits` as the --limits-json argument."""
    return json.dumps(asdict(limits))


class _ConnectionStream:
    """A write-only text stream onto a multiprocessing pipe: each progress line is one message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def write(self, text: str) -> int:
        self._conn.send_bytes(text.encode())
        return len(text)

    def flush(self) -> None:
        return None


def run_forked(argv: list[str], stderr_path: str, progress_conn: Connection) -> None:
    """The pipeline in a child forked from the worker's forkserver (workers.child.ForkedPipeline):
    its own process group, stdout and stderr into `stderr_path`, progress over `progress_conn`."""
    os.setsid()  # its own process group, which the worker kills as a whole
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, sys.stdout.fileno())
    os.dup2(fd, sys.stderr.fileno())
    os.close(fd)
    sys.exit(main(argv, progress_stream=_ConnectionStream(progress_conn)))


def main(argv: list[str] | None = None, progress_stream: Any = None) -> int:
    """Run one job; `progress_stream` (a text stream) replaces stdout for progress lines."""
    args = build_parser().parse_args(argv)

    _die_with_parent()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    memory_limit: int | None = args.memory_limit_bytes
    if memory_limit:
        # First, before the model (or, in a new process, torch) takes any memory.
        try:
            apply_memory_limit(memory_limit, cuda=_cuda_possible())
        except MemoryLimitError as exc:
            _write_json(out / "error.json", {"error": f"internal error: {exc}", "kind": "internal"})
            return 1
    if progress_stream is None:
        # Progress owns the real stdout; anything else printed (by libraries) goes to stderr.
        progress_stream = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    progress = ProgressReporter(progress_stream)

    try:
        limits = ModelLimits(**json.loads(args.limits_json)) if args.limits_json else ModelLimits()
        options = PipelineOptions.from_job(json.loads(args.options_json))
        run_pipeline(args.model, options, out, progress, limits, memory_limit)
    except ModelError as exc:
        _write_json(out / "error.json", {"error": str(exc), "kind": "model"})
        return 2
    except (MemoryError, RuntimeError) as exc:
        if not _is_out_of_memory(exc):
            return _internal_error(out, exc)
        _write_json(
            out / "error.json", {"error": _out_of_memory_message(exc, memory_limit), "kind": "memory"}
        )
        return 3
    except Exception as exc:
        return _internal_error(out, exc)
    return 0


# Words of an error that the host, not the model or opfuse, caused: another attempt (on another
# worker) may succeed.
_HOST_FAULT_WORDS = ("cuda error", "cuda driver", "no cuda-capable device", "cudaerror", "nccl error")


def is_host_fault(exc: BaseException) -> bool:
    """An infrastructure fault (the file system, the GPU's driver or context), worth a retry;
    anything else an internal exception raises is deterministic: the same job fails the same way."""
    return isinstance(exc, OSError) or any(w in str(exc).lower() for w in _HOST_FAULT_WORDS)


def _internal_error(out: Path, exc: BaseException) -> int:
    """error.json for an exception opfuse did not raise on purpose: kind "internal" (retried) for
    a host fault, else kind "bug" (not retried), which says it is a bug in opfuse."""
    traceback.print_exception(exc)
    first = (str(exc).strip().splitlines() or [""])[0][:500]
    if is_host_fault(exc):
        error = {
            "error": f"internal error on this worker's host: {type(exc).__name__}: {first}",
            "kind": "internal",
        }
    else:
        error = {
            "error": f"internal error: a bug in opfuse ({type(exc).__name__}: {first}); retrying will not "
            "help: please report it with the model",
            "kind": "bug",
        }
    _write_json(out / "error.json", error)
    return 1


if __name__ == "__main__":
    sys.exit(main())
