"""The execution plan: ordered steps over named buffers, serializable to plan.json.

A step is either one ONNX node run by its per-op torch kernel ("op") or one generated Triton
kernel covering a fusion group ("kernel"). Weights live in the bundle's model.onnx.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opfuse.ir.graph import TensorSpec
from opfuse.runtime.ops import VIEW_OPS

PLAN_VERSION = 1


@dataclass
class Step:
    kind: str  # "op" | "kernel"
    inputs: list[str]
    outputs: list[str]
    op_type: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)
    node: str = ""  # generated node id (op steps)
    label: str = ""  # the model's node name(s), for reports
    kernel: str = ""  # kernel id (kernel steps)
    group: str = ""

    @property
    def launches(self) -> int:
        """Kernel launches this step costs: views and no-ops launch none, a conv that sums a
        shortcut (passes/shortcut_conv.py) run by the library three."""
        if self.kind == "kernel":
            return 1
        if self.op_type == "opfuse.ConvNHWC" and len(self.inputs) > 3 and self.inputs[3]:
            return 3  # a conv summing a 1x1 shortcut: the library's two convolutions, then the add
        return 0 if self.op_type in VIEW_OPS else 1

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "inputs": self.inputs, "outputs": self.outputs}
        if self.kind == "op":
            d.update(op_type=self.op_type, attrs=encode_attrs(self.attrs), node=self.node, label=self.label)
        else:
            d.update(kernel=self.kernel, group=self.group, label=self.label)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Step:
        return Step(
            kind=str(d["kind"]),
            inputs=[str(x) for x in d["inputs"]],
            outputs=[str(x) for x in d["outputs"]],
            op_type=str(d.get("op_type", "")),
            attrs=decode_attrs(d.get("attrs", {})),
            node=str(d.get("node", "")),
            label=str(d.get("label", "")),
            kernel=str(d.get("kernel", "")),
            group=str(d.get("group", "")),
        )


@dataclass
class KernelInfo:
    id: str
    kind: str
    group: str
    inputs: list[str]
    outputs: list[str]
    config: dict[str, Any]
    source: str
    # What the template registry rendered `source` from (opfuse.codegen.spec), plain JSON: a
    # bundle's loader renders the source again from it and runs only what it rendered.
    spec: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "group": self.group,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "config": self.config,
            "file": f"kernels/{self.id}.py",
            "spec": self.spec,
        }


@dataclass
class Plan:
    precision: str
    inputs: list[TensorSpec]  # as the caller feeds them (the model's declared dtypes)
    outputs: list[TensorSpec]  # as the caller receives them
    values: dict[str, TensorSpec]  # every buffer inside the plan, in the compute precision
    steps: list[Step]
    kernels: dict[str, KernelInfo]
    constants: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def launches(self) -> int:
        return sum(s.launches for s in self.steps)

    def last_uses(self) -> dict[int, list[str]]:
        """Buffers that die after each step: the runtime frees them there (liveness)."""
        keep = {o.name for o in self.outputs} | set(self.constants)
        last: dict[str, int] = {}
        for i, s in enumerate(self.steps):
            for x in s.inputs:
                if x:
                    last[x] = i
        dies: dict[int, list[str]] = {}
        for name, i in last.items():
            if name not in keep:
                dies.setdefault(i, []).append(name)
        return dies

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "precision": self.precision,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "values": [s.to_json() for s in self.values.values()],
            "constants": sorted(self.constants),
            "steps": [s.to_json() for s in self.steps],
            "kernels": [k.to_json() for k in self.kernels.values()],
            "buffers": {"freed_after_step": {str(i): names for i, names in sorted(self.last_uses().items())}},
            "launches": self.launches,
        }


def encode_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if isinstance(v, np.ndarray):
            out[k] = {
                "__ndarray__": {"dtype": v.dtype.name, "shape": list(v.shape), "data": v.ravel().tolist()}
            }
        else:
            out[k] = v
    return out


def decode_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if isinstance(v, dict) and "__ndarray__" in v:
            a = v["__ndarray__"]
            out[k] = np.asarray(a["data"], dtype=a["dtype"]).reshape(a["shape"])
        else:
            out[k] = v
    return out
