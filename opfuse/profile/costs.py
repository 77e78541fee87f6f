"""Bytes and FLOPs of each step, from shapes; measured time joins them in the report."""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.runtime.plan import Plan, Step

_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# FLOP per byte above which a step is compute-bound (peak FLOP/s over memory bandwidth, H200-class
# datasheet figures: fp32 67 TFLOP/s, tf32 495, fp16/bf16 990 over 4.8 TB/s).
RIDGE_FLOP_PER_BYTE = {"fp32": 14.0, "tf32": 103.0, "fp16": 206.0, "bf16": 206.0}


def _nbytes(plan: Plan, name: str) -> int:
    spec = plan.values.get(name)
    if spec is None:
        return 0
    return spec.numel * _ITEMSIZE.get(spec.dtype, 4)


def _flops(plan: Plan, step: Step) -> int:
    def shape(name: str) -> tuple[int, ...]:
        spec = plan.values.get(name)
        return spec.shape if spec else ()

    out = shape(step.outputs[0]) if step.outputs and step.outputs[0] else ()
    out_numel = int(np.prod(out, dtype=np.int64)) if out else 1
    if step.kind == "op" and step.op_type in ("MatMul", "Gemm"):
        a = shape(step.inputs[0])
        k = a[-1] if a else 1
        if step.op_type == "Gemm" and step.attrs.get("transA", 0) and len(a) == 2:
            k = a[0]
        return 2 * out_numel * k
    if step.kind == "op" and step.op_type == "Conv":
        w = shape(step.inputs[1])
        return 2 * out_numel * int(np.prod(w[1:], dtype=np.int64)) if w else 0
    if step.kind == "kernel":
        group_ops = len(plan.kernels[step.kernel].source.split("  # n")) - 1
        return out_numel * max(1, group_ops)
    return out_numel


def step_cost(plan: Plan, step: Step) -> dict[str, Any]:
    nbytes = sum(_nbytes(plan, x) for x in step.inputs if x) + sum(
        _nbytes(plan, o) for o in step.outputs if o
    )
    if step.kind == "op" and step.launches == 0:
        nbytes = 0  # a view moves nothing
    flops = _flops(plan, step)
    intensity = flops / nbytes if nbytes else 0.0
    ridge = RIDGE_FLOP_PER_BYTE.get(plan.precision, 14.0)
    return {
        "bytes": int(nbytes),
        "flops": int(flops),
        "intensity": round(intensity, 3),
        "bound": "compute" if intensity > ridge else "memory",
    }


def profile_steps(plan: Plan, times_ms: list[float]) -> list[dict[str, Any]]:
    rows = []
    for step, t in zip(plan.steps, times_ms, strict=False):
        row: dict[str, Any] = {
            "node": step.label,
            "op_type": step.op_type if step.kind == "op" else "FusedKernel",
            "time_ms": round(t, 6),
        }
        row.update(step_cost(plan, step))
        rows.append(row)
    return rows
