"""The frontend's refusals: malformed graphs, unsupported types and values, training mode, shapes that
depend on run-time data and op versions nobody reviewed. Each must be one clear ModelError naming
the node or value at fault, raised before any compile work, never a crash or a wrong answer.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.errors import ModelError
from opfuse.frontend.inspect import inspect_model
from opfuse.frontend.load import load_and_specialize
from opfuse.frontend.opsets import REVIEWED_VERSIONS, check_node_versions
from opfuse.runtime.ops import SUPPORTED_OPS

n = helper.make_node


def model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, tuple[int, list[int]]] | None = None,
    outputs: dict[str, tuple[int, list[int]]] | None = None,
    inits: dict[str, np.ndarray] | None = None,
    opset: int = 18,
) -> onnx.ModelProto:
    ins = inputs if inputs is not None else {"x": (TensorProto.FLOAT, [2, 3])}
    outs = outputs if outputs is not None else {"y": (TensorProto.FLOAT, [2, 3])}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(k, t, s) for k, (t, s) in ins.items()],
        [helper.make_tensor_value_info(k, t, s) for k, (t, s) in outs.items()],
        initializer=[numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def refused(m: onnx.ModelProto, shapes: dict[str, list[int]] | None = None) -> str:
    """The ModelError message compiling `m` ends in (through the public API)."""
    with pytest.raises(ModelError) as exc:
        opfuse.compile(m, input_shapes=shapes, device="cpu", verify=False)
    return str(exc.value)


# --- malformed graphs -------------------------------------------------------------------------------


def test_cycle_is_named_node_by_node() -> None:
    m = model(
        [
            n("Add", ["x", "b"], ["a"], name="add"),
            n("Relu", ["a"], ["b"], name="relu"),
            n("Neg", ["a"], ["y"]),
        ]
    )
    msg = refused(m)
    assert "cycle" in msg and "'add' (Add)" in msg and "'relu' (Relu)" in msg


def test_self_loop_is_a_cycle() -> None:
    assert "cycle" in refused(model([n("Relu", ["y"], ["y"], name="loop")]))


def test_dangling_input_names_node_and_value() -> None:
    msg = refused(model([n("Add", ["x", "ghost"], ["y"], name="add")]))
    assert "'add' (Add) reads 'ghost', which no node, graph input or initializer provides" in msg


def test_value_written_twice() -> None:
    msg = refused(model([n("Relu", ["x"], ["y"], name="a"), n("Neg", ["x"], ["y"], name="b")]))
    assert "value 'y' is written twice" in msg and "'a' (Relu)" in msg and "'b' (Neg)" in msg


def test_node_overwriting_a_graph_input() -> None:
    msg = refused(model([n("Relu", ["x"], ["x"], name="r"), n("Neg", ["x"], ["y"])]))
    assert "value 'x' is written twice" in msg


def test_duplicate_graph_output() -> None:
    m = model([n("Relu", ["x"], ["y"])])
    m.graph.output.append(m.graph.output[0])
    assert "graph output 'y' is listed twice" in refused(m)


def test_output_nobody_produces() -> None:
    m = model([n("Relu", ["x"], ["a"])])
    assert "graph output 'y' is not produced" in refused(m)


def test_duplicate_graph_input() -> None:
    m = model([n("Relu", ["x"], ["y"])])
    m.graph.input.append(m.graph.input[0])
    assert "graph input 'x' is declared twice" in refused(m)


def test_nodes_out_of_order_are_sorted_not_refused() -> None:
    m = model([n("Relu", ["a"], ["y"], name="second"), n("Neg", ["x"], ["a"], name="first")])
    cm = opfuse.compile(m, device="cpu", verify=False)
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    np.testing.assert_array_equal(cm.run({"x": x})["y"], np.maximum(-x, 0))


def test_upload_check_reports_malformed_graphs_too() -> None:
    # The API server's upload check (torch-free) runs the same structural checks.
    m = model([n("Add", ["x", "b"], ["a"]), n("Relu", ["a"], ["b"]), n("Neg", ["a"], ["y"])])
    with pytest.raises(ModelError, match="cycle"):
        inspect_model(m.SerializeToString())


# --- wrong types --------------------------------------------------------------------------------


def test_mismatched_input_types() -> None:
    m = model(
        [n("Add", ["x", "i"], ["y"], name="add")],
        inputs={"x": (TensorProto.FLOAT, [2, 3]), "i": (TensorProto.INT64, [2, 3])},
    )
    msg = refused(m)
    assert "inconsistent" in msg and "Add" in msg


def test_declared_output_type_contradicts_the_op() -> None:
    m = model([n("Relu", ["x"], ["y"])], outputs={"y": (TensorProto.INT64, [2, 3])})
    assert "inconsistent" in refused(m)


def test_declared_output_shape_contradicts_the_op() -> None:
    m = model([n("Relu", ["x"], ["y"])], outputs={"y": (TensorProto.FLOAT, [3, 2])})
    assert "inconsistent" in refused(m)


def test_attribute_of_the_wrong_kind() -> None:
    m = model([n("Transpose", ["x"], ["y"], perm=1.5)])
    assert "checker" in refused(m)


@pytest.mark.parametrize(
    ("elem", "needle"),
    [
        (TensorProto.STRING, "string tensors"),
        (TensorProto.UINT32, "uint16/uint32/uint64"),
        (TensorProto.FLOAT8E4M3FN, "float8"),
        (TensorProto.COMPLEX64, "complex"),
    ],
)
def test_unsupported_element_types_are_named(elem: int, needle: str) -> None:
    m = model([n("Identity", ["x"], ["y"])], inputs={"x": (elem, [2, 3])}, outputs={"y": (elem, [2, 3])})
    msg = refused(m)
    assert "graph input 'x'" in msg and needle in msg


def test_cast_to_an_unsupported_type() -> None:
    m = model(
        [n("Cast", ["x"], ["y"], name="c", to=TensorProto.UINT64)],
        outputs={"y": (TensorProto.UINT64, [2, 3])},
    )
    assert "'c' (Cast) casts to element type uint64" in refused(m)


def test_sequence_input_is_refused() -> None:
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])
    graph = helper.make_graph(
        [n("SequenceAt", ["s", "i"], ["y"])],
        "g",
        [seq, helper.make_tensor_value_info("i", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    msg = refused(m)
    assert "not a tensor" in msg and "'s'" in msg


# --- shapes that depend on run-time data ----------------------------------------------------------


def test_reshape_to_a_fed_shape_is_refused() -> None:
    m = model(
        [n("Reshape", ["x", "shape"], ["y"], name="r")],
        inputs={"x": (TensorProto.FLOAT, [2, 3]), "shape": (TensorProto.INT64, [2])},
        outputs={"y": (TensorProto.FLOAT, [3, 2])},
    )
    msg = refused(m)
    assert "'r' (Reshape) input 1 ('shape') is computed at run time from graph input(s) 'shape'" in msg


def test_shape_computed_from_input_values_is_refused_through_arithmetic() -> None:
    m = model(
        [
            n("ReduceMax", ["x"], ["m"], keepdims=0),
            n("Cast", ["m"], ["k"], to=TensorProto.INT64),
            n("Unsqueeze", ["k", "zero"], ["k1"]),
            n("Expand", ["x", "k1"], ["y"], name="e"),
        ],
        inits={"zero": np.array([0], dtype=np.int64)},
    )
    assert "'e' (Expand) input 1 ('k1') is computed at run time from graph input(s) 'x'" in refused(m)


def test_shape_computed_from_input_shapes_is_fine() -> None:
    # Shape -> Gather -> Concat -> Reshape: shape arithmetic, folded at compile time.
    m = model(
        [
            n("Shape", ["x"], ["s"]),
            n("Gather", ["s", "one"], ["d1"], axis=0),
            n("Concat", ["d1", "minus1"], ["new_shape"], axis=0),
            n("Reshape", ["x", "new_shape"], ["y"]),
        ],
        inputs={"x": (TensorProto.FLOAT, ["batch", 6])},
        outputs={"y": (TensorProto.FLOAT, [6, "batch"])},
        inits={"one": np.array([1], dtype=np.int64), "minus1": np.array([-1], dtype=np.int64)},
    )
    cm = opfuse.compile(m, input_shapes={"x": [2, 6]}, device="cpu", verify=False)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    np.testing.assert_array_equal(cm.run({"x": x})["y"], x.reshape(6, 2))


def test_nonzero_of_run_time_data_is_refused_but_of_a_constant_runs() -> None:
    fed = model([n("NonZero", ["x"], ["y"], name="nz")], outputs={"y": (TensorProto.INT64, [2, "n"])})
    assert "'nz' (NonZero) input 0 ('x') is computed at run time" in refused(fed)
    const = model(
        [
            n("NonZero", ["c"], ["idx"]),
            n("Cast", ["idx"], ["f"], to=TensorProto.FLOAT),
            n("Add", ["x", "f"], ["y"]),
        ],
        inputs={"x": (TensorProto.FLOAT, [2, 2])},
        outputs={"y": (TensorProto.FLOAT, [2, 2])},
        inits={"c": np.array([[1, 0, 2]], dtype=np.float32)},
    )
    cm = opfuse.compile(const, device="cpu", verify=False)
    x = np.ones((2, 2), dtype=np.float32)
    np.testing.assert_array_equal(cm.run({"x": x})["y"], x + np.array([[0, 0], [0, 2]]))


# --- training mode, randomness, newer op versions ------------------------------------------------


def test_training_mode_batchnorm_is_refused() -> None:
    """Where its running statistics are read (a training step's state update). One whose only
    output read is Y is written out instead (tests/unit/test_batch_statistics.py)."""
    c = np.ones(3, dtype=np.float32)
    m = model(
        [
            n(
                "BatchNormalization",
                ["x", "c", "c", "c", "c"],
                ["y", "mean", "var"],
                name="bn",
                training_mode=1,
            )
        ],
        inputs={"x": (TensorProto.FLOAT, [2, 3, 4])},
        outputs={
            "y": (TensorProto.FLOAT, [2, 3, 4]),
            "mean": (TensorProto.FLOAT, [3]),
            "var": (TensorProto.FLOAT, [3]),
        },
        inits={"c": c},
    )
    msg = refused(m)
    assert "training mode" in msg and "'bn' (BatchNormalization)" in msg and "eval" in msg


def test_dropout_with_training_mode_true_or_fed_is_refused() -> None:
    on = model([n("Dropout", ["x", "", "t"], ["y"], name="d")], inits={"t": np.array(True)})
    assert "'d' (Dropout) has training_mode=true" in refused(on)
    fed = model(
        [n("Dropout", ["x", "", "t"], ["y"], name="d")],
        inputs={"x": (TensorProto.FLOAT, [2, 3]), "t": (TensorProto.BOOL, [])},
    )
    assert "takes training_mode from run-time value 't'" in refused(fed)


def test_random_ops_are_refused_as_nondeterministic() -> None:
    m = model([n("RandomNormalLike", ["x"], ["y"], name="noise")])
    msg = refused(m)
    assert "does not support" in msg and "RandomNormalLike (nodes 'noise'): nondeterministic" in msg


def test_control_flow_is_refused_with_its_reason() -> None:
    body = helper.make_graph(
        [n("Identity", ["x"], ["out"])],
        "b",
        [],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])],
    )
    m = model(
        [n("If", ["c"], ["y"], name="branch", then_branch=body, else_branch=body)],
        inputs={"x": (TensorProto.FLOAT, [2, 3]), "c": (TensorProto.BOOL, [])},
    )
    assert "If (nodes 'branch'): control flow" in refused(m)


def test_if_on_a_shape_is_inlined() -> None:
    # TorchScript's squeeze(dim): "If dim 1 has size 1, Squeeze it, else keep it". With the dim bound
    # by input_shapes the condition is a constant and the taken branch replaces the If.
    def branch(name: str, op: onnx.NodeProto) -> onnx.GraphProto:
        return helper.make_graph([op], name, [], [helper.make_value_info(f"{name}_out", onnx.TypeProto())])

    then = branch("then", n("Squeeze", ["x", "one"], ["then_out"]))
    other = branch("else", n("Identity", ["x"], ["else_out"]))
    m = model(
        [
            n("Shape", ["x"], ["s"]),
            n("Gather", ["s", "one"], ["d"], axis=0),
            n("Equal", ["d", "one"], ["is_one"]),
            n("If", ["is_one"], ["sq"], name="maybe_squeeze", then_branch=then, else_branch=other),
            n("Shape", ["sq"], ["shape"]),
            n("ReduceSum", ["sq"], ["total"], keepdims=0),
        ],
        inputs={"x": (TensorProto.FLOAT, [2, "n", 3])},
        outputs={"shape": (TensorProto.INT64, ["rank"]), "total": (TensorProto.FLOAT, [])},
        inits={"one": np.array([1], dtype=np.int64)},
    )
    for dims in ([2, 1, 3], [2, 2, 3]):
        x = np.arange(np.prod(dims), dtype=np.float32).reshape(dims)
        out = opfuse.compile(m, input_shapes={"x": dims}, device="cpu", verify=False).run({"x": x})
        expected_shape = [2, 3] if dims[1] == 1 else dims
        np.testing.assert_array_equal(out["shape"], expected_shape)
        np.testing.assert_allclose(out["total"], x.sum())


def test_op_of_an_unreviewed_newer_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend Relu's version 14 had never been reviewed, in a model newer than the canonical opset.
    m = model([n("Relu", ["x"], ["y"], name="r")], opset=21)
    check_node_versions(m)
    monkeypatch.setitem(REVIEWED_VERSIONS, "Relu", 13)
    monkeypatch.setattr("opfuse.frontend.opsets.CANONICAL_OPSET", 13)
    with pytest.raises(ModelError, match=r"'r' \(Relu\) is version 14"):
        check_node_versions(m)


def test_every_supported_op_version_after_18_was_reviewed() -> None:
    # A newer onnx with new op versions fails this until someone reads their changelog and updates
    # REVIEWED_VERSIONS (opfuse/frontend/opsets.py) and the runtime.
    unreviewed = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        reviewed = REVIEWED_VERSIONS.get(schema.name, 18)
        if schema.domain == "" and schema.name in SUPPORTED_OPS and schema.since_version > reviewed:
            unreviewed[schema.name] = schema.since_version
    assert not unreviewed


def test_errors_come_before_any_work_and_list_everything() -> None:
    # Two unsupported ops and a type problem: the unsupported ops are all listed, in one error.
    m = model(
        [
            n("Unique", ["x"], ["a"], name="u"),
            n("MaxUnpool", ["a", "a", "a"], ["y"], name="g", kernel_shape=[1]),
        ],
    )
    msg = load_error(m)
    assert "2 op type(s)" in msg and "'u'" in msg and "'g'" in msg


def load_error(m: onnx.ModelProto) -> str:
    with pytest.raises(ModelError) as exc:
        load_and_specialize(m, None, SUPPORTED_OPS)
    return str(exc.value)
