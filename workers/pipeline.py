"""The child process that runs one job: opfuse.compile → benchmark (CUDA only) → bundle + report.

    python -m workers.pipeline --model M --options-json J --out DIR

stdout carries only progress, one JSON object per line: {"stage": ..., "progress": ...}. At the end
DIR holds bundle.zip and report.json (written last), or error.json {error, kind: "model"|"internal"}.
The worker kills this process (its whole process group) on cancel, lease loss or timeout.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from opfuse.errors import ModelError

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


def run_pipeline(model: Path, options: PipelineOptions, out: Path, progress: ProgressReporter) -> None:
    """Compile, verify, benchmark on a GPU, and write bundle.zip then report.json into `out`."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.pipeline", description=__doc__)
    parser.add_argument("--model", required=True, type=Path, help="the ONNX file")
    parser.add_argument("--options-json", required=True, help="the job's options (JobCreate body) as JSON")
    parser.add_argument("--out", required=True, type=Path, help="directory for bundle.zip / report.json")
    args = parser.parse_args(argv)

    _die_with_parent()
    # Progress owns the real stdout; anything else printed (by libraries) goes to stderr.
    progress_stream = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    progress = ProgressReporter(progress_stream)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        options = PipelineOptions.from_job(json.loads(args.options_json))
        run_pipeline(args.model, options, out, progress)
    except ModelError as exc:
        _write_json(out / "error.json", {"error": str(exc), "kind": "model"})
        return 2
    except Exception as exc:
        traceback.print_exc()
        _write_json(
            out / "error.json",
            {"error": f"internal error: {type(exc).__name__}: {exc}", "kind": "internal"},
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
