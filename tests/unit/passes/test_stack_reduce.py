"""`reduce_stack` (opfuse/passes/stack_reduce.py): a reduction over the axis a stack adds becomes
the elementwise sum (mean, maximum, minimum) of the stacked tensors, weighted or not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from opfuse.frontend import rule_registry as names
from opfuse.passes.stack_reduce import reduce_stack
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def stack_reduce(
    reduce: str = "ReduceSum",
    parts: int = 2,
    keepdims: int = 0,
    weight: list[int] | None = None,
    const: bool = False,
) -> onnx.ModelProto:
    """reduce(stack([a, b, ..]) [* w], axis 1): the stacked tensors [2, 3, 4, 5] each."""
    names_ = [f"x{i}" for i in range(parts)]
    nodes = [n("Unsqueeze", [x, "one"], [f"u{i}"], name=f"unsqueeze{i}") for i, x in enumerate(names_)]
    nodes.append(n("Concat", [f"u{i}" for i in range(parts)], ["stack"], name="stack", axis=1))
    inputs = {x: [2, 3, 4, 5] for x in names_}
    inits: dict[str, np.ndarray] = {"one": np.array([1]), "axes": np.array([1])}
    src = "stack"
    if weight is not None:
        if const:
            inits["w"] = weights(*weight, seed=7) + 1.0
        else:
            inputs["w"] = weight
        nodes.append(n("Mul", ["stack", "w"], ["ws"], name="weigh"))
        src = "ws"
    nodes.append(n(reduce, [src, "axes"], ["y"], name="reduce", keepdims=keepdims))
    out = [2, 1, 3, 4, 5] if keepdims else [2, 3, 4, 5]
    return tiny_model(nodes, inputs, {"y": out}, inits)


@pytest.mark.parametrize("reduce", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_reduction_over_the_stacked_axis_is_the_elementwise_one(reduce: str, keepdims: int) -> None:
    model = stack_reduce(reduce, parts=3, keepdims=keepdims)
    graph = graph_of(model)
    log = run_pass(graph, reduce_stack)
    assert log.fired == {names.REDUCE_STACK: 1}
    combine = {"ReduceSum": "Add", "ReduceMean": "Add", "ReduceMax": "Max", "ReduceMin": "Min"}[reduce]
    assert "Concat" not in ops(graph) and reduce not in ops(graph)
    assert ops(graph).count(combine) == 2
    assert_computes_as_onnxruntime(model, graph)


@pytest.mark.parametrize(
    "weight, const",
    [
        ([2, 2, 3, 1, 1], False),  # SKNet's softmax over the branches, per channel
        ([1, 2, 1, 1, 5], True),  # a constant per branch and column
        ([3, 4, 5], False),  # one weight for every branch (no stacked axis)
        ([2, 1, 3, 1, 1], True),  # size 1 along the stacked axis
    ],
)
@pytest.mark.parametrize("reduce", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_weighted_stack_sums_each_part_times_its_weight(
    weight: list[int], const: bool, reduce: str, keepdims: int
) -> None:
    model = stack_reduce(reduce, keepdims=keepdims, weight=weight, const=const)
    graph = graph_of(model)
    log = run_pass(graph, reduce_stack)
    assert log.fired == {names.REDUCE_STACK: 1}
    assert "Concat" not in ops(graph) and reduce not in ops(graph)
    assert_computes_as_onnxruntime(model, graph)


def test_a_reduction_over_another_axis_stays() -> None:
    model = stack_reduce()
    model.graph.initializer[1].CopyFrom(onnx.numpy_helper.from_array(np.array([2], dtype=np.int64), "axes"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2, 4, 5]))
    graph = graph_of(model)
    log = run_pass(graph, reduce_stack)
    assert log.fired == {}
    assert [x.reason for x in log.not_fired] == ["the reduction is not over the stacked axis alone"]


def test_a_concat_of_thicker_tensors_is_no_stack() -> None:
    model = tiny_model(
        [
            n("Concat", ["a", "b"], ["c"], name="cat", axis=1),
            n("ReduceSum", ["c", "axes"], ["y"], name="reduce", keepdims=0),
        ],
        {"a": [2, 2, 4], "b": [2, 1, 4]},
        {"y": [2, 4]},
        {"axes": np.array([1])},
    )
    graph = graph_of(model)
    log = run_pass(graph, reduce_stack)
    assert log.fired == {} and ops(graph) == ["Concat", "ReduceSum"]
    assert [x.reason for x in log.not_fired] == [
        "not a stack: an input has more than one element along the axis"
    ]


class SelectiveKernel(nn.Module):
    """SKNet's attention over two branches: their sum pooled, a bottleneck, a softmax across the
    branches per channel, then the branches summed with those weights."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.b0 = nn.Conv2d(c, c, 3, padding=1)
        self.b1 = nn.Conv2d(c, c, 3, padding=2, dilation=2)
        self.reduce, self.select = nn.Conv2d(c, 4, 1), nn.Conv2d(4, 2 * c, 1)
        self.out = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c = x.shape[:2]
        paths = torch.stack([torch.relu(self.b0(x)), torch.relu(self.b1(x))], dim=1)
        s = paths.sum(1).mean((2, 3), keepdim=True)
        attn = self.select(torch.relu(self.reduce(s))).view(b, 2, c, 1, 1).softmax(dim=1)
        return self.out((paths * attn).sum(1))


@pytest.mark.parametrize("dynamo", [True, False])
def test_a_selective_kernel_block_runs_without_its_stack(dynamo: bool, tmp_path: Path) -> None:
    """As both exporters write it, every output element as onnxruntime computes it: no Concat of
    the branches and no reduction over them in the plan, fewer launches than without the pass."""
    from tests.unit.test_default_export import check, export

    torch.manual_seed(0)
    x = torch.randn(2, 8, 6, 6)
    model = export(SelectiveKernel(), (x,), tmp_path / "m.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path)
    assert cm.report["fusion"]["passes"]["fired"].get(names.REDUCE_STACK) == 2
    assert not any(s.op_type == "Concat" for s in cm.plan.steps)
    off = check(model, (x,), tmp_path, fusion_disable=[names.REDUCE_STACK])
    assert cm.plan.launches < off.plan.launches
