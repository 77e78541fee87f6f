"""Tiny ONNX models for the service tests, built in memory with onnx.helper."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp(batch: str | int = "batch", bias: float = 0.1, opset: int = 17) -> onnx.ModelProto:
    """y = Relu(x · W + b) with x: [batch, 4] → y: [batch, 3]; `bias` changes the bytes."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
    b = numpy_helper.from_array(np.full(3, bias, dtype=np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["z"]),
            helper.make_node("Relu", ["z"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
        initializer=[w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def two_inputs() -> onnx.ModelProto:
    """z = x + y with x: [batch, seq, 8], y: [batch, ?, 8] (one named symbol shared, one unnamed dim)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None, 8])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", "seq", 8])
    graph = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "two_inputs", [x, y], [z])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def with_external_data() -> onnx.ModelProto:
    """The MLP with its weight moved to an external file (as large exports are saved)."""
    model = mlp()
    weight = model.graph.initializer[0]
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", "48")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    return model


def to_bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()
