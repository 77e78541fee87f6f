"""ONNX to opfuse's own small graph IR: what the passes, planner and runtime work on after the
frontend.

The frontend works on ONNX protos (through onnx and onnxscript); once every shape is static the
model is lowered to the IR (`opfuse.ir.graph`, re-exported here), where values are names with a
static dtype and shape. Shapes ONNX inference leaves open are read off one run of the graph on the
CPU, which is why this module sits above the runtime and the IR itself below it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from opfuse.errors import ModelError
from opfuse.frontend.inspect import dtype_name
from opfuse.ir.graph import Graph, Node, TensorSpec

__all__ = ["Graph", "Node", "TensorSpec", "graph_from_onnx"]


def decode_attribute(attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", errors="replace") for v in value]
    if isinstance(value, onnx.GraphProto | onnx.SparseTensorProto):
        raise ModelError(
            f"attribute {attr.name!r} holds a subgraph or sparse tensor, which opfuse does not support"
        )
    return value


def _spec_from_value_info(vi: onnx.ValueInfoProto) -> TensorSpec | None:
    if not vi.type.HasField("tensor_type"):
        return None
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    dims: list[int] = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return TensorSpec(vi.name, dtype_name(tt.elem_type), tuple(dims))


def graph_from_onnx(model: onnx.ModelProto) -> Graph:
    """Lower a shape-inferred, fully static model to the IR."""
    g = model.graph
    constants: dict[str, np.ndarray] = {init.name: numpy_helper.to_array(init) for init in g.initializer}
    values: dict[str, TensorSpec] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        spec = _spec_from_value_info(vi)
        if spec is not None:
            values[vi.name] = spec
    for name, arr in constants.items():
        values[name] = TensorSpec(
            name, dtype_name(helper.np_dtype_to_tensor_dtype(arr.dtype)), tuple(arr.shape)
        )
    nodes: list[Node] = []
    for i, n in enumerate(g.node):
        attrs = {a.name: decode_attribute(a) for a in n.attribute}
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1:
            arr = _constant_node_value(attrs)
            constants[n.output[0]] = arr
            values[n.output[0]] = TensorSpec(
                n.output[0], dtype_name(helper.np_dtype_to_tensor_dtype(arr.dtype)), tuple(arr.shape)
            )
            continue
        nodes.append(Node(f"n{i}", n.op_type, list(n.input), list(n.output), attrs, n.name))
    inputs = []
    for vi in g.input:
        if vi.name in constants:
            continue
        spec = values.get(vi.name)
        if spec is None:
            raise ModelError(f"graph input {vi.name!r} has no static shape after specialization")
        inputs.append(spec)
    inputs = _bound_index_inputs(nodes, inputs, values)
    if any(o and o not in values for n in nodes for o in n.outputs):
        _complete_by_dry_run(nodes, inputs, constants, values)
    outputs = []
    for vi in g.output:
        spec = values.get(vi.name)
        if spec is None:
            raise ModelError(
                f"graph output {vi.name!r} has no static shape after shape inference; "
                "check that every dynamic input dim is given in input_shapes"
            )
        outputs.append(spec)
    missing = sorted({o for n in nodes for o in n.outputs if o and o not in values})
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        raise ModelError(
            f"ONNX shape inference could not give a static shape to {len(missing)} value(s) ({shown}); "
            "opfuse needs every shape static after input_shapes are applied"
        )
    return Graph(nodes=nodes, inputs=inputs, outputs=outputs, constants=constants, values=values)


# Indexing ops: how their indices (input 1) address the data (input 0): along the `axis` attribute,
# or as coordinates into the axes after `batch_dims` ("nd").
_INDEXING = {
    "Gather": "axis",
    "GatherElements": "axis",
    "ScatterElements": "axis",
    "GatherND": "nd",
    "ScatterND": "nd",
}


def _bound_index_inputs(
    nodes: list[Node], inputs: list[TensorSpec], values: dict[str, TensorSpec]
) -> list[TensorSpec]:
    """The inputs, each integer input that an indexing op reads as indices bounded (`high`) by the
    smallest axis it indexes, so that random inputs are valid indices."""
    highs: dict[str, int] = {}
    names = {s.name for s in inputs}
    for n in nodes:
        how = _INDEXING.get(n.op_type)
        if how is None or len(n.inputs) < 2 or n.inputs[1] not in names or n.inputs[0] not in values:
            continue
        shape, ind = values[n.inputs[0]].shape, values.get(n.inputs[1])
        if how == "axis":
            axis = int(n.attrs.get("axis", 0))
            axes = [axis + len(shape) if axis < 0 else axis]
        else:
            first = int(n.attrs.get("batch_dims", 0))
            k = ind.shape[-1] if ind is not None and ind.shape else 0
            axes = list(range(first, first + k))
        sizes = [shape[a] for a in axes if 0 <= a < len(shape)]
        if sizes:
            highs[n.inputs[1]] = min(highs.get(n.inputs[1], min(sizes)), min(sizes))
    bounded = [replace(s, high=highs[s.name]) if s.name in highs else s for s in inputs]
    values.update({s.name: s for s in bounded if s.name in highs})
    return bounded


# Ops whose output shape depends on input values, not only on input shapes.
DATA_DEPENDENT_OPS = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression"})


def _complete_by_dry_run(
    nodes: list[Node],
    inputs: list[TensorSpec],
    constants: dict[str, np.ndarray],
    values: dict[str, TensorSpec],
) -> None:
    """Shapes ONNX inference left open, read off one run of the graph on random inputs (CPU).

    With every input dim bound, a value's shape is fixed unless an op's output size depends on
    the data; such graphs are refused rather than specialized to one random input.
    """
    import torch

    from opfuse.runtime.ops import run_op
    from opfuse.runtime.tensors import DTYPE_NAMES, from_numpy, torch_dtype

    dynamic = sorted({n.op_type for n in nodes if n.op_type in DATA_DEPENDENT_OPS})
    if dynamic:
        raise ModelError(
            f"the model uses {', '.join(dynamic)}, whose output shape depends on the data; opfuse compiles "
            "static shapes only. Remove it from the exported graph (or make its input constant)."
        )
    gen = torch.Generator().manual_seed(0)
    env: dict[str, torch.Tensor] = {k: from_numpy(v) for k, v in constants.items()}
    for spec in inputs:
        dtype = torch_dtype(spec.dtype)
        if dtype.is_floating_point:
            env[spec.name] = torch.randn(spec.shape, generator=gen).to(dtype)
        elif dtype == torch.bool:
            env[spec.name] = torch.rand(spec.shape, generator=gen) < 0.5
        else:
            high = max(1, min(4, spec.high)) if spec.high is not None else 4
            env[spec.name] = torch.randint(0, high, spec.shape, generator=gen).to(dtype)
    with torch.no_grad():
        for n in nodes:
            args = [env[x] if x else None for x in n.inputs]
            try:
                outs = run_op(n.op_type, args, n.attrs, num_outputs=len(n.outputs))
            except ModelError:
                raise
            except Exception as exc:
                raise ModelError(
                    f"node {n.name or n.op_type!r} ({n.op_type}) failed on inputs of the given shapes: {exc}"
                ) from None
            for name, t in zip(n.outputs, outs, strict=False):
                if name:
                    env[name] = t
                    if name not in values:
                        values[name] = TensorSpec(name, DTYPE_NAMES[t.dtype], tuple(t.shape))


def _constant_node_value(attrs: dict[str, Any]) -> np.ndarray:
    if "value" in attrs:
        return np.asarray(attrs["value"])
    if "value_float" in attrs:
        return np.asarray(attrs["value_float"], dtype=np.float32)
    if "value_floats" in attrs:
        return np.asarray(attrs["value_floats"], dtype=np.float32)
    if "value_int" in attrs:
        return np.asarray(attrs["value_int"], dtype=np.int64)
    if "value_ints" in attrs:
        return np.asarray(attrs["value_ints"], dtype=np.int64)
    raise ModelError("a Constant node has no value attribute opfuse understands (sparse or string constants)")
