"""`merge_reductions` (opfuse/passes/merge_reductions.py): a reduction of a reduction of the same
kind is one reduction over both sets of axes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from opfuse.frontend import rule_registry as names
from opfuse.passes.merge_reductions import merge_reductions
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model

n = helper.make_node


def twice(
    reduce: str = "ReduceMean",
    keepdims: int = 1,
    second: str = "",
    also_out: bool = False,
    drop: bool = False,
) -> onnx.ModelProto:
    """reduce(reduce(x, axis 2, keepdims), axis 3) of x [2, 3, 4, 5]; `second` another kind for
    the outer one; `also_out`: the first's output a model output too; `drop`: the outer one drops
    its axis (keepdims 0)."""
    inits = {"a2": np.array([2]), "a3": np.array([3 if keepdims else 2])}
    nodes = [
        n(reduce, ["x", "a2"], ["h"], name="first", keepdims=keepdims),
        n(second or reduce, ["h", "a3"], ["y"], name="second", keepdims=0 if drop else 1),
    ]
    h = [2, 3, 1, 5] if keepdims else [2, 3, 5]
    y = [2, 3, 1, 1] if keepdims else [2, 3, 1]
    outs = {"y": y[:-1] if drop else y}
    if also_out:
        outs["h"] = h
    return tiny_model(nodes, {"x": [2, 3, 4, 5]}, outs, inits)


@pytest.mark.parametrize("reduce", ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"])
def test_two_reductions_of_one_kind_are_one_over_both_axes(reduce: str) -> None:
    model = twice(reduce)
    graph = graph_of(model)
    log = run_pass(graph, merge_reductions)
    assert log.fired == {names.MERGE_REDUCTIONS: 1}
    assert ops(graph) == [reduce]
    (node,) = graph.nodes
    assert graph.constants[node.inputs[1]].tolist() == [2, 3] and node.inputs[0] == "x"
    assert_computes_as_onnxruntime(model, graph)


def test_an_outer_reduction_that_drops_its_axis_keeps_the_inners_as_the_model_does() -> None:
    """x.mean(2, keepdim=True).mean(3): [2, 3, 1], the first's axis kept, the second's gone."""
    model = twice(drop=True)
    graph = graph_of(model)
    assert run_pass(graph, merge_reductions).fired == {names.MERGE_REDUCTIONS: 1}
    assert ops(graph) == ["ReduceMean", "Reshape"]
    assert tuple(graph.spec("y").shape) == (2, 3, 1)
    assert_computes_as_onnxruntime(model, graph)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (twice(keepdims=0), "the first reduction drops its axes"),
        (twice(also_out=True), "the first reduction's output is a model output"),
    ],
)
def test_what_cannot_merge_stays_and_says_why(model: onnx.ModelProto, why: str) -> None:
    graph = graph_of(model)
    log = run_pass(graph, merge_reductions)
    assert not log.fired and ops(graph) == ["ReduceMean", "ReduceMean"]
    (refusal,) = [x for x in log.not_fired if x.rule == names.MERGE_REDUCTIONS]
    assert why in refusal.reason and refusal.nodes == ["second"]
    assert_computes_as_onnxruntime(model, graph)


def test_a_mean_of_a_max_is_left_alone() -> None:
    graph = graph_of(twice("ReduceMax", second="ReduceMean"))
    assert not run_pass(graph, merge_reductions).fired and ops(graph) == ["ReduceMax", "ReduceMean"]


class GlobalContext(nn.Module):
    """FocalNet's global context: the mean over H, then over W, then GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x.mean(2, keepdim=True).mean(3, keepdim=True)) * x


@pytest.mark.parametrize("dynamo", [True, False])
def test_the_default_export_of_focalnets_context_is_one_mean(dynamo: bool, tmp_path: Path) -> None:
    x = torch.randn(2, 8, 6, 7)
    path = tmp_path / "m.onnx"
    torch.onnx.export(GlobalContext().eval(), (x,), str(path), dynamo=dynamo)
    model = onnx.load(str(path))
    graph = graph_of(model)
    assert run_pass(graph, merge_reductions).fired == {names.MERGE_REDUCTIONS: 1}
    assert ops(graph).count("ReduceMean") == 1
    assert_computes_as_onnxruntime(model, graph)
