"""Indices out of range behave as onnxruntime's: an error, never numbers read from outside a tensor.

Negative indices in [-n, n-1] count from the end and give onnxruntime's numbers; indices computed
at run time outside that range raise InputError on the CPU (onnxruntime raises too); constant
indices out of range refuse the model at compile time with a ModelError naming the node.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.errors import InputError, ModelError
from tests.builders import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the errors are the CPU path's")
# What onnxruntime says of such indices (each op words it its own way).
ONNXRUNTIME_REFUSES = r"(?i)out of (data )?bounds|out of range|invalid|indices element"


def _model(
    node: onnx.NodeProto,
    inputs: list[tuple[str, int, list[int]]],
    out_shape: list[int],
    inits: list[onnx.TensorProto] | None = None,
) -> onnx.ModelProto:
    """One node, then a Mul by 2 so that the graph has a compute node after it."""
    mul = helper.make_node("Mul", ["g", "two"], ["y"], name="double")
    graph = helper.make_graph(
        [node, mul],
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        [*(inits or []), numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _session(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _compile(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> opfuse.CompiledModel:
    return opfuse.compile(model, input_shapes=shapes, device=TEST_DEVICE, verify=False)


def _same_as_onnxruntime(
    model: onnx.ModelProto, cm: opfuse.CompiledModel, feeds: dict[str, np.ndarray]
) -> None:
    (want,) = _session(model).run(None, feeds)
    got = np.asarray(cm.run(feeds)["y"])
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # a gather and a doubling: exact


def _gather(axis: int = 0) -> onnx.ModelProto:
    """y = 2 * Gather(data[6, 5], ids[3, 4], axis)."""
    node = helper.make_node("Gather", ["data", "ids"], ["g"], name="lookup", axis=axis)
    out = [3, 4, 5] if axis == 0 else [6, 3, 4]
    return _model(node, [("data", TensorProto.FLOAT, [6, 5]), ("ids", TensorProto.INT64, [3, 4])], out)


def _data(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_negative_indices_match_onnxruntime(axis: int) -> None:
    model = _gather(axis)
    cm = _compile(model, {"data": [6, 5], "ids": [3, 4]})
    n = 6 if axis == 0 else 5
    rng = np.random.default_rng(axis)
    for _ in range(3):
        ids = rng.integers(-n, n, size=(3, 4)).astype(np.int64)
        ids[0, 0], ids[0, 1] = -n, n - 1  # both ends of the range
        _same_as_onnxruntime(model, cm, {"data": _data((6, 5), axis), "ids": ids})


@pytest.mark.parametrize("bad", [6, -7, 100])
def test_gather_index_out_of_range_at_run_time_is_an_input_error_as_in_onnxruntime(bad: int) -> None:
    model = _gather()
    cm = _compile(model, {"data": [6, 5], "ids": [3, 4]})
    ids = np.random.default_rng(1).integers(-6, 6, size=(3, 4)).astype(np.int64)
    ids[2, 3] = bad
    feeds = {"data": _data((6, 5)), "ids": ids}
    with pytest.raises(Exception, match=ONNXRUNTIME_REFUSES):
        _session(model).run(None, feeds)  # onnxruntime refuses these indices
    with pytest.raises(InputError) as info:
        cm.run(feeds)
    message = str(info.value)
    assert "'lookup'" in message and f"index {bad} is out of range" in message, message
    assert "axis 0 of size 6" in message and "valid: -6 to 5" in message, message
    # indices passed as int32 are checked the same way
    with pytest.raises(InputError, match=f"index {bad} is out of range"):
        cm.run({"data": feeds["data"], "ids": ids.astype(np.int32)})


def _gather_elements() -> onnx.ModelProto:
    node = helper.make_node("GatherElements", ["data", "ids"], ["g"], name="pick", axis=1)
    return _model(node, [("data", TensorProto.FLOAT, [4, 5]), ("ids", TensorProto.INT64, [4, 3])], [4, 3])


def test_gather_elements_negative_indices_and_out_of_range() -> None:
    model = _gather_elements()
    cm = _compile(model, {"data": [4, 5], "ids": [4, 3]})
    rng = np.random.default_rng(2)
    ids = rng.integers(-5, 5, size=(4, 3)).astype(np.int64)
    ids[1, 1], ids[2, 2] = -5, 4
    _same_as_onnxruntime(model, cm, {"data": _data((4, 5), 2), "ids": ids})
    ids[3, 0] = 5
    feeds = {"data": _data((4, 5), 3), "ids": ids}
    with pytest.raises(Exception, match=ONNXRUNTIME_REFUSES):
        _session(model).run(None, feeds)
    with pytest.raises(InputError, match=r"node 'pick'.*index 5 is out of range for axis 1 of size 5"):
        cm.run(feeds)


def _gather_nd() -> onnx.ModelProto:
    """GatherND of data[4, 5, 3] at (i, j) pairs: y[2, 3, 3]."""
    node = helper.make_node("GatherND", ["data", "ids"], ["g"], name="pairs")
    inputs = [("data", TensorProto.FLOAT, [4, 5, 3]), ("ids", TensorProto.INT64, [2, 3, 2])]
    return _model(node, inputs, [2, 3, 3])


def test_gather_nd_negative_indices_and_out_of_range() -> None:
    model = _gather_nd()
    cm = _compile(model, {"data": [4, 5, 3], "ids": [2, 3, 2]})
    rng = np.random.default_rng(4)
    ids = np.stack([rng.integers(-4, 4, size=(2, 3)), rng.integers(-5, 5, size=(2, 3))], axis=-1)
    ids[0, 0] = [-4, -5]
    _same_as_onnxruntime(model, cm, {"data": _data((4, 5, 3), 4), "ids": ids.astype(np.int64)})
    ids[1, 2] = [1, -6]  # the second coordinate (axis 1, size 5) is out of range
    feeds = {"data": _data((4, 5, 3), 5), "ids": ids.astype(np.int64)}
    with pytest.raises(Exception, match=ONNXRUNTIME_REFUSES):
        _session(model).run(None, feeds)
    with pytest.raises(InputError, match=r"node 'pairs'.*index -6 is out of range for axis 1 of size 5"):
        cm.run(feeds)


def test_scatter_elements_index_out_of_range_is_an_input_error() -> None:
    node = helper.make_node("ScatterElements", ["data", "ids", "upd"], ["g"], name="put", axis=0)
    inputs = [
        ("data", TensorProto.FLOAT, [5, 3]),
        ("ids", TensorProto.INT64, [2, 3]),
        ("upd", TensorProto.FLOAT, [2, 3]),
    ]
    model = _model(node, inputs, [5, 3])
    cm = _compile(model, {"data": [5, 3], "ids": [2, 3], "upd": [2, 3]})
    ids = np.array([[0, -1, 2], [-5, 4, 1]], dtype=np.int64)  # distinct rows per column: no race
    feeds = {"data": _data((5, 3), 6), "ids": ids, "upd": _data((2, 3), 7)}
    _same_as_onnxruntime(model, cm, feeds)
    feeds["ids"] = np.array([[0, 1, 2], [3, 5, 1]], dtype=np.int64)
    with pytest.raises(Exception, match=ONNXRUNTIME_REFUSES):
        _session(model).run(None, feeds)
    with pytest.raises(InputError, match=r"node 'put'.*index 5 is out of range for axis 0 of size 5"):
        cm.run(feeds)


def _const_gather(ids: np.ndarray, op: str = "Gather", axis: int = 0) -> onnx.ModelProto:
    node = helper.make_node(op, ["data", "ids"], ["g"], name="fixed_pick", axis=axis)
    out = [*ids.shape, 5] if op == "Gather" else list(ids.shape)
    return _model(node, [("data", TensorProto.FLOAT, [6, 5])], out, [numpy_helper.from_array(ids, "ids")])


@pytest.mark.parametrize(
    ("case", "model", "bad"),
    [
        ("gather", _const_gather(np.array([1, 9, 2], dtype=np.int64)), 9),
        ("consecutive", _const_gather(np.array([5, 6, 7], dtype=np.int64)), 6),  # would become a Slice
        ("negative", _const_gather(np.array([[0, -7]], dtype=np.int64)), -7),
        ("elements", _const_gather(np.array([[0, 1, 6, 2, 3]], dtype=np.int64), "GatherElements"), 6),
    ],
)
def test_constant_indices_out_of_range_refuse_the_model_at_compile_time(
    case: str, model: onnx.ModelProto, bad: int
) -> None:
    with pytest.raises(Exception, match=ONNXRUNTIME_REFUSES):
        _session(model).run(None, {"data": _data((6, 5))})
    with pytest.raises(ModelError) as info:
        _compile(model, {"data": [6, 5]})
    message = str(info.value)
    assert "'fixed_pick'" in message and f"constant index {bad} is out of range" in message, message
    assert "axis 0 of size 6" in message and "valid: -6 to 5" in message, message


def test_constant_data_and_indices_out_of_range_refuse_the_model_before_folding() -> None:
    table = numpy_helper.from_array(_data((6, 5), 8), "table")
    ids = numpy_helper.from_array(np.array([0, 6], dtype=np.int64), "ids")
    node = helper.make_node("Gather", ["table", "ids"], ["t"], name="folded_pick")
    add = helper.make_node("Add", ["x", "t"], ["g"], name="add")
    mul = helper.make_node("Mul", ["g", "two"], ["y"], name="double")
    graph = helper.make_graph(
        [node, add, mul],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [table, ids, numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    with pytest.raises(ModelError, match=r"'folded_pick' \(Gather\): its constant index 6 is out of range"):
        _compile(model, {"x": [2, 5]})


def test_constant_negative_indices_in_range_match_onnxruntime() -> None:
    model = _const_gather(np.array([[-6, 3], [-1, 0]], dtype=np.int64))
    cm = _compile(model, {"data": [6, 5]})
    _same_as_onnxruntime(model, cm, {"data": _data((6, 5), 9)})


def test_an_input_indexing_a_short_axis_gets_valid_random_indices_at_compile_time() -> None:
    """Like BERT's token_type_ids into 2 embeddings: the compile's own random runs (profile,
    verification against onnxruntime) stay in range, so the compile succeeds and verifies."""
    node = helper.make_node("Gather", ["data", "ids"], ["g"], name="token_type")
    model = _model(node, [("data", TensorProto.FLOAT, [2, 5]), ("ids", TensorProto.INT64, [3, 4])], [3, 4, 5])
    cm = opfuse.compile(model, input_shapes={"data": [2, 5], "ids": [3, 4]}, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    ids = np.random.default_rng(10).integers(-2, 2, size=(3, 4)).astype(np.int64)
    _same_as_onnxruntime(model, cm, {"data": _data((2, 5), 10), "ids": ids})
