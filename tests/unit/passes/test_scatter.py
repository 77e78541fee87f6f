"""scatternd_as_where (opfuse/passes/scatter.py): ScatterND by constant index tuples is a Where
between the data and a Gather of the updates; every output element against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import opfuse
from opfuse.frontend import rule_registry as names
from opfuse.passes.scatter import scatternd_as_where
from tests.builders import TEST_DEVICE, assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model
from tests.unit.test_fusion import ort_run

n = helper.make_node


def slice_assignment() -> np.ndarray:
    """The tuples of `d[:, 1:3, 2:] = u` for d of shape [2, 4, 5]: u is [2, 2, 3]."""
    a, b, c = np.meshgrid(np.arange(2), np.arange(1, 3), np.arange(2, 5), indexing="ij")
    return np.stack([a, b, c], axis=-1)


def scatter(indices: np.ndarray, updates: list[int], **attrs: str) -> onnx.ModelProto:
    """y = ScatterND(Sigmoid(x), indices, Relu(u)) + 1: computed data and updates."""
    return tiny_model(
        [
            n("Sigmoid", ["x"], ["d"]),
            n("Relu", ["u"], ["r"]),
            n("ScatterND", ["d", "i", "r"], ["s"], name="assign", **attrs),
            n("Add", ["s", "one"], ["y"]),
        ],
        {"x": [2, 4, 5], "u": updates},
        {"y": [2, 4, 5]},
        {"i": indices, "one": np.array(1.0, dtype=np.float32)},
    )


@pytest.mark.parametrize(
    ("indices", "updates", "kinds"),
    [
        (slice_assignment(), [2, 2, 3], ["Reshape", "Gather", "Where"]),  # scalars, a box
        (np.array([[1, 3], [0, 0], [1, -4]]), [3, 5], ["Gather", "Where"]),  # rows, one negative
        (np.array([[[1], [0]]]), [1, 2, 4, 5], ["Reshape", "Gather"]),  # every element: no Where
    ],
)
def test_a_scatter_by_constant_tuples_is_a_where_of_a_gather(
    indices: np.ndarray, updates: list[int], kinds: list[str]
) -> None:
    model = scatter(indices, updates)
    graph = graph_of(model)
    log = run_pass(graph, scatternd_as_where)
    assert log.fired == {names.SCATTERND_AS_WHERE: 1}
    assert ops(graph) == ["Sigmoid", "Relu", *kinds, "Add"]
    assert_computes_as_onnxruntime(model, graph)


@pytest.mark.parametrize(
    ("indices", "attrs", "why"),
    [
        (
            np.array([[1, 3], [0, 0], [1, 3]]),
            {},
            "two updates write one element (the order of the writes decides it)",
        ),
        (
            np.array([[1, 3], [0, 0], [1, 2]]),
            {"reduction": "add"},
            "reduction 'add' combines the updates with the data",
        ),
    ],
)
def test_a_scatter_whose_writes_combine_stays(indices: np.ndarray, attrs: dict[str, str], why: str) -> None:
    graph = graph_of(scatter(indices, [3, 5], **attrs))
    log = run_pass(graph, scatternd_as_where)
    assert "ScatterND" in ops(graph)
    assert [(r.nodes, r.reason) for r in log.not_fired] == [(["assign"], why)]


def banded_scores() -> onnx.ModelProto:
    """Longformer's band of scores: zeros, then three slice assignments of computed chunks (the
    second into the first's result), then a scale."""
    first = slice_assignment()  # s[:, 1:3, 2:] = Relu(a)
    second = np.stack(np.meshgrid(np.arange(2), np.arange(0, 1), np.arange(0, 5), indexing="ij"), -1)
    return tiny_model(
        [
            n("Relu", ["a"], ["ra"]),
            n("ScatterND", ["zeros", "i1", "ra"], ["s1"]),
            n("Tanh", ["b"], ["tb"]),
            n("ScatterND", ["s1", "i2", "tb"], ["s2"]),  # s[:, 0:1, :] = Tanh(b)
            n("Mul", ["s2", "y"], ["out"]),
        ],
        {"a": [2, 2, 3], "b": [2, 1, 5], "y": [2, 4, 5]},
        {"out": [2, 4, 5]},
        {"zeros": np.full((2, 4, 5), -0.5, dtype=np.float32), "i1": first, "i2": second},
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_slice_assignments_run_as_one_kernel(precision: str) -> None:
    model = banded_scores()
    shapes = {"a": [2, 2, 3], "b": [2, 1, 5], "y": [2, 4, 5]}
    cm = opfuse.compile(model, shapes, precision=precision, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    launched = [s.op_type or s.kind for s in cm.plan.steps if s.launches]
    # The Wheres, the gathers of the updates and the Mul: one kernel (the updates' Relu and Tanh
    # are written first: a gathered value is loaded from memory).
    assert launched == ["Relu", "Tanh", "kernel"], launched
    assert [g["rule"] for g in cm.report["fusion"]["groups"]] == ["pointwise+pad_gather"]
    rng = np.random.default_rng(7)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    (ref,) = ort_run(model, feeds)
    tol = 1e-5 if precision == "fp32" else 1e-2
    np.testing.assert_allclose(cm.run(feeds)["out"], ref, rtol=tol, atol=tol)
