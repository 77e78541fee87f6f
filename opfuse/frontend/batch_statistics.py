"""BatchNormalization in training mode whose running statistics nobody reads, written out.

Weight standardization (timm's StdConv2d and ScaledStdConv2d in ResNetV2/BiT and NFNet,
transformers' BiT) normalizes a conv's weight with `F.batch_norm(w, None, None, training=True)`;
the TorchScript exporter writes that as BatchNormalization with training_mode=1. With only its
first output used, such a node updates no state and is not random: it normalizes by the batch's
own mean and (population) variance over every axis but the channel axis, as ONNX defines it. It is
written out here as that arithmetic (ReduceMean, Sub, Mul, Sqrt, Div, and the scale and bias), so
the usual passes see it: on a constant weight constant folding computes it once at compile time.
A training-mode node whose running statistics are read is left for check_inference_mode to refuse.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from opfuse.frontend.inspect import default_opset

_ELEM = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
}


def _used(model: onnx.ModelProto) -> set[str]:
    used = {o.name for o in model.graph.output}
    for node in model.graph.node:
        used.update(node.input)
    return used


def _ranks(model: onnx.ModelProto) -> Callable[[str], tuple[int, int] | None]:
    """name -> (rank, element type) of a value of `model`; shapes are inferred once, on the first
    name that is not an initializer."""
    inits = {i.name: (len(i.dims), i.data_type) for i in model.graph.initializer}
    table: dict[str, tuple[int, int]] | None = None

    def lookup(name: str) -> tuple[int, int] | None:
        nonlocal table
        if name in inits:
            return inits[name]
        if table is None:
            inferred = onnx.shape_inference.infer_shapes(model)
            table = {
                vi.name: (len(vi.type.tensor_type.shape.dim), vi.type.tensor_type.elem_type)
                for vi in [*inferred.graph.input, *inferred.graph.value_info]
                if vi.type.tensor_type.HasField("shape")
            }
        return table.get(name)

    return lookup


def write_out_batch_statistics(model: onnx.ModelProto) -> int:
    """Write out each training-mode BatchNormalization that only its Y output is read from;
    returns how many were written out."""
    if default_opset(model) < 18:  # ReduceMean takes its axes as an input from opset 18
        return 0
    used, rank_and_type = _used(model), _ranks(model)
    nodes: list[onnx.NodeProto] = []
    count = 0
    for node in model.graph.node:
        training = (
            node.op_type == "BatchNormalization"
            and node.domain in ("", "ai.onnx")
            and any(a.name == "training_mode" and a.i == 1 for a in node.attribute)
        )
        shape = rank_and_type(node.input[0]) if training else None
        if not training or shape is None or any(o in used for o in node.output[1:] if o) or shape[0] < 2:
            nodes.append(node)
            continue
        rank, elem = shape
        if elem not in _ELEM:
            nodes.append(node)
            continue
        nodes += _written_out(model, node, rank, elem)
        count += 1
    if count:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return count


def _written_out(model: onnx.ModelProto, node: onnx.NodeProto, rank: int, elem: int) -> list[onnx.NodeProto]:
    eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    x, scale, bias = node.input[:3]
    y = node.output[0]
    p = f"{y}__batch_stats"
    label = node.name or "BatchNormalization"
    axes = [0, *range(2, rank)]
    inits = {
        f"{p}_axes": np.array(axes, dtype=np.int64),
        f"{p}_eps": np.array(eps, dtype=_ELEM[elem]),
        f"{p}_channel_axes": np.array(list(range(1, rank - 1)), dtype=np.int64),
    }
    for name, value in inits.items():
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    n = helper.make_node
    out = [
        n("ReduceMean", [x, f"{p}_axes"], [f"{p}_mean"], name=f"{label}/mean", keepdims=1),
        n("Sub", [x, f"{p}_mean"], [f"{p}_centered"], name=f"{label}/center"),
        n("Mul", [f"{p}_centered", f"{p}_centered"], [f"{p}_sq"], name=f"{label}/square"),
        n("ReduceMean", [f"{p}_sq", f"{p}_axes"], [f"{p}_var"], name=f"{label}/variance", keepdims=1),
        n("Add", [f"{p}_var", f"{p}_eps"], [f"{p}_var_eps"], name=f"{label}/eps"),
        n("Sqrt", [f"{p}_var_eps"], [f"{p}_std"], name=f"{label}/std"),
        n("Div", [f"{p}_centered", f"{p}_std"], [f"{p}_normed"], name=f"{label}/normalize"),
    ]
    if rank > 2:  # scale and bias are per channel (axis 1): shape (C, 1, ..., 1) to broadcast
        out += [
            n("Unsqueeze", [scale, f"{p}_channel_axes"], [f"{p}_scale"], name=f"{label}/scale_shape"),
            n("Unsqueeze", [bias, f"{p}_channel_axes"], [f"{p}_bias"], name=f"{label}/bias_shape"),
        ]
        scale, bias = f"{p}_scale", f"{p}_bias"
    out += [
        n("Mul", [f"{p}_normed", scale], [f"{p}_scaled"], name=f"{label}/scale"),
        n("Add", [f"{p}_scaled", bias], [y], name=f"{label}/bias"),
    ]
    return out
