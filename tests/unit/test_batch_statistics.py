"""Training-mode BatchNormalization whose running statistics nobody reads: weight standardization
(timm's StdConv2d, transformers' BiT) as the TorchScript exporter writes it. Written out as the
batch's own mean and variance (opfuse/frontend/batch_statistics.py), it compiles and matches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import opfuse
from opfuse.errors import ModelError


class StdConv(nn.Module):
    """timm's StdConv2d: the weight normalized per output channel before the convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(
            self.conv.weight.reshape(1, 8, -1), None, None, training=True, momentum=0.0, eps=1e-6
        )
        return F.relu(F.conv2d(x, w.reshape_as(self.conv.weight), self.conv.bias, padding=1))


def test_weight_standardization_from_the_torchscript_exporter_compiles_and_matches(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = StdConv().eval()
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path / "std.onnx"
    torch.onnx.export(net, (x,), str(path), dynamo=False, input_names=["x"])
    model = onnx.load(str(path))
    assert any(
        n.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i == 1 for a in n.attribute)
        for n in model.graph.node
    ), "the exporter no longer writes a training-mode BatchNormalization: the test needs another model"
    cm = opfuse.compile(model, input_shapes={"x": [2, 3, 8, 8]}, device="cpu")
    assert cm.report["verification"]["passed"] is True
    (name,) = [o.name for o in model.graph.output]
    xs = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        want = net(xs).numpy()
    np.testing.assert_allclose(cm.run({"x": xs.numpy()})[name], want, rtol=1e-4, atol=1e-5)


def _batchnorm_model(stats_out: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    outputs = ["y", "running_mean", "running_var"] if stats_out else ["y"]
    node = helper.make_node(
        "BatchNormalization",
        ["x", "scale", "bias", "mean", "var"],
        outputs,
        name="bn",
        training_mode=1,
        epsilon=1e-3,
    )
    inits = [
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "scale"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "bias"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "mean"),
        numpy_helper.from_array(rng.uniform(0.5, 2.0, 4).astype(np.float32), "var"),
    ]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4, 5, 6])]
    if stats_out:
        outs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in outputs[1:]]
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 5, 6])], outs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_batch_statistics_of_a_runtime_input_follow_the_onnx_definition() -> None:
    """Y = (X - mean) / sqrt(var + eps) * scale + bias, mean and (population) variance over every
    axis but the channels, as the ONNX reference computes them."""
    model = _batchnorm_model(stats_out=False)
    cm = opfuse.compile(model, input_shapes={"x": [3, 4, 5, 6]}, device="cpu", verify=False)
    x = np.random.default_rng(2).standard_normal((3, 4, 5, 6)).astype(np.float32) * 3 + 1
    s = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    want = (x - mean) / np.sqrt(var + 1e-3) * s["scale"].reshape(1, 4, 1, 1) + s["bias"].reshape(1, 4, 1, 1)
    np.testing.assert_allclose(cm.run({"x": x})["y"], want, rtol=1e-4, atol=1e-5)


def test_training_mode_whose_running_statistics_are_read_is_still_refused() -> None:
    with pytest.raises(ModelError, match=r"training mode.*'bn'.*training_mode=1"):
        opfuse.compile(_batchnorm_model(stats_out=True), input_shapes={"x": [3, 4, 5, 6]}, device="cpu")
