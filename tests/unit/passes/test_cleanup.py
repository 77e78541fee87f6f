"""`eliminate_noops` (opfuse/passes/cleanup.py) on a tiny graph: Identity and Dropout go away."""

from __future__ import annotations

import numpy as np
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.cleanup import (
    collapse_reshapes,
    eliminate_noops,
    fold_pad_into_conv,
    unit_dim_views,
    where_fill_last,
)
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def test_identity_and_dropout_between_ops_are_removed() -> None:
    model = tiny_model(
        [
            n("Add", ["x", "b"], ["a"], name="add"),
            n("Identity", ["a"], ["i"], name="id"),
            n("Dropout", ["i"], ["d"], name="drop"),
            n("Relu", ["d"], ["y"], name="relu"),
        ],
        {"x": [2, 5]},
        {"y": [2, 5]},
        {"b": weights(5)},
    )
    graph = graph_of(model)
    log = run_pass(graph, eliminate_noops)
    assert ops(graph) == ["Add", "Relu"]
    assert log.fired == {names.ELIMINATE_NOOPS: 2}
    assert_computes_as_onnxruntime(model, graph)


def test_an_identity_from_input_to_output_is_kept() -> None:
    model = tiny_model([n("Identity", ["x"], ["y"], name="id")], {"x": [3]}, {"y": [3]})
    graph = graph_of(model)
    log = run_pass(graph, eliminate_noops)
    assert ops(graph) == ["Identity"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["id"], "its output is a graph output fed directly by a graph input or another output")
    ]


def test_copies_whose_output_is_their_input_are_removed() -> None:
    """A Pad of zero pads (window attention where the map divides by the window), an Expand and a
    Cast to the input's own shape and type, a Slice keeping everything: gone. A Pad that pads, a
    Slice that reverses and an Expand that broadcasts stay."""
    import numpy as np
    from onnx import TensorProto

    ints = {
        "zero": np.zeros(4, dtype=np.int64),
        "pads": np.array([0, 1, 0, 1], dtype=np.int64),
        "shape": np.array([2, 5], dtype=np.int64),
        "wide": np.array([3, 2, 5], dtype=np.int64),
        "s0": np.array([0], dtype=np.int64),
        "e0": np.array([9], dtype=np.int64),
        "ax": np.array([1], dtype=np.int64),
        "one": np.array([1], dtype=np.int64),
        "back": np.array([-1], dtype=np.int64),
        "last": np.array([-1], dtype=np.int64),
        "first": np.array([-9], dtype=np.int64),
    }
    model = tiny_model(
        [
            n("Add", ["x", "b"], ["a"], name="add"),
            n("Pad", ["a", "zero"], ["p"], name="pad0"),
            n("Expand", ["p", "shape"], ["e"], name="expand_same"),
            n("Cast", ["e"], ["c"], name="cast_same", to=TensorProto.FLOAT),
            n("Slice", ["c", "s0", "e0", "ax", "one"], ["s"], name="slice_all"),
            n("Relu", ["s"], ["y"], name="relu"),
            n("Pad", ["y", "pads"], ["padded"], name="pad1"),
            n("Slice", ["y", "last", "first", "ax", "back"], ["reversed"], name="reverse"),
            n("Expand", ["y", "wide"], ["wider"], name="broadcast"),
        ],
        {"x": [2, 5]},
        {"padded": [2, 7], "reversed": [2, 5], "wider": [3, 2, 5]},
        {"b": weights(5), **ints},
    )
    graph = graph_of(model)
    log = run_pass(graph, eliminate_noops)
    assert ops(graph) == ["Add", "Relu", "Pad", "Slice", "Expand"]
    assert log.fired == {names.ELIMINATE_NOOPS: 4}
    assert_computes_as_onnxruntime(model, graph)


