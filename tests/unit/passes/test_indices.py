"""`check_constant_indices` (opfuse/passes/indices.py): it rewrites nothing; a constant index out
of range is refused with the node named, an index in range (negative included) passes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from opfuse.errors import ModelError
from opfuse.passes.indices import check_constant_indices
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, tiny_model

n = helper.make_node


def gather(indices: np.ndarray) -> onnx.ModelProto:
    return tiny_model(
        [n("Gather", ["x", "i"], ["y"], name="pick", axis=1)], {"x": [2, 4]}, {"y": [2, 2]}, {"i": indices}
    )


def test_indices_in_range_pass_unchanged() -> None:
    model = gather(np.array([-1, 2]))
    graph = graph_of(model)
    check_constant_indices(graph)
    assert ops(graph) == ["Gather"]
    assert_computes_as_onnxruntime(model, graph)


def test_an_index_out_of_range_is_refused_naming_the_node() -> None:
    model = gather(np.array([-1, 2]))
    model.graph.initializer[0].CopyFrom(helper.make_tensor("i", 7, [2], [1, 4]))  # 4 on an axis of 4
    graph = graph_of(model)
    with pytest.raises(
        ModelError, match=r"node 'pick' \(Gather\): its constant index 4 is out of range for axis 1"
    ):
        check_constant_indices(graph)
