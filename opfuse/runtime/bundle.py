"""The artifact bundle (DESIGN.md §4): a zip with manifest, fused model.onnx, kernels, plan, report."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from opfuse.bundle_format import BUNDLE_FORMAT as BUNDLE_FORMAT  # the manifest writes these
from opfuse.bundle_format import BUNDLE_VERSION as BUNDLE_VERSION
from opfuse.bundle_format import FUSED_DOMAIN
from opfuse.errors import BundleError
from opfuse.frontend.opsets import CANONICAL_OPSET
from opfuse.ir.graph import TensorSpec
from opfuse.runtime.plan import KernelInfo, Plan, Step
from opfuse.views.html import render_html

_ELEM = {
    "float32": onnx.TensorProto.FLOAT,
    "float16": onnx.TensorProto.FLOAT16,
    "bfloat16": onnx.TensorProto.BFLOAT16,
    "float64": onnx.TensorProto.DOUBLE,
    "int64": onnx.TensorProto.INT64,
    "int32": onnx.TensorProto.INT32,
    "int16": onnx.TensorProto.INT16,
    "int8": onnx.TensorProto.INT8,
    "uint8": onnx.TensorProto.UINT8,
    "bool": onnx.TensorProto.BOOL,
}


def _value_info(spec: TensorSpec, name: str | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name or spec.name, _ELEM[spec.dtype], list(spec.shape))


def default_domain_opset(op_types: set[str], source_opset: int | None = None) -> int:
    """The default-domain opset the fused graph imports: the canonical one (18), or the source
    model's newer opset (its nodes keep their version's meaning), or higher still where a node left
    unfused exists only in a later opset (Gelu is new at 20, RMSNormalization and Attention at 23),
    so that onnx.checker accepts every bundle's model.onnx."""
    newest = onnx.defs.onnx_opset_version()
    opset = min(max(CANONICAL_OPSET, source_opset or CANONICAL_OPSET), newest)
    for op_type in sorted(op_types):
        if _exists(op_type, opset):
            continue
        opset = next((v for v in range(opset + 1, newest + 1) if _exists(op_type, v)), opset)
    return opset


def _exists(op_type: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


def fused_model(plan: Plan, source_opset: int | None = None) -> onnx.ModelProto:
    """The fused graph: each kernel is one ai.opfuse::FusedKernel node, so it opens in Netron.
    `source_opset`: the uploaded model's opset (see default_domain_opset)."""
    nodes = []
    for i, s in enumerate(plan.steps):
        if s.kind == "kernel":
            nodes.append(
                helper.make_node(
                    "FusedKernel",
                    s.inputs,
                    s.outputs,
                    name=f"fused_{s.kernel}",
                    domain=FUSED_DOMAIN,
                    kernel=s.kernel,
                    group=s.group,
                )
            )
        else:
            attrs = {
                k: (numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v)
                for k, v in s.attrs.items()
            }
            op_type, domain = s.op_type, ""
            if op_type.startswith("opfuse."):  # opfuse's own ops (the channels-last region)
                op_type, domain = op_type.split(".", 1)[1], FUSED_DOMAIN
            nodes.append(
                helper.make_node(
                    op_type, s.inputs, s.outputs, name=s.label or f"step{i}", domain=domain, **attrs
                )
            )
    inits = []
    for name, arr in plan.constants.items():
        spec = plan.values.get(name)
        if spec is not None and spec.dtype == "bfloat16":
            t = helper.make_tensor(
                name, onnx.TensorProto.BFLOAT16, arr.shape, arr.astype(np.float32).ravel().tolist()
            )
        else:
            t = numpy_helper.from_array(np.asarray(arr), name)
        inits.append(t)
    io_names = {s.name for s in plan.inputs} | {s.name for s in plan.outputs} | set(plan.constants)
    graph = helper.make_graph(
        nodes,
        "opfuse_fused",
        [_value_info(s) for s in plan.inputs],
        [_value_info(s) for s in plan.outputs],
        initializer=inits,
        value_info=[_value_info(s) for name, s in plan.values.items() if name not in io_names],
    )
    ops = {n.op_type for n in nodes if n.domain == ""}
    opset_imports = [
        helper.make_opsetid("", default_domain_opset(ops, source_opset)),
        helper.make_opsetid(FUSED_DOMAIN, 1),
    ]
    model = helper.make_model(graph, opset_imports=opset_imports, producer_name="opfuse")
    model.ir_version = max(8, helper.find_min_ir_version_for(opset_imports, ignore_unknown=True))
    return model


def write_bundle(
    path: str | os.PathLike[str], plan: Plan, manifest: dict[str, Any], report: dict[str, Any]
) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("manifest.json", json.dumps(manifest, indent=2))
        source_opset = (manifest.get("source") or {}).get("opset")
        model = fused_model(plan, int(source_opset) if source_opset else None)
        z.writestr("model.onnx", model.SerializeToString())
        for k in plan.kernels.values():
            z.writestr(f"kernels/{k.id}.py", k.source)
        z.writestr("plan.json", json.dumps(plan.to_json(), indent=1))
        z.writestr("report.json", json.dumps(report, indent=2, default=str))
        # The report to look at: one self-contained page (docs/bundle.md), from the same JSON.
        sources = {k.id: k.source for k in plan.kernels.values()}
        title = (manifest.get("source") or {}).get("name")
        z.writestr(
            "report.html", render_html(_plain_json(report), sources, title=str(title) if title else None)
        )
    os.replace(tmp, path)


def _plain_json(report: dict[str, Any]) -> Any:
    """The report as report.json holds it (numpy scalars and the like as JSON values or strings)."""
    return json.loads(json.dumps(report, default=str))


def bundle_plan(
    plan_json: dict[str, Any], constants: dict[str, np.ndarray], sources: Mapping[str, str]
) -> Plan:
    """The plan of a bundle opfuse.bundle_check has checked: its kernels' code is `sources`, what
    this opfuse rendered from their specs, never what the bundle ships."""
    kernels = {}
    try:
        for k in plan_json["kernels"]:
            kernels[k["id"]] = KernelInfo(
                k["id"],
                k["kind"],
                k["group"],
                k["inputs"],
                k["outputs"],
                k["config"],
                sources[k["id"]],
                k["spec"],
            )
        values = {d["name"]: TensorSpec.from_json(d) for d in plan_json["values"]}
        return Plan(
            precision=str(plan_json["precision"]),
            inputs=[TensorSpec.from_json(d) for d in plan_json["inputs"]],
            outputs=[TensorSpec.from_json(d) for d in plan_json["outputs"]],
            values=values,
            steps=[Step.from_json(d) for d in plan_json["steps"]],
            kernels=kernels,
            constants=constants,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BundleError(
            f"the bundle's plan.json is malformed ({type(exc).__name__}: {exc})"[:300]
        ) from None
