"""`sum_sibling_gemms` (opfuse/passes/sum_gemms.py): two products of one input added together
become one product by the summed weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from opfuse.frontend import rule_registry as names
from opfuse.passes.sum_gemms import sum_sibling_gemms
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node


def two_heads(
    op: str = "Gemm", read_twice: bool = False, trans_b: tuple[int, int] = (1, 1)
) -> onnx.ModelProto:
    """(x @ W1ᵀ + b1 + x @ W2ᵀ + b2) / 2, a distilled classifier's averaged heads (Gemm with
    alpha and beta on the second head); `op` MatMul: the products without biases.
    `read_twice`: the first head's logits are an output too."""
    inits: dict[str, np.ndarray] = {"two": np.array(2.0, dtype=np.float32)}
    if op == "Gemm":
        w = [weights(10, 16, seed=1), weights(10, 16, seed=2)]
        inits.update(w1=w[0] if trans_b[0] else np.ascontiguousarray(w[0].T), b1=weights(10, seed=3))
        inits.update(w2=w[1] if trans_b[1] else np.ascontiguousarray(w[1].T), b2=weights(10, seed=4))
        nodes = [
            n("Gemm", ["x", "w1", "b1"], ["h1"], name="head", transB=trans_b[0]),
            n("Gemm", ["x", "w2", "b2"], ["h2"], name="head_dist", transB=trans_b[1], alpha=0.5, beta=2.0),
        ]
    else:
        inits.update(w1=weights(16, 10, seed=1), w2=weights(16, 10, seed=2))
        nodes = [
            n("MatMul", ["x", "w1"], ["h1"], name="head"),
            n("MatMul", ["x", "w2"], ["h2"], name="head_dist"),
        ]
    nodes += [n("Add", ["h1", "h2"], ["s"], name="add"), n("Div", ["s", "two"], ["y"], name="half")]
    outputs = {"y": [3, 10], **({"h1": [3, 10]} if read_twice else {})}
    return tiny_model(nodes, {"x": [3, 16]}, outputs, inits)


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_two_heads_added_are_one_product(op: str) -> None:
    model = two_heads(op)
    graph = graph_of(model)
    log = run_pass(graph, sum_sibling_gemms)
    assert ops(graph) == [op, "Div"] and log.fired == {names.SUM_SIBLING_GEMMS: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_a_product_read_elsewhere_too_stays() -> None:
    graph = graph_of(two_heads(read_twice=True))
    log = run_pass(graph, sum_sibling_gemms)
    assert ops(graph) == ["Gemm", "Gemm", "Add", "Div"] and log.fired == {}


def test_weights_laid_out_differently_are_refused() -> None:
    graph = graph_of(two_heads(trans_b=(1, 0)))
    log = run_pass(graph, sum_sibling_gemms)
    assert ops(graph) == ["Gemm", "Gemm", "Add", "Div"]
    assert [x.reason for x in log.not_fired] == ["the weights differ in shape or type ([10, 16], [16, 10])"]


class DistilledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.head, self.head_dist = nn.Linear(16, 10), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.body(x))
        return (self.head(f) + self.head_dist(f)) / 2


@pytest.mark.parametrize("dynamo", [True, False])
def test_a_distilled_classifier_runs_one_head_kernel(dynamo: bool, tmp_path: Path) -> None:
    """As both exporters write it: the heads are one GEMM with the halving in its epilogue,
    every output element as onnxruntime computes it."""
    from tests.unit.test_default_export import check, export

    torch.manual_seed(0)
    x = torch.randn(4, 12)
    model = export(DistilledHead(), (x,), tmp_path / "m.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path)
    assert names.SUM_SIBLING_GEMMS in cm.report["fusion"]["passes"]["fired"], cm.report["fusion"]["passes"]
    assert cm.plan.launches == 2  # the body's GEMM and ReLU, then the heads' GEMM and halving
