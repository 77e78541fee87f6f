"""A plan runs as one CUDA graph unless it must touch the host mid-run, and says so when it must.

The audit (opfuse/runtime/capture.py) runs a plan's per-op steps on the CPU as if on a GPU and
records every host read of a device value and every host table carried into device work: what
makes a CUDA-graph capture fail. The models here are what the corpus's GPU leg saw fall back to
step-by-step runs: an upsampling Resize (segmentation heads, FPNs) and RoBERTa's position ids
(a CumSum over a mask of the token ids).

On the CPU (`make test`) the audit stands in for the capture; on the GPU (OPFUSE_TEST_DEVICE=cuda)
the same tests capture the plan for real and check what the capture says.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.runtime.capture import audit, host_blockers
from opfuse.runtime.executor import Executor
from tests.builders import TEST_DEVICE


def _model(nodes: list[onnx.NodeProto], inputs: list, outputs: list, inits: list) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _audit(cm: opfuse.CompiledModel, feeds: dict[str, np.ndarray]) -> list[str]:
    """What keeps the plan from being one CUDA graph: on the CPU the audit's findings, on the GPU
    the capture's own error (none where the plan was captured)."""
    if TEST_DEVICE == "cpu":
        return audit(Executor(cm.plan, "cpu", host_copies=True), feeds)
    cm.run(feeds)  # captures the plan, or keeps why it could not
    return [] if cm.cuda_graph_error is None else [cm.cuda_graph_error]


def _upsample(cubic: bool = False) -> onnx.ModelProto:
    """Conv, then a 2x Resize with constant scales, then a Relu: bilinear (opfuse fuses the
    Resize into the Relu's kernel as a gather) or cubic excluding the taps outside the image
    (the library's op, no gather computes it: host-computed taps)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], dtype=np.float32), "scales")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(
            "Resize",
            ["c", "", "scales"],
            ["r"],
            name="up",
            mode="cubic" if cubic else "linear",
            exclude_outside=int(cubic),
        ),
        helper.make_node("Relu", ["r"], ["y"], name="relu"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 16, 16])],
        [w, scales],
    )


def _positions(axis_is_input: bool = False) -> onnx.ModelProto:
    """RoBERTa's position ids: mask = ids != pad; cumsum(mask) * mask + pad, then an embedding."""
    rng = np.random.default_rng(1)
    table = numpy_helper.from_array(rng.standard_normal((20, 8)).astype(np.float32), "table")
    inits = [
        table,
        numpy_helper.from_array(np.array(1, dtype=np.int64), "pad"),
    ]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 6])]
    if axis_is_input:
        inputs.append(helper.make_tensor_value_info("axis", TensorProto.INT64, []))
    else:
        inits.append(numpy_helper.from_array(np.array(1, dtype=np.int64), "axis"))
    nodes = [
        helper.make_node("Equal", ["ids", "pad"], ["is_pad"], name="is_pad"),
        helper.make_node("Not", ["is_pad"], ["keep"], name="keep"),
        helper.make_node("Cast", ["keep"], ["mask"], name="mask", to=TensorProto.INT64),
        helper.make_node("CumSum", ["mask", "axis"], ["run"], name="running"),
        helper.make_node("Mul", ["run", "mask"], ["masked"], name="masked"),
        helper.make_node("Add", ["masked", "pad"], ["pos"], name="pos"),
        helper.make_node("Gather", ["table", "pos"], ["y"], name="embed"),
    ]
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 8])], inits)


@pytest.mark.parametrize("cubic", [False, True])
def test_an_upsampling_resize_needs_no_host_mid_run(cubic: bool) -> None:
    model = _upsample(cubic)
    cm = opfuse.compile(model, input_shapes={"x": [2, 3, 8, 8]}, device=TEST_DEVICE)
    assert any(s.op_type == "Resize" for s in cm.plan.steps) == cubic
    assert cm.report["cuda_graph"] == {"capturable": True, "blockers": [], "blocker_count": 0}
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    assert _audit(cm, {"x": x}) == []
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    np.testing.assert_allclose(cm.run({"x": x})["y"], want[0], rtol=1e-4, atol=1e-5)


def _bidirectional_lstm() -> onnx.ModelProto:
    """A bidirectional LSTM in torch's form (one library call for both directions, its weights
    reordered once and kept: ops_recurrent.prepared_weights), then a Tanh."""
    rng = np.random.default_rng(4)
    inits = [
        numpy_helper.from_array((rng.standard_normal(s) * 0.4).astype(np.float32), n)
        for n, s in (("w", (2, 20, 3)), ("r", (2, 20, 5)), ("b", (2, 40)))
    ]
    nodes = [
        helper.make_node(
            "LSTM", ["x", "w", "r", "b"], ["y"], name="lstm", hidden_size=5, direction="bidirectional"
        ),
        helper.make_node("Tanh", ["y"], ["out"], name="tanh"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 2, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [6, 2, 2, 5])],
        inits,
    )