def test_a_zero_pad_before_a_conv_becomes_the_convs_own_padding() -> None:
    """TensorFlow's "same" padding as exported (HF MobileNets): a zero Pad of H and W before a
    depthwise and a dense conv is folded into each conv's pads (added to its own). A reflect
    Pad, a Pad of value 1 and a Pad someone else reads stay, each with the reason."""
    import numpy as np

    c = 8
    consts = {
        "p1": np.array([0, 0, 0, 1, 0, 0, 1, 1], dtype=np.int64),
        "p2": np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=np.int64),
        "zero": np.array(0.0, dtype=np.float32),
        "onev": np.array(1.0, dtype=np.float32),
        "wd": weights(c, 1, 3, 3),
        "w": weights(c, c, 3, 3) * 0.2,
    }
    model = tiny_model(
        [
            n("Pad", ["x", "p1", "zero"], ["a"], name="same_pad"),
            n("Conv", ["a", "wd"], ["b"], name="dw", group=c, strides=[2, 2]),
            n("Relu", ["b"], ["r"], name="relu"),
            n("Pad", ["r", "p2"], ["d"], name="pad_dense"),
            n("Conv", ["d", "w"], ["e"], name="dense", pads=[1, 0, 0, 1]),
            n("Pad", ["e", "p2"], ["f"], name="reflect", mode="reflect"),
            n("Conv", ["f", "w"], ["g"], name="after_reflect"),
            n("Pad", ["g", "p2", "onev"], ["h"], name="ones"),
            n("Conv", ["h", "w"], ["y"], name="after_ones"),
        ],
        {"x": [2, c, 9, 8]},
        {"y": [2, c, 5, 5]},
        consts,
    )
    graph = graph_of(model)
    log = run_pass(graph, fold_pad_into_conv)
    assert ops(graph) == ["Conv", "Relu", "Conv", "Pad", "Conv", "Pad", "Conv"]
    convs = [node for node in graph.nodes if node.op_type == "Conv"]
    assert convs[0].attrs["pads"] == [0, 1, 1, 1] and convs[0].inputs[0] == "x"
    assert convs[1].attrs["pads"] == [2, 1, 1, 2]
    assert log.fired == {names.FOLD_PAD_INTO_CONV: 2}
    reasons = sorted(r.reason for r in log.not_fired)
    assert reasons == ["a reflect Pad: a Conv pads with zeros only", "the pad value is not the constant 0"]
    assert_computes_as_onnxruntime(model, graph)


