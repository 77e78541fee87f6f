"""`attention` (opfuse/fusion/rules/attention.py) on a tiny graph: Q·Kᵀ, a scale, Softmax, ·V."""

from __future__ import annotations

import numpy as np
from onnx import helper

from opfuse.frontend import rule_registry as names
from tests.builders import claimed, planned, refusals, tiny_model


def attention(axis: int) -> object:
    n = helper.make_node
    return tiny_model(
        [
            n("MatMul", ["q", "kt"], ["s"], name="qk"),
            n("Mul", ["s", "scale"], ["ss"], name="scale"),
            n("Softmax", ["ss"], ["p"], name="softmax", axis=axis),
            n("MatMul", ["p", "v"], ["y"], name="pv"),
        ],
        {"q": [1, 2, 4, 8], "kt": [1, 2, 8, 4], "v": [1, 2, 4, 8]},
        {"y": [1, 2, 4, 8]},
        {"scale": np.array(0.35)},
    )


def test_attention_claims_the_four_nodes_in_one_group() -> None:
    _, plan = planned(attention(-1))
    assert claimed(plan) == [("attention", names.ATTENTION, ["qk", "scale", "softmax", "pv"])]
    assert refusals(plan, names.ATTENTION) == []
    assert abs(plan.groups[0].match.scale - 0.35) < 1e-6


def test_a_softmax_over_another_axis_is_refused_with_its_reason() -> None:
    _, plan = planned(attention(2))
    assert refusals(plan, names.ATTENTION) == [(["qk"], "softmax is not over the last axis")]
    assert all(kind != "attention" for kind, _, _ in claimed(plan))


def test_an_activation_on_the_output_runs_in_the_attention_kernel() -> None:
    """LeViT's `(P @ V) -> Hardswish` (and a scalar Mul after it): the kernel computes them on
    its output tile, every output element as onnxruntime computes it."""
    import onnxruntime as ort

    import opfuse
    from tests.builders import TEST_DEVICE

    n = helper.make_node
    nodes = [
        n("MatMul", ["q", "kt"], ["s"], name="qk"),
        n("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        n("MatMul", ["p", "v"], ["o"], name="pv"),
        n("HardSwish", ["o"], ["h"], name="act"),
        n("Mul", ["h", "half"], ["y"], name="scale"),
    ]
    shapes = {"q": [2, 3, 9, 8], "kt": [2, 3, 8, 11], "v": [2, 3, 11, 8]}
    model = tiny_model(nodes, shapes, {"y": [2, 3, 9, 8]}, {"half": np.array(0.5, dtype=np.float32)})
    cm = opfuse.compile(model, device=TEST_DEVICE, verify=False)
    (g,) = cm.report["fusion"]["groups"]
    assert g["kind"] == "attention" and g["nodes"][-2:] == ["act", "scale"], g
    assert cm.plan.launches == 1
    rng = np.random.default_rng(2)
    feeds = {k: rng.standard_normal(s).astype(np.float32) * 2 for k, s in shapes.items()}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    np.testing.assert_allclose(np.asarray(cm.run(feeds)["y"]), want, rtol=1e-4, atol=1e-5)


def test_the_channels_first_form_runs_in_the_attention_kernel() -> None:
    """EfficientViT's and LeViT's convolutional attention: `v @ softmax(qᵀk + bias)ᵀ` with v as
    [B, H, Dv, S], the output [B, H, Dv, S] then viewed as an image. One kernel reads V transposed
    and writes the output transposed, every output element as onnxruntime computes it."""
    import onnxruntime as ort

    import opfuse
    from tests.builders import TEST_DEVICE

    n = helper.make_node
    b, h, d, dv, s = 2, 3, 8, 12, 16
    nodes = [
        n("Transpose", ["q"], ["qt"], perm=[0, 1, 3, 2], name="q_t"),
        n("MatMul", ["qt", "k"], ["sc"], name="qk"),
        n("Add", ["sc", "bias"], ["sb"], name="bias"),
        n("Softmax", ["sb"], ["p"], name="softmax", axis=-1),
        n("Transpose", ["p"], ["pt"], perm=[0, 1, 3, 2], name="p_t"),
        n("MatMul", ["v", "pt"], ["o"], name="vp"),
        n("Reshape", ["o", "image"], ["y"], name="as_image"),
    ]
    shapes = {"q": [b, h, d, s], "k": [b, h, d, s], "v": [b, h, dv, s]}
    inits = {"bias": np.random.default_rng(1).standard_normal((s, s)), "image": np.array([b, h * dv, 4, 4])}
    model = tiny_model(nodes, shapes, {"y": [b, h * dv, 4, 4]}, inits)
    _, plan = planned(model)
    assert [(kind, ns) for kind, _, ns in claimed(plan)] == [
        ("attention", ["q_t", "qk", "bias", "softmax", "p_t", "vp"])
    ], claimed(plan)  # the view as an image, of the model's output, stays (no launch)
    cm = opfuse.compile(model, device=TEST_DEVICE, verify=False)
    assert cm.plan.launches == 1
    rng = np.random.default_rng(2)
    feeds = {k: rng.standard_normal(sh).astype(np.float32) for k, sh in shapes.items()}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    np.testing.assert_allclose(np.asarray(cm.run(feeds)["y"]), want, rtol=1e-4, atol=1e-5)


def test_a_transposed_product_read_by_another_op_too_is_not_attention() -> None:
    n = helper.make_node
    nodes = [
        n("MatMul", ["q", "kt"], ["sc"], name="qk"),
        n("Softmax", ["sc"], ["p"], name="softmax", axis=-1),
        n("Transpose", ["p"], ["pt"], perm=[0, 1, 3, 2], name="p_t"),
        n("MatMul", ["v", "pt"], ["y"], name="vp"),
        n("Relu", ["pt"], ["z"], name="other"),
    ]
    shapes = {"q": [1, 2, 4, 8], "kt": [1, 2, 8, 4], "v": [1, 2, 8, 4]}
    model = tiny_model(nodes, shapes, {"y": [1, 2, 8, 4], "z": [1, 2, 4, 4]})
    _, plan = planned(model)
    assert all(kind != "attention" for kind, _, _ in claimed(plan))
