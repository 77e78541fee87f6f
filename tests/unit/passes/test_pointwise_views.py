"""`pointwise_before_views` (opfuse/passes/pointwise_views.py): pointwise ops move above the views
before them, exactly, and only where their constants broadcast alike on both sides."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.pointwise_views import pointwise_before_views
from tests.builders import (
    assert_computes_as_onnxruntime,
    claimed,
    graph_of,
    ops,
    planned,
    run_pass,
    tiny_model,
    weights,
)

n = helper.make_node


def levit_linear() -> onnx.ModelProto:
    """LeViT's Linear + BatchNorm1d as exported: MatMul, flatten the tokens, BatchNormalization
    over the channels, unflatten, Hardswish, then the next MatMul."""
    c = 8
    var = np.abs(weights(c, seed=4)) + 0.5
    return tiny_model(
        [
            n("MatMul", ["x", "w"], ["h"], name="fc1"),
            n("Reshape", ["h", "flat"], ["h2"], name="flatten"),
            n("BatchNormalization", ["h2", "s", "b", "m", "v"], ["bn"], name="bn"),
            n("Reshape", ["bn", "unflat"], ["bn3"], name="unflatten"),
            n("HardSwish", ["bn3"], ["act"], name="act"),
            n("MatMul", ["act", "w2"], ["y"], name="fc2"),
        ],
        {"x": [2, 5, 6]},
        {"y": [2, 5, 3]},
        {
            "w": weights(6, c, seed=1),
            "flat": np.array([10, c]),
            "s": weights(c, seed=2) + 1.0,
            "b": weights(c, seed=3),
            "m": weights(c, seed=5),
            "v": var,
            "unflat": np.array([2, 5, c]),
            "w2": weights(c, 3, seed=6),
        },
    )


def test_a_batchnorm_and_activation_behind_views_join_the_gemm_epilogue() -> None:
    model = levit_linear()
    graph, plan = planned(model)
    kinds = [(kind, nodes) for kind, _, nodes in claimed(plan)]
    # The first MatMul's epilogue takes the normalization and the activation; the views follow.
    assert ("gemm", ["fc1", "bn", "bn", "act"]) in kinds, kinds
    # The views, a flatten and the view back, left behind the activation, are one identity
    # Reshape that collapse_reshapes removes.
    assert "HardSwish" in ops(graph) and "Reshape" not in ops(graph)
    assert_computes_as_onnxruntime(model, graph)
    _, without = planned(model, disabled=(names.POINTWISE_BEFORE_VIEWS,))
    assert all(nodes != ["fc1", "bn", "bn", "act"] for _, _, nodes in claimed(without))


def test_the_compiled_linear_runs_in_two_launches_and_matches_onnxruntime() -> None:
    import onnxruntime as ort

    import opfuse

    model = levit_linear()
    cm = opfuse.compile(model, device="cpu")
    assert cm.report["verification"]["passed"] is True
    # fc1 with the normalization and the activation, then fc2; without the move, the
    # normalization runs as a kernel of its own and the activation as fc2's prologue (computed
    # on its A tiles), or as a kernel of its own too without operand_prologue.
    assert cm.report["kernels"]["after"] == 2
    off = opfuse.compile(model, device="cpu", fusion_disable=[names.POINTWISE_BEFORE_VIEWS])
    assert off.report["kernels"]["after"] == 3
    off = opfuse.compile(
        model, device="cpu", fusion_disable=[names.POINTWISE_BEFORE_VIEWS, names.OPERAND_PROLOGUE]
    )
    assert off.report["kernels"]["after"] == 4
    x = np.random.default_rng(7).standard_normal((2, 5, 6)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    got = cm.run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_an_activation_climbs_a_transpose_and_a_reshape_with_its_scalar() -> None:
    model = tiny_model(
        [
            n("MatMul", ["q", "k"], ["s"], name="scores"),
            n("Transpose", ["s"], ["t"], perm=[0, 2, 1, 3], name="transpose"),
            n("Reshape", ["t", "shape"], ["r"], name="merge_heads"),
            n("Mul", ["r", "half"], ["m"], name="scale"),
            n("Relu", ["m"], ["y"], name="act"),
        ],
        {"q": [2, 3, 4, 5], "k": [2, 3, 5, 6]},
        {"y": [2, 4, 18]},
        {"shape": np.array([2, 4, 18]), "half": np.array(0.5)},
    )
    graph = graph_of(model)
    log = run_pass(graph, _pass())
    assert ops(graph) == ["MatMul", "Mul", "Relu", "Transpose", "Reshape"]
    assert log.fired == {names.POINTWISE_BEFORE_VIEWS: 4}
    assert_computes_as_onnxruntime(model, graph)


def test_constants_that_would_broadcast_differently_keep_the_op_after_the_view() -> None:
    model = tiny_model(
        [
            n("Transpose", ["x"], ["t"], perm=[0, 2, 1], name="transpose"),
            n("Add", ["t", "bias"], ["a"], name="bias"),  # per column of the transposed tensor
            n("Reshape", ["x", "shape"], ["r"], name="flatten"),
            n("Mul", ["r", "rows"], ["y2"], name="per_row"),  # varies along a dim the view merges
            n("Reshape", ["x", "shape"], ["r2"], name="flatten2"),
            n("Add", ["r2", "wide"], ["y3"], name="widen"),  # its rank-3 constant widens the output
        ],
        {"x": [2, 3, 4]},
        {"a": [2, 4, 3], "y2": [6, 4], "y3": [1, 6, 4]},
        {
            "bias": weights(3, seed=1),
            "shape": np.array([6, 4]),
            "rows": weights(6, 1, seed=2),
            "wide": weights(1, 1, 4, seed=3),
        },
    )
    graph = graph_of(model)
    log = run_pass(graph, _pass())
    assert ops(graph) == ["Transpose", "Add", "Reshape", "Mul", "Reshape", "Add"]
    assert log.fired == {}
    assert_computes_as_onnxruntime(model, graph)


def test_a_view_with_other_readers_or_that_is_an_output_stays_before_the_op() -> None:
    model = tiny_model(
        [
            n("Reshape", ["x", "shape"], ["r"], name="flatten"),
            n("Relu", ["r"], ["a"], name="act"),
            n("Sigmoid", ["r"], ["b"], name="gate"),
            n("Transpose", ["x"], ["t"], perm=[1, 0, 2], name="transpose"),
            n("Tanh", ["t"], ["c"], name="tanh"),
        ],
        {"x": [2, 3, 4]},
        {"a": [6, 4], "b": [6, 4], "t": [3, 2, 4], "c": [3, 2, 4]},
        {"shape": np.array([6, 4])},
    )
    graph = graph_of(model)
    log = run_pass(graph, _pass())
    assert ops(graph) == ["Reshape", "Relu", "Sigmoid", "Transpose", "Tanh"]
    assert log.fired == {}
    assert_computes_as_onnxruntime(model, graph)


def _pass():  # type: ignore[no-untyped-def]
    from opfuse.passes.rules import GraphRule

    return GraphRule(names.POINTWISE_BEFORE_VIEWS, pointwise_before_views)


def test_an_op_behind_a_library_op_stays_after_the_view() -> None:
    """Behind an AveragePool (a library op, no epilogue) the move would only part the op from
    its consumers, which the pointwise rule already reads through the view beside it."""
    model = tiny_model(
        [
            n("AveragePool", ["x"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="pool"),
            n("Reshape", ["p", "shape"], ["r"], name="flatten"),
            n("Mul", ["r", "half"], ["y"], name="scale"),
        ],
        {"x": [2, 3, 4, 4]},
        {"y": [6, 16]},
        {"shape": np.array([6, 16]), "half": np.array(0.5)},
    )
    graph = graph_of(model)
    log = run_pass(graph, _pass())
    assert ops(graph) == ["AveragePool", "Reshape", "Mul"]
    assert log.fired == {}
    assert_computes_as_onnxruntime(model, graph)


def test_an_op_that_several_pointwise_ops_read_stays_after_the_view() -> None:
    """Funnel's attention scales the query after a view, and three bias adds read the scaled
    query: after the view the four are one kernel. Moved into the GEMM's epilogue, the scale
    would leave the three adds a kernel each."""
    model = tiny_model(
        [
            n("MatMul", ["x", "w"], ["h"], name="q_proj"),
            n("Reshape", ["h", "heads"], ["q"], name="split_heads"),
            n("Mul", ["q", "scale"], ["qs"], name="scale"),
            n("Add", ["qs", "bw"], ["y1"], name="content_bias"),
            n("Add", ["qs", "br"], ["y2"], name="position_bias"),
            n("Add", ["qs", "bs"], ["y3"], name="segment_bias"),
        ],
        {"x": [2, 5, 8]},
        {"y1": [2, 5, 2, 4], "y2": [2, 5, 2, 4], "y3": [2, 5, 2, 4]},
        {
            "w": weights(8, 8),
            "heads": np.array([2, 5, 2, 4]),
            "scale": np.array(0.5),
            "bw": weights(2, 4, seed=1),
            "br": weights(2, 4, seed=2),
            "bs": weights(2, 4, seed=3),
        },
    )
    graph = graph_of(model)
    log = run_pass(graph, _pass())
    assert ops(graph) == ["MatMul", "Reshape", "Mul", "Add", "Add", "Add"]
    assert log.fired == {}
    _, plan = planned(model)
    assert ("pointwise", ["scale", "content_bias", "position_bias", "segment_bias"]) in [
        (kind, nodes) for kind, _, nodes in claimed(plan)
    ]
