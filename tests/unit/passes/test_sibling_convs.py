"""`sum_sibling_convs` and `merge_sibling_convs` (opfuse/passes/sibling_convs.py) on tiny graphs:
two convolutions of one input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph
from opfuse.ir.ops import NHWC_CONV
from opfuse.passes.pipeline import PASSES
from opfuse.passes.rules import RuleLog
from opfuse.passes.sibling_convs import sum_sibling_convs
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model, weights

n = helper.make_node
LAYOUT, MERGE = (
    next(p for p in PASSES if p.name == r) for r in (names.CHANNELS_LAST, names.MERGE_SIBLING_CONVS)
)


def siblings(second_stride: int = 1, add: bool = True) -> onnx.ModelProto:
    nodes = [
        n("Conv", ["x", "w1", "b1"], ["c1"], name="conv3x3", pads=[1, 1, 1, 1]),
        n("Conv", ["x", "w2", "b2"], ["c2"], name="conv1x1", strides=[second_stride] * 2),
    ]
    size = (6 - 1) // second_stride + 1
    if add:
        nodes.append(n("Add", ["c1", "c2"], ["y"], name="add"))
        outputs = {"y": [1, 4, 6, 6]}
    else:
        nodes += [n("Relu", ["c1"], ["y1"], name="r1"), n("Sigmoid", ["c2"], ["y2"], name="r2")]
        outputs = {"y1": [1, 4, 6, 6], "y2": [1, 5, size, size]}
    out2 = 4 if add else 5
    return tiny_model(
        nodes,
        {"x": [1, 3, 6, 6]},
        outputs,
        {
            "w1": weights(4, 3, 3, 3),
            "b1": weights(4, seed=1),
            "w2": weights(out2, 3, 1, 1, seed=2),
            "b2": weights(out2, seed=3),
        },
    )


def test_two_convolutions_of_one_input_summed_are_one_convolution() -> None:
    model = siblings()
    graph = graph_of(model)
    log = run_pass(graph, sum_sibling_convs)
    assert ops(graph) == ["Conv"] and log.fired == {names.SUM_SIBLING_CONVS: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_convolutions_read_by_more_than_the_add_are_not_summed() -> None:
    graph = graph_of(siblings(add=False))
    log = run_pass(graph, sum_sibling_convs)
    assert ops(graph) == ["Conv", "Conv", "Relu", "Sigmoid"] and log.fired == {} and log.not_fired == []


def test_sibling_convolutions_channels_last_are_one_convolution_and_a_split() -> None:
    model = siblings(add=False)
    graph = graph_of(model)
    run_pass(graph, LAYOUT)
    log = run_pass(graph, MERGE)
    assert ops(graph) == ["Transpose", NHWC_CONV, "Split", "Relu", "Sigmoid", "Transpose", "Transpose"]
    assert log.fired == {names.MERGE_SIBLING_CONVS: 1}
    assert_computes_as_onnxruntime(model, graph)


def test_sibling_convolutions_of_different_strides_stay_apart() -> None:
    graph = graph_of(siblings(second_stride=2, add=False))
    run_pass(graph, LAYOUT)
    log = run_pass(graph, MERGE)
    assert ops(graph).count(NHWC_CONV) == 2 and log.fired == {}
    assert [(r.nodes, r.reason) for r in log.not_fired] == [
        (["conv3x3", "conv1x1"], "the convolutions differ in strides, dilations or output size")
    ]


def conv_attention(heads: int = 2, d: int = 8, size: int = 4) -> onnx.ModelProto:
    """EfficientFormerV2's attention: Q, K and V from 1x1 convs of one input, heads split by
    Reshape/Transpose, scores, softmax, value product, heads merged back into channels."""
    c, hw = heads * d, size * size
    nodes = [
        n("Conv", ["x", "wq", "bq"], ["q0"], name="conv_q"),
        n("Conv", ["x", "wk", "bk"], ["k0"], name="conv_k"),
        n("Conv", ["x", "wv", "bv"], ["v0"], name="conv_v"),
        n("Reshape", ["q0", "heads"], ["q1"], name="view_q"),
        n("Transpose", ["q1"], ["q"], name="perm_q", perm=[0, 1, 3, 2]),
        n("Reshape", ["k0", "heads"], ["kt"], name="view_k"),
        n("Reshape", ["v0", "heads"], ["v1"], name="view_v"),
        n("Transpose", ["v1"], ["v"], name="perm_v", perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "kt"], ["s"], name="scores"),
        n("Mul", ["s", "scale"], ["s1"], name="scale"),
        n("Softmax", ["s1"], ["p"], name="softmax", axis=-1),
        n("MatMul", ["p", "v"], ["o"], name="values"),
        n("Transpose", ["o"], ["ot"], name="perm_o", perm=[0, 1, 3, 2]),
        n("Reshape", ["ot", "merge"], ["y"], name="view_o"),
    ]
    inits = {
        "heads": np.array([2, heads, d, hw]),
        "merge": np.array([2, c, size, size]),
        "scale": np.array(d**-0.5),
    }
    for i, t in enumerate("qkv"):
        inits[f"w{t}"] = weights(c, c, 1, 1, seed=10 + i) * 0.5
        inits[f"b{t}"] = weights(c, seed=20 + i)
    return tiny_model(nodes, {"x": [2, c, size, size]}, {"y": [2, c, size, size]}, inits)


def test_sibling_convolutions_feeding_attention_store_the_merged_output() -> None:
    """Attention reads Q, K and V through the Split as views of the merged conv's output, so the
    conv kernel stores that output whole rather than its parts (the attention kernel's first run
    raised KeyError on the merged tensor nobody wrote, and the group ran unfused)."""
    from tests.unit.test_fusion import check_against_ort

    model = conv_attention()
    cm = check_against_ort(model, {"x": [2, 16, 4, 4]})
    r = cm.report
    assert r["fusion"]["passes"]["fired"].get(names.MERGE_SIBLING_CONVS) == 1
    assert [g["kind"] for g in r["fusion"]["groups"]] == ["attention"]
    # One conv for Q, K and V (the library's: nothing to fuse), then the attention kernel, which
    # reads the three parts of its output with strides: the Split and head views launch nothing.
    assert [s.op_type or "kernel" for s in cm.plan.steps] == ["Transpose", NHWC_CONV, "kernel"]
    assert not [nf for nf in r["fusion"]["not_fused"] if "run unfused" in nf["reason"]]
    assert not r["verification"]["rolled_back"]


def reparam_block(
    channels: int = 6, group: int = 1, branches: int = 2, identity: str = "bn", shared_bn: bool = False
) -> onnx.ModelProto:
    """A re-parameterizable block as MobileOne and RepVGG write it for training, exported as is:
    `out = scale(x) + identity(x)`, then `out += conv_kxk[i](x)` for each 3x3 branch, each conv
    with its BatchNormalization. `identity`: "bn" (BatchNormalization of x), "x" (x itself) or
    "" (none). `shared_bn`: the identity's BatchNormalization is also read by a Sub (FastViT's
    RepMixer subtracts its norm, which an exporter may share with the identity branch)."""
    cin = channels // group
    rng = np.random.default_rng(7)

    def bn_params(prefix: str) -> dict[str, np.ndarray]:
        return {
            f"{prefix}_g": (1.0 + 0.3 * rng.standard_normal(channels)).astype(np.float32),
            f"{prefix}_b": (0.2 * rng.standard_normal(channels)).astype(np.float32),
            f"{prefix}_m": (0.2 * rng.standard_normal(channels)).astype(np.float32),
            f"{prefix}_v": rng.uniform(0.5, 1.5, channels).astype(np.float32),
        }

    def conv_bn(name: str, k: int, inits: dict[str, np.ndarray]) -> list[onnx.NodeProto]:
        inits[f"{name}_w"] = weights(channels, cin, k, k, seed=len(inits))
        inits.update(bn_params(name))
        p = k // 2
        return [
            n("Conv", ["x", f"{name}_w"], [f"{name}_c"], name=name, pads=[p] * 4, group=group),
            n(
                "BatchNormalization",
                [f"{name}_c", *(f"{name}_{s}" for s in "gbmv")],
                [name],
                name=f"{name}_bn",
            ),
        ]

    inits: dict[str, np.ndarray] = {}
    nodes = conv_bn("scale", 1, inits)
    out = "scale"
    if identity:
        if identity == "bn":
            inits.update(bn_params("id"))
            nodes.append(
                n("BatchNormalization", ["x", "id_g", "id_b", "id_m", "id_v"], ["ident"], name="id_bn")
            )
        nodes.append(n("Add", ["scale", "ident" if identity == "bn" else "x"], ["sum0"], name="add_id"))
        out = "sum0"
    for i in range(branches):
        nodes += conv_bn(f"kxk{i}", 3, inits)
        nodes.append(n("Add", [out, f"kxk{i}"], [f"sum{i + 1}"], name=f"add{i}"))
        out = f"sum{i + 1}"
    outputs = {out: [2, channels, 7, 5]}
    if shared_bn:
        nodes.append(n("Sub", [out, "ident"], ["mixed"], name="sub_norm"))
        outputs = {"mixed": [2, channels, 7, 5]}
    return tiny_model(nodes, {"x": [2, channels, 7, 5]}, outputs, inits)


def _after_fold_and_sum(model: onnx.ModelProto) -> tuple[Graph, RuleLog]:
    graph = graph_of(model)
    run_pass(graph, next(p for p in PASSES if p.name == names.FOLD_BATCHNORM))
    return graph, run_pass(graph, sum_sibling_convs)


def test_a_reparameterizable_block_is_one_convolution() -> None:
    """Dense (RepVGG) and depthwise (MobileOne's kxk blocks), with the identity as a
    BatchNormalization of x or as x itself: every branch folds into one 3x3 conv."""
    for group, identity in ((1, "bn"), (6, "bn"), (1, "x"), (3, "x"), (6, "")):
        model = reparam_block(group=group, identity=identity, branches=3)
        graph, log = _after_fold_and_sum(model)
        assert ops(graph) == ["Conv"], (group, identity)
        assert log.not_fired == [] and log.fired == {names.SUM_SIBLING_CONVS: 3 + bool(identity)}
        assert_computes_as_onnxruntime(model, graph)


def test_an_identity_batchnorm_read_by_others_stays_for_them() -> None:
    model = reparam_block(group=6, shared_bn=True)
    graph, log = _after_fold_and_sum(model)
    assert sorted(ops(graph)) == ["BatchNormalization", "Conv", "Sub"]
    assert log.fired == {names.SUM_SIBLING_CONVS: 3}
    assert_computes_as_onnxruntime(model, graph)


def test_an_identity_batchnorm_of_runtime_statistics_is_not_folded() -> None:
    model = reparam_block(identity="bn", branches=1)
    mean = next(i for i in model.graph.initializer if i.name == "id_m")
    model.graph.initializer.remove(mean)
    model.graph.input.append(helper.make_tensor_value_info("id_m", onnx.TensorProto.FLOAT, [6]))
    graph, log = _after_fold_and_sum(model)
    assert [r.reason for r in log.not_fired] == [
        "the identity branch's BatchNormalization is not an inference one of constants"
    ]
    assert "BatchNormalization" in ops(graph)


def test_sibling_convolutions_whose_part_is_gathered_by_an_earlier_epilogue_store_the_merged_output() -> None:
    """HRNet's fuse layer: a conv's epilogue adds a nearest-upsampled part of two sibling convs
    planned after it. The epilogue gathers the Resize's input through the Split, from the merged
    conv's output, so that conv stores its output whole, not its parts (the epilogue's first run
    raised KeyError on the merged tensor nobody wrote, and its group ran unfused)."""
    from tests.unit.test_fusion import check_against_ort

    cm = check_against_ort(hrnet_fuse(), {"x": [1, 4, 8, 8], "z": [1, 4, 4, 4]})
    r = cm.report
    assert r["fusion"]["passes"]["fired"].get(names.MERGE_SIBLING_CONVS) == 1
    assert not [nf for nf in r["fusion"]["not_fused"] if "run unfused" in nf["reason"]]
    assert not r["verification"]["rolled_back"]
    # conv_a's kernel (reading the NCHW input in place) adds the gathered part; the merged
    # conv's kernel; the Relu of its other part.
    assert [g["nodes"] for g in r["fusion"]["groups"] if "resize_gather" in g["rule"]] == [
        ["Transpose#ncl1", "conv_a", "relu_a", "fuse_add"]
    ]
    assert r["kernels"]["after"] == 3


def test_a_kernel_planned_to_read_a_value_no_step_writes_runs_unfused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same model with the planner's guard taken away (the planner bug the test above pins):
    the plan is checked before anything runs, the group whose kernel reads the merged tensor
    nobody writes runs unfused with that reason, and the model still computes what onnxruntime
    does."""
    from opfuse.fusion.rules.base import PlanState
    from tests.unit.test_fusion import check_against_ort

    monkeypatch.setattr(PlanState, "read", lambda self: set())
    cm = check_against_ort(hrnet_fuse(), {"x": [1, 4, 8, 8], "z": [1, 4, 4, 4]})
    unfused = [nf for nf in cm.report["fusion"]["not_fused"] if "run unfused" in nf["reason"]]
    assert [nf["nodes"] for nf in unfused] == [["Transpose#ncl1", "conv_a", "relu_a", "fuse_add"]]
    assert "which no step of the plan writes" in unfused[0]["reason"]
    assert "bug in opfuse" in unfused[0]["reason"]


