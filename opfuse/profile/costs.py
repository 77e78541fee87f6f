"""Bytes and FLOPs of each step, from shapes; measured time joins them in the report."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

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

# The roofline's ridge point (FLOP per byte above which a step is compute-bound) is the device's
# peak FLOP/s for the precision over its memory bandwidth. Without a GPU to ask (the CPU
# interpreter), the H200 datasheet's dense figures stand in: fp16/bf16 989 TFLOP/s, tf32 494,
# fp32 67, over 4.8 TB/s (ridge ≈ 206, 103 and 14 FLOP/byte).
H200_PEAK_FLOPS = {"fp16": 989e12, "bf16": 989e12, "tf32": 494e12, "fp32": 67e12}
H200_BANDWIDTH = 4.8e12
# Dense FLOP per clock per SM by compute capability (tensor cores for fp16/bf16/tf32, FMA units
# for fp32): with the SM count and clock a GPU reports, its peaks. Hopper and A100 only; other
# GPUs fall back to the H200 figures, and the report says which was used.
FLOP_PER_CLOCK_PER_SM = {
    (9, 0): {"fp16": 4096, "bf16": 4096, "tf32": 2048, "fp32": 256},
    (8, 0): {"fp16": 2048, "bf16": 2048, "tf32": 1024, "fp32": 128},
}


@dataclass(frozen=True)
class DevicePeaks:
    name: str
    flops: dict[str, float]  # peak FLOP/s per precision
    bandwidth: float  # bytes/s
    source: str

    def ridge(self, precision: str) -> float:
        return self.flops.get(precision, self.flops["fp32"]) / self.bandwidth

    def to_json(self, precision: str) -> dict[str, Any]:
        return {
            "device": self.name,
            "source": self.source,
            "precision": precision,
            "peak_tflops": round(self.flops.get(precision, self.flops["fp32"]) / 1e12, 1),
            "bandwidth_tb_per_s": round(self.bandwidth / 1e12, 2),
            "ridge_flop_per_byte": round(self.ridge(precision), 1),
        }


H200_DEFAULT = DevicePeaks("H200 (datasheet defaults)", H200_PEAK_FLOPS, H200_BANDWIDTH, "defaults")


@lru_cache(maxsize=8)
def device_peaks(device: str | None = None) -> DevicePeaks:
    """Peaks of `device` ("cuda", "cuda:1"; None: the current GPU if there is one), read from
    torch.cuda's device properties; the H200 defaults where there is no GPU or the properties do
    not tell (older torch without clock rates, an unlisted architecture)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return H200_DEFAULT
    props = torch.cuda.get_device_properties(torch.device(device))
    per_sm = FLOP_PER_CLOCK_PER_SM.get((props.major, props.minor))
    clock_khz = getattr(props, "clock_rate", 0)
    mem_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not per_sm or not clock_khz or not mem_khz or not bus_bits:
        return DevicePeaks(props.name, H200_PEAK_FLOPS, H200_BANDWIDTH, "defaults (properties incomplete)")
    flops = {p: float(n) * props.multi_processor_count * clock_khz * 1e3 for p, n in per_sm.items()}
    bandwidth = 2.0 * mem_khz * 1e3 * bus_bits / 8  # double data rate
    return DevicePeaks(props.name, flops, bandwidth, "torch.cuda device properties")


def _nbytes(plan: Plan, name: str) -> int:
    spec = plan.values.get(name)
    if spec is None:
        return 0
    return spec.numel * _ITEMSIZE.get(spec.dtype, 4)


def _matmul_flops(op_type: str, a: tuple[int, ...], b: tuple[int, ...], attrs: dict[str, Any]) -> int:
    """2·M·N·K (times the batch) of a MatMul or Gemm with operands of shapes `a` and `b`."""
    if not a or not b:
        return 0
    if op_type == "Gemm" and len(a) == 2 and len(b) == 2:
        m, k = (a[1], a[0]) if attrs.get("transA", 0) else a
        n = b[0] if attrs.get("transB", 0) else b[1]
        return 2 * m * n * k
    k = a[-1]
    rows = a[-2] if len(a) > 1 else 1
    cols = b[-1] if len(b) > 1 else 1
    batch = np.broadcast_shapes(a[:-2], b[:-2]) if len(a) > 2 or len(b) > 2 else ()
    return 2 * int(np.prod(batch, dtype=np.int64)) * rows * cols * k


def _conv_flops(inputs: list[str], out_numel: int, shape: Any) -> int:
    """2·(output elements)·K, K = the weight's elements per output channel; a summed 1x1 shortcut
    (inputs 3, 4) adds its input channels to K."""
    if len(inputs) < 2 or not shape(inputs[1]):
        return 0
    k = sum(int(np.prod(shape(x)[1:], dtype=np.int64)) for x in inputs[1::3] if x and shape(x))
    return 2 * out_numel * k


