"""`local_response_norm` (opfuse/passes/local_response_norm.py) on a tiny graph: nn.LocalResponseNorm
as the TorchScript exporter writes it (square, lift, Pad, AveragePool, back, Mul, Add, Pow, Div)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.local_response_norm import local_response_norm
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model

n = helper.make_node


def written_out(size: int) -> onnx.ModelProto:
    before, after = size // 2, (size - 1) // 2  # torch's padding of the channel window
    return tiny_model(
        [
            n("Mul", ["x", "x"], ["sq"], name="square"),
            n("Unsqueeze", ["sq", "ax"], ["lift"], name="lift"),
            n("Pad", ["lift", "pads"], ["padded"], name="pad"),
            n("AveragePool", ["padded"], ["pool"], name="pool", kernel_shape=[size, 1, 1]),
            n("Squeeze", ["pool", "ax"], ["back"], name="back"),
            n("Mul", ["back", "alpha"], ["m"], name="alpha"),
            n("Add", ["m", "k"], ["a"], name="k"),
            n("Pow", ["a", "beta"], ["p"], name="beta"),
            n("Div", ["x", "p"], ["y"], name="div"),
        ],
        {"x": [1, 6, 3, 3]},
        {"y": [1, 6, 3, 3]},
        {
            "ax": np.array([1]),
            "pads": np.array([0, 0, before, 0, 0, 0, 0, after, 0, 0]),
            "alpha": np.array(1.7e-2, np.float32),
            "k": np.array(1.3, np.float32),
            "beta": np.array(0.75, np.float32),
        },
    )


def test_the_written_out_norm_is_one_lrn_node() -> None:
    model = written_out(3)
    graph = graph_of(model)
    log = run_pass(graph, local_response_norm)
    assert ops(graph) == ["LRN"] and log.fired == {names.LOCAL_RESPONSE_NORM: 1}
    assert graph.nodes[0].attrs["size"] == 3
    assert_computes_as_onnxruntime(model, graph)


def test_an_even_window_centred_as_torch_centres_it_is_left_written_out() -> None:
    graph = graph_of(written_out(2))
    log = run_pass(graph, local_response_norm)
    assert len(graph.nodes) == 9 and log.fired == {}
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (
            ["square", "lift", "pad", "pool", "back", "alpha", "k", "beta", "div"],
            "the window of 2 channels is padded (1, 0), ONNX LRN's is (0, 1): "
            "an even size centred the other way is a different function",
        )
    ]
