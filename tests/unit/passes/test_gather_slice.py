"""`gather_to_slice` (opfuse/passes/gather_slice.py) on a tiny graph: q, k, v picked out of a packed
projection."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.gather_slice import gather_to_slice, gathernd_as_gather
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model

n = helper.make_node


def gather(indices: np.ndarray, out: list[int]) -> onnx.ModelProto:
    return tiny_model(
        [n("Gather", ["x", "i"], ["y"], name="pick", axis=1)], {"x": [2, 4, 3]}, {"y": out}, {"i": indices}
    )


def test_a_scalar_index_is_a_slice_then_a_reshape() -> None:
    model = gather(np.array(2), [2, 3])
    graph = graph_of(model)
    log = run_pass(graph, gather_to_slice)
    assert ops(graph) == ["Slice", "Reshape"] and log.fired == {names.GATHER_TO_SLICE: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_consecutive_indices_are_one_slice() -> None:
    model = gather(np.array([1, 2, 3]), [2, 3, 3])
    graph = graph_of(model)
    run_pass(graph, gather_to_slice)
    assert ops(graph) == ["Slice"]
    assert_computes_as_onnxruntime(model, graph)


def test_indices_out_of_order_stay_a_gather() -> None:
    graph = graph_of(gather(np.array([2, 0]), [2, 2, 3]))
    log = run_pass(graph, gather_to_slice)
    assert ops(graph) == ["Gather"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [(["pick"], "the indices are not consecutive")]


def gather_nd(indices: np.ndarray, out: list[int]) -> onnx.ModelProto:
    return tiny_model(
        [n("GatherND", ["x", "i"], ["y"], name="pick")], {"x": [3, 4, 5, 2]}, {"y": out}, {"i": indices}
    )


@pytest.mark.parametrize(
    ("indices", "out", "kinds"),
    [
        (np.array([[-2]]), [1, 4, 5, 2], ["Slice"]),  # Falcon's fused QKV: the key heads, x[-2]
        (np.array([[1, 2]]), [1, 5, 2], ["Reshape", "Slice"]),  # one tuple of two coordinates
        # consecutive along the second axis
        (np.array([[[0, 1], [0, 2], [0, 3]]]), [1, 3, 5, 2], ["Reshape", "Slice", "Reshape"]),
        (np.array([2, -1]), [5, 2], ["Reshape", "Slice", "Reshape"]),  # one tuple, no leading dims
    ],
)
def test_gather_nd_of_consecutive_tuples_is_a_gather_then_a_slice(
    indices: np.ndarray, out: list[int], kinds: list[str]
) -> None:
    """GatherND becomes a Gather of the tuples' axes flattened, which consecutive tuples make a
    Slice: views only."""
    model = gather_nd(indices, out)
    graph = graph_of(model)
    log = run_pass(graph, gathernd_as_gather)
    assert log.fired == {names.GATHERND_AS_GATHER: 1} and "GatherND" not in ops(graph)
    assert_computes_as_onnxruntime(model, graph)
    log = run_pass(graph, gather_to_slice)
    assert ops(graph) == kinds and log.fired == {names.GATHER_TO_SLICE: 1}
    assert_computes_as_onnxruntime(model, graph)


@pytest.mark.parametrize(
    ("indices", "out"),
    [
        (np.array([[0, 1], [1, 2], [2, 0]]), [3, 5, 2]),  # tuples in no order
        (np.array([[[0], [2]], [[1], [1]]]), [2, 2, 4, 5, 2]),  # one coordinate, repeated
        (np.array([[[2, 3, 4], [0, 0, 1]]]), [1, 2, 2]),  # three coordinates
    ],
)
def test_any_gather_nd_by_constant_tuples_is_a_gather_of_the_flattened_axes(
    indices: np.ndarray, out: list[int]
) -> None:
    model = gather_nd(indices, out)
    graph = graph_of(model)
    run_pass(graph, gathernd_as_gather)
    assert ops(graph) == (["Gather"] if indices.shape[-1] == 1 else ["Reshape", "Gather"])
    assert_computes_as_onnxruntime(model, graph)


def test_a_gather_nd_with_batch_dims_stays() -> None:
    model = tiny_model(
        [n("GatherND", ["x", "i"], ["y"], name="pick", batch_dims=1)],
        {"x": [3, 4, 5, 2]},
        {"y": [3, 2, 2]},
        {"i": np.array([[[0, 1], [1, 2]]] * 3)},
    )
    graph = graph_of(model)
    log = run_pass(graph, gathernd_as_gather)
    assert ops(graph) == ["GatherND"] and log.not_fired[0].reason == "batch_dims is not 0"


def unfold(indices: np.ndarray, x: list[int], out: list[int], axis: int) -> onnx.ModelProto:
    return tiny_model(
        [n("Gather", ["x", "i"], ["y"], name="unfold", axis=axis)], {"x": x}, {"y": out}, {"i": indices}
    )


@pytest.mark.parametrize(
    ("indices", "x", "out", "axis", "kinds"),
    [
        # 2x2 patches of 8 rows (MobileViT V2's unfold): [patch row][patch]
        (np.array([[0, 2, 4, 6], [1, 3, 5, 7]]), [2, 3, 8, 5], [2, 3, 2, 4, 5], 2, ["Reshape", "Transpose"]),
        # the same grid transposed: consecutive (one Slice, then the indices' shape)
        (np.array([[0, 1], [2, 3], [4, 5], [6, 7]]), [2, 3, 8, 5], [2, 3, 4, 2, 5], 2, ["Slice", "Reshape"]),
        # every other column, from the second: a strided Slice
        (np.array([1, 3, 5]), [2, 6, 3], [2, 3, 3], 1, ["Slice"]),
        # two windows of four from the second position, read across
        (np.array([[1, 5], [2, 6], [3, 7], [4, 8]]), [1, 9], [1, 4, 2], 1, ["Slice", "Reshape", "Transpose"]),
        # more than MAX_INDICES consecutive indices
        (np.arange(3, 103), [2, 110], [2, 100], 1, ["Slice"]),
    ],
)
def test_indices_of_a_nested_even_grid_are_views(
    indices: np.ndarray, x: list[int], out: list[int], axis: int, kinds: list[str]
) -> None:
    model = unfold(indices, x, out, axis)
    graph = graph_of(model)
    log = run_pass(graph, gather_to_slice)
    assert ops(graph) == kinds and log.fired == {names.GATHER_TO_SLICE: 1}
    assert_computes_as_onnxruntime(model, graph)


@pytest.mark.parametrize(
    ("indices", "why"),
    [
        (np.array([[0, 1], [1, 2]]), "the steps of the indices' dims do not nest"),  # overlapping windows
        (np.array([[0, 1], [4, 5]]), "the steps of the indices' dims do not nest"),  # gaps between rows
        (np.array([[0, 2], [1, 4]]), "the indices are not an even step along each of their dims"),
        (np.array([[3, 2], [1, 0]]), "the indices do not increase along each of their dims"),
    ],
)
def test_other_grids_stay_a_gather(indices: np.ndarray, why: str) -> None:
    graph = graph_of(unfold(indices, [2, 8], [2, 2, 2], 1))
    log = run_pass(graph, gather_to_slice)
    assert ops(graph) == ["Gather"]
    assert [r.reason[: len(why)] for r in log.not_fired] == [why]
