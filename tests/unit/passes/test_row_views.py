"""`reshape_before_pointwise` (opfuse/passes/row_views.py): a Reshape a row op reads moves above
the pointwise ops and the product that compute its input, exactly, so they join the row kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from opfuse.frontend import rule_registry as names
from opfuse.passes.row_views import reshape_before_pointwise
from opfuse.passes.rules import GraphRule
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
PASS = GraphRule(names.RESHAPE_BEFORE_POINTWISE, reshape_before_pointwise)


def tokens_then_grid(bias: list[int] | None = None, fc2_out: int = 8) -> onnx.ModelProto:
    """Swin's MLP half as exported: the residual stream as tokens [1, 16, 8], `x + fc2(t) + b`,
    then a view as a 4x4 grid [1, 4, 4, 8] that the next LayerNorm reads (and the stream goes on
    as the grid: an output). `bias`: the bias's shape (default per channel); `fc2_out` other than
    8 reshapes the product's columns too."""
    c = fc2_out
    return tiny_model(
        [
            n("MatMul", ["t", "w"], ["p"], name="fc2"),
            n("Add", ["p", "b"], ["pb"], name="bias"),
            n("Reshape", ["x", "tokens"], ["xr"], name="as_tokens"),
            n("Add", ["xr", "pb"], ["s"], name="residual"),
            n("Reshape", ["s", "grid"], ["g"], name="as_grid"),
            n("LayerNormalization", ["g", "gamma", "beta"], ["y"], name="norm", axis=-1),
        ],
        {"x": [1, 4, 4, c], "t": [1, 16, 12]},
        {"y": [1, 4, 4, 8] if c == 8 else [1, 4, 4, c], "g": [1, 4, 4, c]},
        {
            "w": weights(12, c, seed=1),
            "b": weights(*(bias or [c]), seed=2),
            "tokens": np.array([1, 16, c]),
            "grid": np.array([1, 4, 4, c]),
            "gamma": weights(c, seed=3) + 1.0,
            "beta": weights(c, seed=4),
        },
    )


def test_the_grid_view_climbs_the_residual_the_bias_and_the_product() -> None:
    model = tokens_then_grid()
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    # Through the residual Add, the bias Add and the product: the product's A and the stream's
    # tokens get views of their own (the tokens' view is a Reshape of a Reshape).
    assert log.fired == {names.RESHAPE_BEFORE_POINTWISE: 3}
    assert sorted(ops(graph)) == sorted(["Reshape"] * 3 + ["MatMul", "Add", "Add", "LayerNormalization"])
    by_name = {nd.name: nd for nd in graph.nodes}
    assert tuple(graph.spec(by_name["fc2"].outputs[0]).shape) == (1, 4, 4, 8)
    assert tuple(graph.spec(by_name["fc2"].inputs[0]).shape) == (1, 4, 4, 12)
    assert by_name["residual"].outputs == ["g"]  # the stream, as the model's output
    assert_computes_as_onnxruntime(model, graph)


def test_the_row_kernel_takes_the_residual_the_bias_and_the_product() -> None:
    model = tokens_then_grid()
    _, plan = planned(model)
    kinds = [(kind, rule, nodes) for kind, rule, nodes in claimed(plan)]
    assert kinds == [
        ("rowwise", "row_reduction+gemm_reduction", ["fc2", "bias", "residual", "norm"]),
    ], kinds
    _, without = planned(model, disabled=(names.RESHAPE_BEFORE_POINTWISE,))
    # Without the move: the product with its bias and the residual, then the norm alone.
    assert [nodes for _, _, nodes in claimed(without)] == [["norm"], ["fc2", "bias", "residual"]]


def test_a_bias_that_broadcasts_over_tokens_stops_the_view() -> None:
    # A bias per token and channel [16, 8] has no shape on the grid's side that broadcasts alike.
    graph = graph_of(tokens_then_grid(bias=[16, 8]))
    log = run_pass(graph, PASS)
    assert log.fired == {names.RESHAPE_BEFORE_POINTWISE: 1}  # the residual Add alone
    by_name = {nd.name: nd for nd in graph.nodes}
    assert tuple(graph.spec(by_name["bias"].outputs[0]).shape) == (1, 16, 8)
    assert_computes_as_onnxruntime(tokens_then_grid(bias=[16, 8]), graph)


def test_a_view_read_by_no_row_op_stays() -> None:
    model = tiny_model(
        [
            n("Add", ["a", "b"], ["s"], name="add"),
            n("Reshape", ["s", "grid"], ["g"], name="as_grid"),
            n("Relu", ["g"], ["y"], name="act"),
        ],
        {"a": [1, 16, 8], "b": [1, 16, 8]},
        {"y": [1, 4, 4, 8]},
        {"grid": np.array([1, 4, 4, 8])},
    )
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert log.fired == {} and ops(graph) == ["Add", "Reshape", "Relu"]


