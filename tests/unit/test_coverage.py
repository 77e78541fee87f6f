"""Every compute node explained: each node the final plan runs outside a fused group has a
`fusion.not_fused` entry, and the report gives the fused coverage (opfuse/fusion/coverage.py)."""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.fusion.coverage import explain_unfused
from opfuse.fusion.planner import plan_fusion
from opfuse.graph import graph_from_onnx
from opfuse.lowering import build_plan
from tests.builders import TEST_DEVICE


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [4, 16]) for o in outputs],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _weights(seed: int = 0) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    return [
        numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b"),
        numpy_helper.from_array(np.array(1, dtype=np.int64), "axis"),
    ]


def lone_matmul_then_cumsum() -> onnx.ModelProto:
    """MatMul -> CumSum: the MatMul has nothing pointwise to fuse with, and no rule takes a CumSum."""
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["m"], name="mm"), n("CumSum", ["m", "axis"], ["y"], name="running")]
    return _model(nodes, _weights(), ["y"])


def gemm_chain_and_cumsum() -> onnx.ModelProto:
    """MatMul -> Add -> Relu (one GEMM group), then a CumSum of its output."""
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "w"], ["m"], name="mm"),
        n("Add", ["m", "b"], ["h"], name="bias"),
        n("Relu", ["h"], ["r"], name="act"),
        n("CumSum", ["r", "axis"], ["y"], name="running"),
    ]
    return _model(nodes, _weights(1), ["y"])


def _compile(model: onnx.ModelProto, feeds: dict[str, np.ndarray], **kw: Any) -> opfuse.CompiledModel:
    """Compile and check every output element against onnxruntime."""
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    cm = opfuse.compile(
        model,
        input_shapes={k: list(v.shape) for k, v in feeds.items()},
        device=TEST_DEVICE,
        verify=False,
        **kw,
    )
    got = cm.run(feeds)
    names = [o.name for o in session.get_outputs()]
    for name, w in zip(names, want, strict=True):
        np.testing.assert_allclose(np.asarray(got[name]), w, rtol=1e-4, atol=1e-4)
    return cm


def _unexplained(cm: opfuse.CompiledModel) -> list[str]:
    """Labels of the compute steps run outside a fused group that no not_fused entry names."""
    named = {label for e in cm.report["fusion"]["not_fused"] for label in e["nodes"]}
    return [s.label for s in _lone_steps(cm) if s.label not in named]


def _lone_steps(cm: opfuse.CompiledModel) -> list[Any]:
    return [s for s in cm.plan.steps if s.kind == "op" and not s.group and s.launches]


def _entry(cm: opfuse.CompiledModel, label: str) -> dict[str, Any]:
    entries = [e for e in cm.report["fusion"]["not_fused"] if label in e["nodes"]]
    assert entries, f"no not_fused entry names {label}: {cm.report['fusion']['not_fused']}"
    return entries[0]


def _x(seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)}


def test_a_lone_anchor_and_an_op_no_rule_takes_are_explained() -> None:
    cm = _compile(lone_matmul_then_cumsum(), _x())
    assert _unexplained(cm) == []
    mm, running = _entry(cm, "mm"), _entry(cm, "running")
    assert mm["rule"] == "gemm_epilogue" and "a lone MatMul: nothing to fuse with it" in mm["reason"]
    assert running["rule"] == "none" and "no rule takes CumSum here" in running["reason"]
    assert cm.report["fusion"]["coverage"] == {"compute_nodes": 2, "fused": 0, "share": 0.0}


def test_coverage_counts_the_nodes_inside_fused_groups() -> None:
    cm = _compile(gemm_chain_and_cumsum(), _x(1))
    groups = cm.report["fusion"]["groups"]
    assert [sorted(g["nodes"]) for g in groups] == [["act", "bias", "mm"]]
    assert _unexplained(cm) == []
    assert _entry(cm, "running")["rule"] == "none"
    # Only the CumSum runs alone, so only it gets an entry from the coverage pass.
    assert [e["nodes"] for e in cm.report["fusion"]["not_fused"] if e["rule"] == "none"] == [["running"]]
    assert cm.report["fusion"]["coverage"] == {"compute_nodes": 4, "fused": 3, "share": 0.75}


def test_a_disabled_rule_is_named_as_the_reason() -> None:
    cm = _compile(gemm_chain_and_cumsum(), _x(2), fusion_disable=["gemm_epilogue", "pointwise"])
    assert cm.report["fusion"]["groups"] == []
    assert _unexplained(cm) == []
    assert "gemm_epilogue rule is disabled" in _entry(cm, "mm")["reason"]
    for label in ("bias", "act"):
        entry = _entry(cm, label)
        assert entry["rule"] == "pointwise" and "disabled (fusion.disable)" in entry["reason"], entry
    assert cm.report["fusion"]["coverage"] == {"compute_nodes": 4, "fused": 0, "share": 0.0}


def test_a_node_a_rule_already_explained_gets_no_second_entry() -> None:
    graph = graph_from_onnx(lone_matmul_then_cumsum())
    plan = build_plan(graph, plan_fusion(graph), "fp32", list(graph.inputs), list(graph.outputs))
    given = {"rule": "gemm_epilogue", "nodes": ["mm"], "reason": "a reason of the rule's own"}
    not_fused = [dict(given)]
    coverage = explain_unfused(graph, plan, not_fused)
    assert not_fused[0] == given
    assert [e["nodes"] for e in not_fused] == [["mm"], ["running"]]
    assert coverage == {"compute_nodes": 2, "fused": 0, "share": 0.0}
    # Run again on its own output: nothing more to add.
    explain_unfused(graph, plan, not_fused)
    assert len(not_fused) == 2


def _export_default(
    model: torch.nn.Module, args: tuple[torch.Tensor, ...], path: str, dynamo: bool
) -> onnx.ModelProto:
    """torch.onnx.export as a user calls it: the defaults (the dynamo exporter, external data beside
    the model), or the TorchScript exporter with dynamo=False."""
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, args, path)
        else:
            torch.onnx.export(model, args, path, dynamo=False)
    return onnx.load(path)  # with its external data, from beside it


@pytest.mark.parametrize("dynamo", [True, False], ids=["default", "torchscript"])
def test_default_exported_bert_explains_every_unfused_compute_node(tmp_path: Any, dynamo: bool) -> None:
    if importlib.util.find_spec("torchvision") is not None:
        from bench.zoo import import_torchvision  # transformers imports torchvision where it is installed

        import_torchvision()
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64
    )
    bert = transformers.BertModel(config)

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.bert(ids)[0]

    ids = torch.randint(0, 100, (2, 8))
    model = _export_default(LastHidden(), (ids,), os.path.join(tmp_path, "bert.onnx"), dynamo)
    name = model.graph.input[0].name
    cm = _compile(model, {name: ids.numpy()})
    lone = _lone_steps(cm)
    # The embedding Gather runs on the first row kernel's tiles (gather_prologue), not alone.
    assert not [s for s in lone if s.op_type == "Gather"], lone
    assert any("gather_prologue" in g["rule"] for g in cm.report["fusion"]["groups"])
    assert _unexplained(cm) == []
    for entry in cm.report["fusion"]["not_fused"]:
        assert set(entry) == {"rule", "nodes", "reason"} and entry["reason"], entry
    coverage = cm.report["fusion"]["coverage"]
    assert coverage["fused"] == coverage["compute_nodes"] - len({s.node for s in lone})
    assert coverage["share"] == round(coverage["fused"] / coverage["compute_nodes"], 4)
    assert coverage["share"] > 0.5, coverage
