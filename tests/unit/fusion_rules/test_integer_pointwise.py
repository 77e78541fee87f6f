"""`pointwise` on integers and booleans: the mask and position-id arithmetic a model does at run
time (RoBERTa's position ids from its token ids) computed exactly in one generated kernel, in
registers of the values' own types, not as one library launch per op."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.frontend import rule_registry as names
from tests.builders import TEST_DEVICE, claimed, planned

n = helper.make_node
PAD = 1


def position_ids(rows: tuple[int, int] = (2, 9)) -> onnx.ModelProto:
    """RoBERTa's create_position_ids_from_input_ids as the default exporter writes it:
    mask = ids != pad; pos = cumsum(mask) * mask + pad, through int32 and int64 Casts; and a float
    attention bias from the same mask (0 where a token is kept, -10000 where it is padding)."""
    inits = {
        "pad": np.array(PAD, dtype=np.int64),
        "axis": np.array(1, dtype=np.int64),
        "zero": np.array(0.0, dtype=np.float32),
        "neg": np.array(-10000.0, dtype=np.float32),
    }
    nodes = [
        n("Equal", ["ids", "pad"], ["is_pad"], name="equal"),
        n("Not", ["is_pad"], ["keep"], name="ne"),
        n("Cast", ["keep"], ["keep32"], name="to_int32", to=TensorProto.INT32),
        n("Cast", ["keep32"], ["keep64"], name="to_int64", to=TensorProto.INT64),
        n("CumSum", ["keep64", "axis"], ["running"], name="cumsum"),
        n("Cast", ["running"], ["running32"], name="type_as", to=TensorProto.INT32),
        n("Mul", ["running32", "keep32"], ["kept"], name="mul"),
        n("Cast", ["kept"], ["kept64"], name="to_int64_again", to=TensorProto.INT64),
        n("Add", ["kept64", "pad"], ["pos"], name="add"),
        n("Where", ["keep", "zero", "neg"], ["bias"], name="where"),
    ]
    graph = helper.make_graph(
        nodes,
        "position_ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, list(rows))],
        [
            helper.make_tensor_value_info("pos", TensorProto.INT64, list(rows)),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, list(rows)),
        ],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _check(
    model: onnx.ModelProto, feeds_of: list[dict[str, np.ndarray]], precision: str = "fp32"
) -> opfuse.CompiledModel:
    shapes = {k: list(v.shape) for k, v in feeds_of[0].items()}
    cm = opfuse.compile(model, input_shapes=shapes, precision=precision, device=TEST_DEVICE)
    assert not cm.report["verification"]["rolled_back"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in feeds_of:
        outs = cm.run(feeds)
        for o, want in zip(model.graph.output, sess.run(None, feeds), strict=True):
            assert outs[o.name].dtype == want.dtype, o.name
            np.testing.assert_array_equal(outs[o.name], want, err_msg=o.name)  # exact: integers, masks
    return cm


def _ids(seed: int, rows: tuple[int, int]) -> dict[str, np.ndarray]:
    """Token ids with padding (PAD) at random places, some rows ending in it."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, size=rows).astype(np.int64)
    ids[rng.random(rows) < 0.3] = PAD
    ids[0, -3:] = PAD
    return {"ids": ids}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_position_ids_are_two_kernels_around_the_cumsum(precision: str) -> None:
    model = position_ids()
    _, plan = planned(model)
    groups = sorted((kind, rule, sorted(nodes)) for kind, rule, nodes in claimed(plan))
    assert groups == sorted(
        [
            ("pointwise", names.POINTWISE, sorted(["equal", "ne", "to_int32", "to_int64", "where"])),
            ("pointwise", names.POINTWISE, sorted(["type_as", "mul", "to_int64_again", "add"])),
        ]
    )
    cm = _check(model, [_ids(0, (2, 9)), _ids(1, (2, 9))], precision)
    # Two generated kernels and the library's CumSum, where ten library ops ran before.
    assert cm.report["kernels"]["before"] == 10
    assert cm.report["kernels"]["after"] == 3
    sources = [k.source for k in cm.plan.kernels.values()]
    assert any("(x0 == 1)" in s for s in sources)  # the pad id as an integer literal, compared exactly


def test_integer_arithmetic_is_exact_past_float32s_range() -> None:
    """int64 values above 2**24 (which float32 cannot hold exactly) added, subtracted, multiplied
    and compared: any float round trip would change the low digits."""
    big = np.array(2**40 + 3, dtype=np.int64)
    model_nodes = [
        n("Add", ["x", "big"], ["a"], name="add"),
        n("Mul", ["a", "three"], ["m"], name="mul"),
        n("Sub", ["m", "x"], ["y"], name="sub"),
        n("Greater", ["y", "big"], ["gt"], name="gt"),
        n("Max", ["y", "x"], ["mx"], name="max"),
    ]
    graph = helper.make_graph(
        model_nodes,
        "ints",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [3, 5])],
        [
            helper.make_tensor_value_info("y", TensorProto.INT64, [3, 5]),
            helper.make_tensor_value_info("gt", TensorProto.BOOL, [3, 5]),
            helper.make_tensor_value_info("mx", TensorProto.INT64, [3, 5]),
        ],
        initializer=[
            numpy_helper.from_array(big, "big"),
            numpy_helper.from_array(np.array(3, dtype=np.int64), "three"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    rng = np.random.default_rng(7)
    feeds = [{"x": rng.integers(-(2**30), 2**30, size=(3, 5)).astype(np.int64)} for _ in range(2)]
    cm = _check(model, feeds)
    assert cm.report["kernels"]["after"] == 1


def test_an_integer_read_as_a_shape_stays_an_op() -> None:
    """A value a Reshape reads as its shape is never a kernel's output on the device (with static
    shapes such a value is folded before planning, and a model whose shapes depend on its data is
    refused; the guard holds if one remains)."""
    from opfuse.fusion.rules.pointwise import _read_as_shape
    from opfuse.ir.graph import Graph, Node, TensorSpec

    nodes = [
        Node("n0", "Add", ["s", "one"], ["s1"], name="add"),
        Node("n1", "Mul", ["s1", "two"], ["shape"], name="mul"),
        Node("n2", "Reshape", ["x", "shape"], ["y"], name="reshape"),
        Node("n3", "Mul", ["s1", "s"], ["z"], name="data"),
        Node("n4", "ConstantOfShape", ["z"], ["w"], name="fill"),
    ]
    specs = {k: TensorSpec(k, "int64", (2,)) for k in ("s", "s1", "shape", "z")}
    specs |= {"x": TensorSpec("x", "float32", (4, 6)), "y": TensorSpec("y", "float32", (2, 12))}
    g = Graph(nodes, [specs["x"], specs["s"]], [specs["y"]], {}, specs)
    assert _read_as_shape(g, nodes[1])  # Reshape's shape
    assert _read_as_shape(g, nodes[3])  # ConstantOfShape reads even its first input as a shape
    assert not _read_as_shape(g, nodes[0])  # read by two Muls, as data
