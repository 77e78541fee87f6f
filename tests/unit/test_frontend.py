"""Frontend: checks, specialization errors, unsupported ops, opset conversion."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from opfuse.errors import ModelError
from opfuse.frontend.inspect import inspect_model
from opfuse.frontend.load import CANONICAL_OPSET, load_and_specialize
from opfuse.runtime.ops import SUPPORTED_OPS
from tests.builders import residual_mlp


def test_inspect_reports_dynamic_dims() -> None:
    info = inspect_model(residual_mlp().SerializeToString())
    assert info.opset == 18
    assert info.inputs[0].name == "x" and info.inputs[0].shape == ["batch", 32]
    assert info.outputs[0].dtype == "float32"


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"\x00garbage\xff" * 10, "not an ONNX model"),
        (residual_mlp().SerializeToString()[:50], "not an ONNX model"),
    ],
)
def test_inspect_rejects_garbage(data: bytes, needle: str) -> None:
    with pytest.raises(ModelError, match=needle):
        inspect_model(data)


def test_external_data_is_refused_with_instructions() -> None:
    model = residual_mlp()
    init = model.graph.initializer[0]
    init.data_location = TensorProto.EXTERNAL
    entry = init.external_data.add()
    entry.key, entry.value = "location", "../../etc/passwd"
    with pytest.raises(ModelError, match="save_as_external_data=False"):
        inspect_model(model.SerializeToString())


def test_unbound_dynamic_dims_are_listed() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])
    m = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    with pytest.raises(ModelError) as exc:
        load_and_specialize(m, None, SUPPORTED_OPS)
    assert "input 'x' dim 0 ('batch')" in str(exc.value) and "input 'x' dim 1 ('seq')" in str(exc.value)
    with pytest.raises(ModelError, match="not a graph input"):
        load_and_specialize(m, {"x": [2, 3], "nope": [1]}, SUPPORTED_OPS)
    with pytest.raises(ModelError, match="non-negative"):
        load_and_specialize(m, {"x": [2, -1]}, SUPPORTED_OPS)


def test_unsupported_ops_are_listed_with_node_names() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("Unique", ["a"], ["b"], name="first"),
        helper.make_node("LpPool", ["b"], ["c"], name="ok2", kernel_shape=[1]),
        helper.make_node("MaxUnpool", ["c", "c", "c"], ["y"], name="second", kernel_shape=[1]),
    ]
    m = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 18)]
    )
    with pytest.raises(ModelError) as exc:
        load_and_specialize(m, None, SUPPORTED_OPS)
    assert "Unique (nodes 'first')" in str(exc.value) and "MaxUnpool (nodes 'second')" in str(exc.value)


def test_old_opset_is_converted_and_specialized() -> None:
    model = residual_mlp(opset=13)
    _, spec = load_and_specialize(model, {"x": [3, 32]}, SUPPORTED_OPS)
    assert [o.version for o in spec.opset_import if o.domain == ""] == [CANONICAL_OPSET]
    dims = [d.dim_value for d in spec.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [3, 32]


def test_fixed_dim_mismatch_is_an_error() -> None:
    with pytest.raises(ModelError, match="fixed at 32"):
        load_and_specialize(residual_mlp(), {"x": [2, 16]}, SUPPORTED_OPS)


def test_initializers_listed_as_inputs_are_constants() -> None:
    model = residual_mlp()
    for init in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    _, spec = load_and_specialize(model, {"x": [2, 32]}, SUPPORTED_OPS)
    assert [i.name for i in spec.graph.input] == ["x"]
    assert np.prod([d.dim_value for d in spec.graph.input[0].type.tensor_type.shape.dim]) == 64
    onnx.checker.check_model(spec)


def test_shape_inference_runs_without_the_weights_bytes_and_updates_the_model() -> None:
    """infer_shapes runs onnx's inference on a copy without the bytes of large weights (speed),
    with the same result as inference on the whole model, written into the model, which keeps
    every byte of every weight."""
    from onnx import numpy_helper, shape_inference

    from opfuse.frontend.inspect import WEIGHT_BYTES
    from opfuse.frontend.load import infer_shapes

    rng = np.random.default_rng(4)
    big = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "w")
    small = numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b")
    shape = numpy_helper.from_array(np.array([4, 8, 4], dtype=np.int64), "shape")
    assert len(big.raw_data) > WEIGHT_BYTES >= len(small.raw_data)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["z"]),
        helper.make_node("Reshape", ["z", "shape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [big, small, shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    before = [t.SerializeToString() for t in model.graph.initializer]
    inferred = infer_shapes(model)
    assert inferred is model
    plain = shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    assert inferred.graph.value_info == plain.graph.value_info and len(plain.graph.value_info) == 2
    assert inferred.graph.output == plain.graph.output
    assert [d.dim_value for d in inferred.graph.output[0].type.tensor_type.shape.dim] == [4, 8, 4]
    assert [t.SerializeToString() for t in model.graph.initializer] == before
    assert [t.SerializeToString() for t in inferred.graph.initializer] == before


def test_graph_copy_shares_weights_but_not_structure() -> None:
    """compile keeps two copies of the graph (the unfused plan, the fallback reference): the weight
    arrays are shared, everything a pass changes is not."""
    from opfuse.graph import graph_from_onnx

    _, spec = load_and_specialize(residual_mlp(), {"x": [4, 32]}, SUPPORTED_OPS)
    graph = graph_from_onnx(spec)
    twin = graph.copy()
    assert graph.constants and all(twin.constants[k] is v for k, v in graph.constants.items())
    assert twin.nodes[0] is not graph.nodes[0] and twin.nodes[0].id == graph.nodes[0].id
    name = next(iter(graph.constants))
    graph.constants[name] = graph.constants[name].astype(np.float16)  # what apply_precision does
    graph.nodes.pop()
    graph.nodes[0].attrs["changed"] = 1
    assert twin.constants[name].dtype == np.float32
    assert len(twin.nodes) == len(graph.nodes) + 1 and "changed" not in twin.nodes[0].attrs


def test_the_checker_reads_the_uploaded_bytes_unless_the_nodes_were_reordered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opfuse.frontend import inspect as insp

    data = residual_mlp().SerializeToString()
    seen: list[type] = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: (seen.append(type(m)), real(m))[1])
    insp.check_model(insp.parse_model(data), data)
    assert seen == [bytes]
    shuffled = insp.parse_model(data)
    nodes = list(shuffled.graph.node)
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(reversed(nodes))
    insp.check_model(shuffled, shuffled.SerializeToString())  # reordered in place: the proto is checked
    assert seen == [bytes, onnx.ModelProto]


def test_the_onnx_optimizer_leaves_the_model_it_is_given_alone() -> None:
    """optimize_onnx folds into a new model; the specialized model (the verification's and the
    unfused plan's source) stays as it was."""
    from opfuse.passes.pipeline import optimize_onnx

    _, spec = load_and_specialize(residual_mlp(), {"x": [4, 32]}, SUPPORTED_OPS)
    before = spec.SerializeToString()
    optimized, status = optimize_onnx(spec)
    assert status == "applied" and optimized is not spec
    assert spec.SerializeToString() == before


def test_fp16_weights_shared_by_two_graphs_are_cast_once() -> None:
    from opfuse.graph import graph_from_onnx
    from opfuse.passes.precision import apply_precision
    from tests.builders import residual_mlp

    _, specialized = load_and_specialize(residual_mlp(), {"x": [4, 32]}, SUPPORTED_OPS)
    graph = graph_from_onnx(specialized)
    other = graph.copy()  # shares the weight arrays
    fp32 = {k: v.copy() for k, v in graph.constants.items()}
    other.constants["extra"] = np.ones(3, np.float32)  # not shared: cast on its own
    cast: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    apply_precision(graph, "fp16", cast)
    apply_precision(other, "fp16", cast)
    floats = [k for k, v in fp32.items() if v.dtype == np.float32]
    assert floats
    for k in floats:
        assert graph.constants[k] is other.constants[k]  # one fp16 array for both
        assert graph.constants[k].dtype == np.float16
        np.testing.assert_array_equal(graph.constants[k], fp32[k].astype(np.float16))
    assert other.constants["extra"].dtype == np.float16
