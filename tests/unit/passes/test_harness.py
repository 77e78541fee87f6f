"""The check every test here relies on: `assert_computes_as_onnxruntime` (tests/builders.py) fails
on a graph that computes something else, and passes on the graph as loaded."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from tests.builders import assert_computes_as_onnxruntime, graph_of, tiny_model, weights


def linear() -> onnx.ModelProto:
    return tiny_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])],
        {"x": [3, 4]},
        {"z": [3, 5]},
        {"w": weights(4, 5), "b": weights(5, seed=1)},
    )


def test_the_graph_as_loaded_computes_what_onnxruntime_does() -> None:
    model = linear()
    assert_computes_as_onnxruntime(model, graph_of(model))


def test_one_weight_off_by_a_little_fails_the_check() -> None:
    model = linear()
    graph = graph_of(model)
    graph.constants["w"] = graph.constants["w"].copy()
    graph.constants["w"][1, 2] += 1e-2
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_computes_as_onnxruntime(model, graph)