_MATMULS = ("MatMul", "Gemm")
_CONVS = ("Conv", "opfuse.ConvNHWC")
# Nodes a kernel reads through (a conv's Pad and Transpose prologues: pad_prologue,
# layout_prologue): addressing, no arithmetic.
_READ_THROUGH = ("Transpose", "Pad")


def _spec_nodes(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The nodes of a kernel's spec (opfuse.codegen.spec's tagged JSON), its prologue's first
    (a depthwise conv or a GEMM a row kernel computes on its tiles, a pool on a GEMM's A tiles), as
    plain dicts: op_type, inputs, outputs, attrs; [] when the kernel has no spec."""
    part = (spec or {}).get("part")
    fields = part.get("v", {}) if isinstance(part, dict) else {}
    nodes = [*_listed(fields.get("prologue")), *_listed(fields.get("nodes"))]
    out = []
    for node in nodes:
        fields = node.get("v", {}) if isinstance(node, dict) else {}
        attrs = fields.get("attrs", {})
        attrs = attrs.get("v", {}) if isinstance(attrs, dict) and "$" in attrs else attrs
        out.append({**fields, "attrs": attrs if isinstance(attrs, dict) else {}})
    return out


def _listed(value: Any) -> list[Any]:
    """A spec field that holds a list: tagged ({"$": "list", "v": [...]}) or plain."""
    if isinstance(value, dict):
        value = value.get("v")
    return value if isinstance(value, list) else []


def _kernel_flops(plan: Plan, step: Step, out_numel: int, shape: Any) -> int:
    """A generated kernel's FLOPs: its GEMM or conv anchor's multiply-adds, plus one FLOP per
    output element for each other node (the epilogue, or a pointwise or row kernel's ops) but
    the layout ops it reads through."""
    kernel = plan.kernels[step.kernel]
    nodes = _spec_nodes(kernel.spec)
    if not nodes:  # a kernel without a spec: count its nodes from the source's node comments
        return out_numel * max(1, len(kernel.source.split("  # n")) - 1)
    flops = 0
    for node in nodes:
        op_type, inputs = str(node.get("op_type", "")), [str(x) for x in node.get("inputs", [])]
        if op_type in _MATMULS and len(inputs) >= 2:
            flops += _matmul_flops(op_type, shape(inputs[0]), shape(inputs[1]), node["attrs"])
        elif op_type in _CONVS:
            # The anchor's own output is inside the kernel; its epilogue keeps the element count.
            outputs = [str(x) for x in node.get("outputs", [])]
            own = shape(outputs[0]) if outputs else ()
            flops += _conv_flops(inputs, int(np.prod(own, dtype=np.int64)) if own else out_numel, shape)
        elif op_type not in _READ_THROUGH:
            flops += out_numel
    return flops


def _flops(plan: Plan, step: Step) -> int:
    def shape(name: str) -> tuple[int, ...]:
        spec = plan.values.get(name)
        return spec.shape if spec else ()

    out = shape(step.outputs[0]) if step.outputs and step.outputs[0] else ()
    out_numel = int(np.prod(out, dtype=np.int64)) if out else 1
    if step.kind == "op" and step.op_type in _MATMULS:
        return _matmul_flops(step.op_type, shape(step.inputs[0]), shape(step.inputs[1]), step.attrs)
    if step.kind == "op" and step.op_type in _CONVS:
        return _conv_flops(step.inputs, out_numel, shape)
    if step.kind == "kernel":
        return _kernel_flops(plan, step, out_numel, shape)
    return out_numel


def step_cost(plan: Plan, step: Step, peaks: DevicePeaks | None = None) -> dict[str, Any]:
    nbytes = sum(_nbytes(plan, x) for x in step.inputs if x) + sum(
        _nbytes(plan, o) for o in step.outputs if o
    )
    if step.kind == "op" and step.launches == 0:
        nbytes = 0  # a view moves nothing
    flops = _flops(plan, step)
    intensity = flops / nbytes if nbytes else 0.0
    ridge = (peaks or device_peaks()).ridge(plan.precision)
    return {
        "bytes": int(nbytes),
        "flops": int(flops),
        "intensity": round(intensity, 3),
        "bound": "compute" if intensity > ridge else "memory",
    }


def profile_steps(plan: Plan, times_ms: list[float], device: str | None = None) -> list[dict[str, Any]]:
    """One row per step; `bound` compares its intensity with `device`'s ridge point."""
    peaks = device_peaks(device)
    rows = []
    for step, t in zip(plan.steps, times_ms, strict=False):
        row: dict[str, Any] = {
            "node": step.label,
            "op_type": step.op_type if step.kind == "op" else "FusedKernel",
            "time_ms": round(t, 6),
        }
        row.update(step_cost(plan, step, peaks))
        rows.append(row)
    return rows


def roofline(precision: str, device: str | None = None) -> dict[str, Any]:
    """The peaks and ridge point the profile's memory-/compute-bound split used."""
    return device_peaks(device).to_json(precision)