def hrnet_fuse() -> onnx.ModelProto:
    """conv_a, its Relu, and the Add of a nearest-upsampled output of conv_b, a sibling of conv_c
    (both 1x1 of z): HRNet's fuse layer."""
    nodes = [
        n("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        n("Relu", ["a"], ["ar"], name="relu_a"),
        n("Conv", ["z", "wb", "bb"], ["b"], name="conv_b"),
        n("Conv", ["z", "wc", "bc"], ["c"], name="conv_c"),
        n(
            "Resize",
            ["b", "", "scales"],
            ["u"],
            name="upsample",
            mode="nearest",
            coordinate_transformation_mode="asymmetric",
            nearest_mode="floor",
        ),
        n("Add", ["ar", "u"], ["y1"], name="fuse_add"),
        n("Relu", ["c"], ["y2"], name="relu_c"),
    ]
    return tiny_model(
        nodes,
        {"x": [1, 4, 8, 8], "z": [1, 4, 4, 4]},
        {"y1": [1, 6, 8, 8], "y2": [1, 5, 4, 4]},
        {
            "wa": weights(6, 4, 3, 3),
            "ba": weights(6, seed=1),
            "wb": weights(6, 4, 1, 1, seed=2),
            "bb": weights(6, seed=3),
            "wc": weights(5, 4, 1, 1, seed=4),
            "bc": weights(5, seed=5),
            "scales": np.array([1.0, 1.0, 2.0, 2.0]),
        },
    )
