"""`group_norm` (opfuse/passes/group_norm.py) on a tiny graph: nn.GroupNorm as PyTorch exports it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.group_norm import group_norm
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def written_out(inorm_scale: np.ndarray) -> onnx.ModelProto:
    return tiny_model(
        [
            n("Reshape", ["x", "grouped"], ["g"], name="split"),
            n("InstanceNormalization", ["g", "one", "zero"], ["i"], name="inorm", epsilon=1e-5),
            n("Reshape", ["i", "back"], ["r"], name="merge"),
            n("Mul", ["r", "gamma"], ["s"], name="scale"),
            n("Add", ["s", "beta"], ["y"], name="shift"),
        ],
        {"x": [2, 6, 3, 3]},
        {"y": [2, 6, 3, 3]},
        {
            "grouped": np.array([2, 3, -1]),
            "one": inorm_scale,
            "zero": np.zeros(3, np.float32),  # InstanceNormalization's bias as the exporter writes it
            "back": np.array([2, 6, 3, 3]),
            "gamma": 1.0 + weights(6, 1, 1),
            "beta": weights(6, 1, 1, seed=1),
        },
    )


def test_the_written_out_group_norm_is_one_node() -> None:
    model = written_out(np.ones(3, np.float32))
    graph = graph_of(model)
    log = run_pass(graph, group_norm)
    assert ops(graph) == ["GroupNormalization"] and log.fired == {names.GROUP_NORM: 1}
    assert graph.nodes[0].attrs["num_groups"] == 3
    assert_computes_as_onnxruntime(model, graph)


def test_an_instance_norm_with_its_own_scale_is_left_written_out() -> None:
    graph = graph_of(written_out(1.0 + weights(3, seed=2)))
    log = run_pass(graph, group_norm)
    assert ops(graph) == ["Reshape", "InstanceNormalization", "Reshape", "Mul", "Add"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["split", "inorm", "merge", "scale", "shift"], "the InstanceNormalization has its own scale or bias")
    ]


def test_a_norm_without_bias_keeps_the_residual_add_after_it() -> None:
    """A GroupNorm without bias (timm's GroupNorm1NoBias) is followed by the block's residual Add,
    which is no affine: the norm is one node and the Add stays, reading it."""
    model = tiny_model(
        [
            n("Reshape", ["x", "grouped"], ["g"], name="split"),
            n("InstanceNormalization", ["g", "one", "zero"], ["i"], name="inorm", epsilon=1e-5),
            n("Reshape", ["i", "back"], ["r"], name="merge"),
            n("Mul", ["r", "gamma"], ["s"], name="scale"),
            n("Add", ["s", "x"], ["y"], name="residual"),
        ],
        {"x": [2, 6, 3, 3]},
        {"y": [2, 6, 3, 3]},
        {
            "grouped": np.array([2, 1, -1]),
            "one": np.ones(1, np.float32),
            "zero": np.zeros(1, np.float32),
            "back": np.array([2, 6, 3, 3]),
            "gamma": 1.0 + weights(6, 1, 1),
        },
    )
    graph = graph_of(model)
    log = run_pass(graph, group_norm)
    assert ops(graph) == ["GroupNormalization", "Add"] and log.fired == {names.GROUP_NORM: 1}
    assert graph.nodes[1].inputs[0] == graph.nodes[0].outputs[0]
    assert_computes_as_onnxruntime(model, graph)