def test_a_reshape_of_a_view_reads_the_views_input_and_an_identity_reshape_goes() -> None:
    """LeViT's Linear on flattened tokens, then the view back: MatMul -> Flatten -> Reshape to the
    MatMul's own shape -> residual Add. The Reshape reads the MatMul's output, is the identity,
    and goes; the Flatten, read by nothing else, goes too. A Reshape of a view with another
    reader reads the view's input; the view stays for that reader."""
    import numpy as np

    import opfuse
    from tests.builders import TEST_DEVICE

    model = tiny_model(
        [
            n("MatMul", ["x", "w"], ["m"], name="linear"),
            n("Flatten", ["m"], ["f"], name="flatten", axis=2),
            n("Reshape", ["f", "back"], ["r"], name="view_back"),
            n("Add", ["x", "r"], ["y"], name="residual"),
            n("Reshape", ["x", "flat"], ["xf"], name="flat_x"),
            n("Reshape", ["xf", "split"], ["z"], name="split_x"),
            n("Relu", ["xf"], ["u"], name="other_reader"),
        ],
        {"x": [1, 4, 8]},
        {"y": [1, 4, 8], "z": [2, 2, 8], "u": [4, 8]},
        {
            "w": weights(8, 8),
            "back": np.array([1, 4, 8], dtype=np.int64),
            "flat": np.array([4, 8], dtype=np.int64),
            "split": np.array([2, 2, 8], dtype=np.int64),
        },
    )
    graph = graph_of(model)
    log = run_pass(graph, collapse_reshapes)
    assert ops(graph) == ["MatMul", "Add", "Reshape", "Reshape", "Relu"]
    assert [node.inputs[0] for node in graph.nodes if node.op_type == "Reshape"] == ["x", "x"]
    assert log.fired == {names.COLLAPSE_RESHAPES: 2}
    assert_computes_as_onnxruntime(model, graph)
    cm = opfuse.compile(model, {"x": [1, 4, 8]}, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    (gemm,) = [g for g in cm.report["fusion"]["groups"] if "linear" in g["nodes"]]
    assert "residual" in gemm["nodes"]  # the Add is the GEMM's epilogue


def test_arithmetic_by_a_neutral_constant_is_removed() -> None:
    """x + 0 (either side), x - 0, x * 1 (either side), x / 1 go; 0 - x, 1 / x, x + 0 that
    broadcasts x to a larger shape, x + 0.5, and a bias vector of zeros (a weight) stay."""
    import numpy as np

    consts = {
        "zero": np.zeros((), dtype=np.float32),
        "zeros": np.zeros((1, 1), dtype=np.float32),
        "one": np.ones((1, 1), dtype=np.float32),
        "bias": np.zeros(5, dtype=np.float32),
        "half": np.full((), 0.5, dtype=np.float32),
    }
    model = tiny_model(
        [
            n("Add", ["x", "zero"], ["a"], name="plus0"),
            n("Add", ["zeros", "a"], ["b0"], name="zero_plus"),
            n("Sub", ["b0", "zero"], ["c"], name="minus0"),
            n("Mul", ["one", "c"], ["d"], name="one_times"),
            n("Div", ["d", "one"], ["e"], name="by1"),
            n("Sub", ["zero", "e"], ["f"], name="zero_minus"),
            n("Div", ["one", "f"], ["g"], name="one_over"),
            n("Add", ["g", "half"], ["h"], name="plus_half"),
            n("Add", ["h", "bias"], ["h1"], name="zero_bias"),
            n("Add", ["h1", "wide0"], ["y"], name="broadcast0"),
        ],
        {"x": [3, 5]},
        {"y": [2, 3, 5]},
        {**consts, "wide0": np.zeros((2, 1, 1), dtype=np.float32)},
    )
    graph = graph_of(model)
    log = run_pass(graph, eliminate_noops)
    assert [x.name for x in graph.nodes] == ["zero_minus", "one_over", "plus_half", "zero_bias", "broadcast0"]
    assert log.fired == {names.ELIMINATE_NOOPS: 5}
    assert_computes_as_onnxruntime(model, graph)


def radix_softmax(read_twice: bool = False, perm: tuple[int, ...] = (0, 2, 1, 3)) -> object:
    """ResNeSt's split attention weights: [B, card, radix, C] moved to [B, radix, card, C]
    (card = 1), Softmax over radix, viewed as [B, radix, C, 1, 1] for the weighted sum."""
    n = helper.make_node
    nodes = [
        n("Transpose", ["a"], ["at"], name="perm", perm=list(perm)),
        n("Softmax", ["at"], ["s"], name="softmax", axis=1),
        n("Reshape", ["s", "shape"], ["y"], name="view"),
    ]
    outputs = {"y": [2, 3, 4, 1, 1]}
    if read_twice:
        nodes.append(n("Neg", ["s"], ["z"], name="neg"))
        outputs["z"] = [[2, 1, 3, 4][p] for p in perm]
    return tiny_model(nodes, {"a": [2, 1, 3, 4]}, outputs, {"shape": np.array([2, 3, 4, 1, 1])}, opset=18)


def test_views_of_size_1_dims_are_reshapes_before_the_softmax() -> None:
    model = radix_softmax()
    graph = graph_of(model)
    log = run_pass(graph, unit_dim_views)
    assert ops(graph) == ["Reshape", "Reshape", "Softmax"] and log.fired == {names.UNIT_DIM_VIEWS: 2}
    assert graph.nodes[-1].attrs["axis"] == 1 and graph.spec(graph.nodes[-1].inputs[0]).shape == (
        2,
        3,
        4,
        1,
        1,
    )
    assert_computes_as_onnxruntime(model, graph)
    run_pass(graph, collapse_reshapes)
    assert ops(graph) == ["Reshape", "Softmax"]
    assert_computes_as_onnxruntime(model, graph)


def test_a_softmax_read_besides_the_view_and_a_transpose_of_other_dims_stay() -> None:
    model = radix_softmax(read_twice=True, perm=(0, 3, 1, 2))  # moves C before radix: a real transpose
    graph = graph_of(model)
    log = run_pass(graph, unit_dim_views)
    assert ops(graph) == ["Transpose", "Softmax", "Reshape", "Neg"] and log.fired == {}
    assert [r.reason for r in log.not_fired] == []  # the view changes more than size-1 dims
    model = radix_softmax(read_twice=True)
    graph = graph_of(model)
    log = run_pass(graph, unit_dim_views)
    assert ops(graph) == ["Reshape", "Softmax", "Reshape", "Neg"]
    assert [r.reason for r in log.not_fired] == ["the Softmax is read besides the Reshape"]
    assert_computes_as_onnxruntime(model, graph)


def test_a_transpose_of_size_1_dims_not_read_by_a_softmax_stays() -> None:
    """EfficientViT's attention over a single token transposes [1, 16, 1] queries to [1, 1, 16]:
    the attention rule looks for that Transpose, so it stays one."""
    n = helper.make_node
    model = tiny_model(
        [
            n("Transpose", ["q"], ["qt"], name="perm", perm=[0, 2, 1]),
            n("MatMul", ["qt", "k"], ["s"], name="scores"),
        ],
        {"q": [1, 16, 1], "k": [1, 16, 1]},
        {"s": [1, 1, 1]},
    )
    graph = graph_of(model)
    log = run_pass(graph, unit_dim_views)
    assert ops(graph) == ["Transpose", "MatMul"] and log.fired == {}


def test_a_view_after_a_softmax_of_computed_scores_stays_after_it() -> None:
    """BLOOM's attention adds its mask to [1, H, T, T] scores, takes the Softmax and views it as
    [H, T, T]: moved before the Softmax, the view would leave the Add in another shape than the
    Softmax, out of its row kernel."""
    n = helper.make_node
    model = tiny_model(
        [
            n("Add", ["s", "mask"], ["m"], name="mask"),
            n("Softmax", ["m"], ["p"], name="softmax", axis=-1),
            n("Reshape", ["p", "shape"], ["y"], name="view"),
        ],
        {"s": [1, 2, 4, 4], "mask": [1, 1, 4, 4]},
        {"y": [2, 4, 4]},
        {"shape": np.array([2, 4, 4])},
    )
    graph = graph_of(model)
    log = run_pass(graph, unit_dim_views)
    assert ops(graph) == ["Add", "Softmax", "Reshape"] and log.fired == {}


def test_reductions_over_axes_of_one_element_are_their_input() -> None:
    """A mean over size-1 axes that drops them (AlexNet's adaptive pool of a 1x1 map, as the
    dynamo exporter writes it) becomes a Reshape; a global pool of a 1x1 map goes. A max that
    keeps its size-1 axes (the row planner's anchor for a broadcast row's ops), a sum over an axis
    of three, and a LogSumExp (log(exp(x)) can overflow where x does not) stay."""
    import numpy as np

    model = tiny_model(
        [
            n("Relu", ["x"], ["r"], name="relu"),
            n("ReduceMean", ["r", "unit"], ["m"], name="mean", keepdims=0),
            n("ReduceMax", ["r", "ends"], ["k"], name="max", keepdims=1),
            n("Sigmoid", ["y"], ["t"], name="sigmoid"),
            n("GlobalAveragePool", ["t"], ["g"], name="pool"),
            n("ReduceSum", ["r", "three"], ["s"], name="sum", keepdims=0),
            n("ReduceLogSumExp", ["r", "second"], ["l"], name="lse", keepdims=1),
        ],
        {"x": [2, 1, 3, 1, 1], "y": [2, 4, 1, 1]},
        {"m": [2, 3], "k": [2, 1, 3, 1, 1], "g": [2, 4, 1, 1], "s": [2, 1, 1, 1], "l": [2, 1, 3, 1, 1]},
        {
            "unit": np.array([1, 3, 4], dtype=np.int64),
            "ends": np.array([1, -1], dtype=np.int64),
            "three": np.array([2], dtype=np.int64),
            "second": np.array([1], dtype=np.int64),
        },
    )
    graph = graph_of(model)
    log = run_pass(graph, eliminate_noops)
    assert ops(graph) == ["Relu", "Reshape", "ReduceMax", "Sigmoid", "ReduceSum", "ReduceLogSumExp"]
    assert log.fired == {names.ELIMINATE_NOOPS: 2}
    assert_computes_as_onnxruntime(model, graph)


def test_a_fill_first_where_on_a_constant_condition_swaps_its_branches() -> None:
    """Where(mask, fill, x) is Where(not mask, x, fill) where mask is a constant; a condition
    computed at run time, or a tensor in both branches, stays as written."""
    n = helper.make_node
    mask = np.random.default_rng(2).random((3, 5)) > 0.5
    model = tiny_model(
        [
            n("Tanh", ["x"], ["t"]),
            n("Where", ["mask", "low", "t"], ["a"], name="fill"),
            n("Greater", ["x", "zero"], ["pos"]),
            n("Where", ["pos", "low", "a"], ["b"], name="computed"),
            n("Where", ["mask", "t", "b"], ["y"], name="tensors"),
        ],
        {"x": [2, 3, 5]},
        {"y": [2, 3, 5]},
        {"mask": mask, "low": np.array(-3.5, dtype=np.float32), "zero": np.array(0.0, dtype=np.float32)},
    )
    graph = graph_of(model)
    log = run_pass(graph, where_fill_last)
    assert log.fired == {names.WHERE_FILL_LAST: 1}
    (fill,) = [x for x in graph.nodes if x.name == "fill"]
    assert fill.inputs[1:] == ["t", "low"]
    np.testing.assert_array_equal(graph.constants[fill.inputs[0]], ~mask)
    assert [x.inputs[1] for x in graph.nodes if x.name in ("computed", "tensors")] == ["low", "t"]
    assert_computes_as_onnxruntime(model, graph)