def test_a_view_of_a_sum_read_twice_stays() -> None:
    # `s` is read by the view and by another op: moved, both forms would be computed.
    model = tiny_model(
        [
            n("Add", ["a", "b"], ["s"], name="add"),
            n("Reshape", ["s", "grid"], ["g"], name="as_grid"),
            n("LayerNormalization", ["g", "gamma"], ["y"], name="norm", axis=-1),
            n("Relu", ["s"], ["z"], name="act"),
        ],
        {"a": [1, 16, 8], "b": [1, 16, 8]},
        {"y": [1, 4, 4, 8], "z": [1, 16, 8]},
        {"grid": np.array([1, 4, 4, 8]), "gamma": weights(8, seed=1)},
    )
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert log.fired == {} and ops(graph) == ["Add", "Reshape", "LayerNormalization", "Relu"]


def test_a_product_whose_columns_the_view_regroups_stays() -> None:
    # The norm reads [1, 16, 4, 2] of the product's [1, 16, 8]: its rows are not the product's.
    model = tiny_model(
        [
            n("MatMul", ["t", "w"], ["p"], name="fc"),
            n("Reshape", ["p", "heads"], ["h"], name="heads"),
            n("LayerNormalization", ["h", "gamma"], ["y"], name="norm", axis=-1),
        ],
        {"t": [1, 16, 12]},
        {"y": [1, 16, 4, 2]},
        {"w": weights(12, 8, seed=1), "heads": np.array([1, 16, 4, 2]), "gamma": weights(2, seed=2)},
    )
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert log.fired == {} and ops(graph) == ["MatMul", "Reshape", "LayerNormalization"]


def test_a_product_and_its_bias_stay_together_where_the_row_op_pools_other_axes() -> None:
    """Hiera's stage projection: `proj(x) + b`, viewed as [1, 4, 16, 8] and max-pooled over the
    4 mask units, while the attention's QKV reads x too. The row op does not reduce over the
    product's columns (no GEMM on its tiles), so the view stays after the bias: the product keeps
    its bias in its epilogue and its input shared with the QKV product (merge_projections)."""
    model = tiny_model(
        [
            n("MatMul", ["x", "w"], ["p"], name="proj"),
            n("Add", ["p", "b"], ["pb"], name="bias"),
            n("Reshape", ["pb", "units"], ["u"], name="units"),
            n("ReduceMax", ["u", "axes"], ["y"], name="pool", keepdims=0),
            n("MatMul", ["x", "w2"], ["q"], name="qkv"),
        ],
        {"x": [1, 64, 12]},
        {"y": [1, 16, 8], "q": [1, 64, 24]},
        {
            "w": weights(12, 8, seed=1),
            "b": weights(8, seed=2),
            "units": np.array([1, 4, 16, 8]),
            "axes": np.array([1]),
            "w2": weights(12, 24, seed=3),
        },
    )
    graph = graph_of(model)
    log = run_pass(graph, PASS)
    assert log.fired == {} and ops(graph) == ["MatMul", "Add", "Reshape", "ReduceMax", "MatMul"]


class TokensAndGrid(nn.Module):
    """A Swin block's MLP half: the norm and MLP on tokens, the next norm on the grid."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.norm, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, w, c = x.shape
        t = x.reshape(b, h * w, c)
        t = t + self.fc2(nn.functional.gelu(self.fc1(self.norm(t))))
        g = t.reshape(b, h, w, c)
        return self.norm2(g), g


@pytest.mark.parametrize("dynamo", [True, False])
def test_swin_s_mlp_half_runs_in_three_kernels(dynamo: bool, tmp_path: Path) -> None:
    """As both exporters write it, every output element as onnxruntime computes it: the norm, the
    first GEMM with its activation, then one row kernel for the second GEMM, its bias, the residual
    and the next norm (four kernels without the move: the next norm ran alone)."""
    from tests.unit.test_default_export import check, export

    torch.manual_seed(0)
    x = torch.randn(2, 4, 4, 16)
    model = export(TokensAndGrid(), (x,), tmp_path / "m.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path)
    assert names.RESHAPE_BEFORE_POINTWISE in cm.report["fusion"]["passes"]["fired"]
    assert cm.plan.launches == 3
    off = check(model, (x,), tmp_path, fusion_disable=[names.RESHAPE_BEFORE_POINTWISE])
    assert off.plan.launches == 4
