"""`fold_batchnorm` and `batchnorm_to_affine` (opfuse/passes/batchnorm.py) on tiny graphs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.batchnorm import batchnorm_to_affine, fold_batchnorm
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def conv_bn(extra_use: bool = False) -> onnx.ModelProto:
    nodes = [
        n("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        n("BatchNormalization", ["c", "s", "t", "m", "v"], ["y"], name="bn", epsilon=1e-5),
    ]
    outputs = {"y": [1, 4, 5, 5]}
    if extra_use:
        nodes.append(n("Relu", ["c"], ["z"], name="relu"))
        outputs["z"] = [1, 4, 5, 5]
    return tiny_model(
        nodes,
        {"x": [1, 3, 5, 5]},
        outputs,
        {
            "w": weights(4, 3, 3, 3),
            "b": weights(4, seed=1),
            "s": 1.0 + weights(4, seed=2),
            "t": weights(4, seed=3),
            "m": weights(4, seed=4),
            "v": 0.5 + np.abs(weights(4, seed=5)),
        },
    )


def test_a_batchnorm_after_a_conv_folds_into_its_weights() -> None:
    model = conv_bn()
    graph = graph_of(model)
    log = run_pass(graph, fold_batchnorm)
    assert ops(graph) == ["Conv"]
    assert graph.nodes[0].name == "conv+bn" and log.fired == {names.FOLD_BATCHNORM: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_a_conv_output_read_elsewhere_is_not_folded() -> None:
    graph = graph_of(conv_bn(extra_use=True))
    log = run_pass(graph, fold_batchnorm)
    assert ops(graph) == ["Conv", "BatchNormalization", "Relu"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["conv", "bn"], "the Conv output is also used elsewhere, so it must stay un-normalized")
    ]


def test_a_lone_batchnorm_becomes_a_mul_and_an_add() -> None:
    model = conv_bn(extra_use=True)
    graph = graph_of(model)
    log = run_pass(graph, batchnorm_to_affine)
    assert ops(graph) == ["Conv", "Mul", "Add", "Relu"]
    assert log.fired == {names.BATCHNORM_TO_AFFINE: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_a_batchnorm_with_a_computed_scale_stays() -> None:
    model = tiny_model(
        [
            n("Exp", ["s0"], ["s"], name="exp"),
            n("BatchNormalization", ["x", "s", "t", "m", "v"], ["y"], name="bn"),
        ],
        {"x": [2, 3, 4], "s0": [3]},
        {"y": [2, 3, 4]},
        {"t": weights(3), "m": weights(3, seed=1), "v": 0.5 + np.abs(weights(3, seed=2))},
    )
    graph = graph_of(model)
    log = run_pass(graph, batchnorm_to_affine)
    assert ops(graph) == ["Exp", "BatchNormalization"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["bn"], "scale, bias, mean or variance is not a constant")
    ]