def test_a_recurrent_layers_kept_weights_are_device_tensors_to_the_capture() -> None:
    """The weights in torch's order are made at the first run (a GPU's warm-up before capture)
    and reused: the audited run finds no host tensor in the LSTM's device work."""
    model = _bidirectional_lstm()
    cm = opfuse.compile(model, input_shapes={"x": [6, 2, 3]}, device=TEST_DEVICE)
    assert cm.report["cuda_graph"]["capturable"] is True
    x = np.random.default_rng(5).standard_normal((6, 2, 3)).astype(np.float32)
    assert _audit(cm, {"x": x}) == []
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    np.testing.assert_allclose(cm.run({"x": x})["out"], want[0], rtol=1e-4, atol=1e-5)


def test_roberta_position_ids_read_their_constant_axis_from_a_host_copy() -> None:
    model = _positions()
    cm = opfuse.compile(model, input_shapes={"ids": [2, 6]}, device=TEST_DEVICE)
    assert cm.report["cuda_graph"]["capturable"] is True
    ids = np.random.default_rng(3).integers(0, 5, size=(2, 6)).astype(np.int64)
    assert _audit(cm, {"ids": ids}) == []
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids}
    )
    np.testing.assert_array_equal(cm.run({"ids": ids})["y"], want[0])


def _pad_by_input() -> onnx.ModelProto:
    """A Pad whose fill value is a model input: read on the host on every run (shapes do not
    depend on it, so the frontend takes it)."""
    pads = numpy_helper.from_array(np.array([0, 1, 0, 1], dtype=np.int64), "pads")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Pad", ["r", "pads", "fill"], ["p"], name="pad", mode="constant"),
        helper.make_node("Mul", ["p", "p"], ["y"], name="square"),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
            helper.make_tensor_value_info("fill", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
        [pads],
    )


def test_a_value_computed_at_run_time_and_read_on_the_host_is_named_by_both_checks() -> None:
    """The audit can fail: the static check names the node, the report says the plan cannot be
    one CUDA graph and why, and the audit sees the same read when the plan runs."""
    model = _pad_by_input()
    cm = opfuse.compile(model, input_shapes={"x": [3, 4], "fill": []}, device=TEST_DEVICE)
    blockers = host_blockers(cm.plan)
    assert len(blockers) == 1 and "'pad' (Pad) reads input 2 ('fill') on the host" in blockers[0]
    assert cm.report["cuda_graph"] == {"capturable": False, "blockers": blockers, "blocker_count": 1}
    rng = np.random.default_rng(4)
    feeds = {
        "x": rng.standard_normal((3, 4)).astype(np.float32),
        "fill": np.array(rng.standard_normal(), dtype=np.float32),
    }
    found = _audit(cm, feeds)
    assert found and all("'pad' (Pad)" in f for f in found), found
    if TEST_DEVICE == "cpu":
        assert "reads a device value on the host" in found[0]
    else:  # refused before any capture, with the static check's reason
        assert found[0].startswith("CaptureBlocked") and "reads input 2 ('fill') on the host" in found[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    np.testing.assert_allclose(cm.run(feeds)["y"], want[0], rtol=1e-6)


def test_the_audit_sees_a_host_table_copied_mid_run() -> None:
    """Resize's taps were copied from numpy on every run (the capture error of the segmentation
    rows); with the copy put back the audit names the node."""
    import torch

    from opfuse.runtime import ops_image

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(
            ops_image,
            "device_table",
            lambda v, device, dtype=None: torch.from_numpy(np.array(v)).to(device=device, dtype=dtype),
        )
        cm = opfuse.compile(
            _upsample(cubic=True), input_shapes={"x": [2, 3, 8, 8]}, device=TEST_DEVICE, verify=False
        )
        x = np.random.default_rng(5).standard_normal((2, 3, 8, 8)).astype(np.float32)
        found = _audit(cm, {"x": x})
        got = cm.run({"x": x})["y"]  # on the GPU: step by step, after the capture failed
    finally:
        mp.undo()
    if TEST_DEVICE == "cpu":
        assert found and all("'up' (Resize)" in f for f in found), found
        assert any("copies a host tensor" in f for f in found)
    else:  # the copy is no static blocker: the capture itself fails, and the run falls back
        assert len(found) == 1 and "CaptureBlocked" not in found[0], found
    model = _upsample(cubic=True)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    np.testing.assert_allclose(got, want[0], rtol=1e-4, atol=1e-5)
