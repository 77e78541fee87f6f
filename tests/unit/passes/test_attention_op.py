"""`attention_op` (opfuse/passes/attention_op.py) on a tiny graph: Attention-23 written out as
Softmax(Q @ K^T * scale + mask) @ V."""

from __future__ import annotations

import onnx
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.attention_op import attention_op
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model

n = helper.make_node


def attention(kv_heads: int) -> onnx.ModelProto:
    return tiny_model(
        [n("Attention", ["q", "k", "v", "mask"], ["y"], name="sdpa")],
        {"q": [1, 2, 3, 4], "k": [1, kv_heads, 5, 4], "v": [1, kv_heads, 5, 4], "mask": [3, 5]},
        {"y": [1, 2, 3, 4]},
        opset=23,
    )


def test_attention_23_is_written_out() -> None:
    model = attention(2)
    graph = graph_of(model)
    log = run_pass(graph, attention_op)
    assert ops(graph) == ["Transpose", "MatMul", "Mul", "Add", "Softmax", "MatMul"]
    assert log.fired == {names.ATTENTION_OP: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_grouped_query_attention_stays_the_library_op() -> None:
    graph = graph_of(attention(1))
    log = run_pass(graph, attention_op)
    assert ops(graph) == ["Attention"]
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["sdpa"], "grouped-query attention (fewer key/value heads than query heads)")
    ]
