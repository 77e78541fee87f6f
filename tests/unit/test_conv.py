"""Conv anchors: the implicit-GEMM template with its epilogue, and the vendor variant."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper, numpy_helper

import opfuse
from tests.builders import TEST_DEVICE, tiny_model
from tests.unit.test_fusion import NHWC_ALWAYS, check_against_ort, make_model, ort_run

RNG = np.random.default_rng(5)


def launch_at_every_config(
    k: Any, args: list[Any], wants: list[Any], precision: str, extra: Any = (), atol_scale: float = 10.0
) -> None:
    """Launch kernel `k`'s generated module on `args` at its config with each tuning candidate (and
    `extra`) applied, its outputs NaN-filled first: every element against `wants` (one tensor per
    output), rtol the precision's tolerance, atol `atol_scale` times it."""
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.candidates import candidates

    module = load_kernel_module(k.source, interpret=TEST_DEVICE == "cpu")
    tol = 1e-4 if precision == "fp32" else 2e-2
    for cand in [*candidates(k), *extra]:
        config = {**k.config, **cand}
        outs = [torch.full(w.shape, float("nan"), device=args[0].device, dtype=args[0].dtype) for w in wants]
        module.launch(*args, *outs, config=config)
        for out, want in zip(outs, wants, strict=True):
            got = out.float().cpu()
            assert torch.allclose(got, want, rtol=tol, atol=tol * atol_scale), (
                config,
                float((got - want).abs().max()),
            )


def conv_model(x: list[int], w: list[int], out: list[int], epilogue: str, **attrs: Any):  # type: ignore[no-untyped-def]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", **attrs)]
    inits = {"w": RNG.standard_normal(w) * 0.3, "b": RNG.standard_normal(w[0]) * 0.1}
    inputs = {"x": x}
    if epilogue == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    elif epilogue == "silu":
        nodes += [helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    elif epilogue == "residual":
        inputs["r"] = out
        nodes += [helper.make_node("Add", ["c", "r"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    elif epilogue == "hardswish":
        nodes.append(helper.make_node("HardSwish", ["c"], ["y"]))
    elif epilogue == "clip":
        inits.update(lo=np.array(0.0), hi=np.array(6.0))
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    return make_model(nodes, inputs, {"y": out}, inits), {k: v for k, v in inputs.items()}


CASES = [
    ([2, 3, 9, 9], [8, 3, 3, 3], [2, 8, 9, 9], "relu", {"pads": [1, 1, 1, 1]}),
    ([1, 4, 10, 12], [6, 4, 3, 3], [1, 6, 4, 5], "silu", {"strides": [2, 2]}),
    ([2, 5, 8, 8], [7, 5, 1, 1], [2, 7, 8, 8], "residual", {}),
    ([1, 3, 11, 11], [4, 3, 3, 3], [1, 4, 7, 7], "hardswish", {"dilations": [2, 2]}),
    ([1, 2, 7, 7], [3, 2, 3, 3], [1, 3, 4, 4], "clip", {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ([1, 2, 6, 9], [3, 2, 2, 3], [1, 3, 6, 7], "relu", {"pads": [1, 0, 0, 0]}),
]


@pytest.mark.parametrize("x, w, out, epilogue, attrs", CASES)
def test_conv_template_with_epilogue(
    x: list[int], w: list[int], out: list[int], epilogue: str, attrs: dict[str, Any]
) -> None:
    m, inputs = conv_model(x, w, out, epilogue, **attrs)
    cm = check_against_ort(m, inputs)
    assert cm.report["kernels"]["after"] == 1
    (k,) = cm.plan.kernels.values()
    assert k.kind == "conv" and "tl.dot(" in k.source


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_conv_template_low_precision(precision: str) -> None:
    m, inputs = conv_model([2, 8, 8, 8], [16, 8, 3, 3], [2, 16, 8, 8], "residual", pads=[1, 1, 1, 1])
    cm = check_against_ort(m, inputs, "fp16")
    from opfuse.compiler import compile as opfuse_compile

    cm = opfuse_compile(m, inputs, precision=precision, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    assert cm.report["verification"]["rolled_back"] == []


@pytest.mark.parametrize(
    "x, w, out, attrs",
    [
        ([1, 6, 8, 8], [6, 1, 3, 3], [1, 6, 8, 8], {"pads": [1, 1, 1, 1]}),
        ([2, 20, 9, 9], [20, 1, 5, 5], [2, 20, 5, 5], {"pads": [2, 2, 2, 2], "strides": [2, 2]}),
    ],
)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("index", ["int32", "int64"])
def test_depthwise_conv_runs_as_its_template_with_the_epilogue(
    x: list[int],
    w: list[int],
    out: list[int],
    attrs: dict[str, Any],
    precision: str,
    index: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both index forms of the template: int32 offsets (every real model so far) and int64
    (tensors past 2**31 elements, forced here); the window loop unrolled in both."""
    from opfuse.codegen import conv as conv_codegen

    if index == "int64":
        monkeypatch.setattr(conv_codegen, "INT32_INDEX_LIMIT", 0)
    m, inputs = conv_model(x, w, out, "silu", group=x[1], **attrs)
    cm = check_against_ort(m, inputs, precision)
    (g,) = cm.report["fusion"]["groups"]
    assert g["kind"] == "conv" and g["variant"] == "template"
    assert cm.report["kernels"] == {"before": 3, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert "depthwise conv kernel" in k.source and "tl.dot(" not in k.source
    assert ("tl.int64" in k.source) == (index == "int64")
    assert "tl.static_range" in k.source
    # int32: a runtime window loop by default, unrolled as a tuning choice; int64: always unrolled.
    assert ("if UNROLL:" in k.source) == (index == "int32") and k.config["UNROLL"] is False


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_depthwise_template_is_right_at_every_tuning_candidate(precision: str) -> None:
    """Each depthwise tile the tuner may pick, launched on its own against torch's convolution,
    every output element checked (the image is no multiple of any tile)."""
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.candidates import DEPTHWISE_CANDIDATES, candidates
    from tests.builders import depthwise_conv_relu

    channels, size, kernel = 40, 9, 7
    cm = opfuse.compile(
        depthwise_conv_relu(channels, kernel),
        input_shapes={"x": [2, channels, size, size]},
        precision=precision,
        device=TEST_DEVICE,
        verify=False,
        tune_budget_s=0,
    )
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    assert candidates(k) == DEPTHWISE_CANDIDATES
    assert {bool(c.get("UNROLL")) for c in DEPTHWISE_CANDIDATES} == {False, True}
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, channels, size, size, generator=gen)
    w = torch.randn(channels, 1, kernel, kernel, generator=gen)
    b = torch.randn(channels, generator=gen)
    want = torch.relu(torch.nn.functional.conv2d(x, w, b, padding=kernel // 2, groups=channels))
    want = want.permute(0, 2, 3, 1).contiguous()
    dtype = torch.float32 if precision == "fp32" else torch.float16
    dev = torch.device(TEST_DEVICE)
    xn = x.permute(0, 2, 3, 1).contiguous().to(dev, dtype)
    wn = w.permute(0, 2, 3, 1).contiguous().to(dev, dtype)
    module = load_kernel_module(k.source, interpret=TEST_DEVICE == "cpu")
    tol = 1e-4 if precision == "fp32" else 2e-2
    for cand in candidates(k):
        config = {**k.config, **cand}
        out = torch.full(want.shape, float("nan"), device=dev, dtype=dtype)
        module.launch(xn, wn, b.to(dev, dtype), out, config=config)
        got = out.float().cpu()
        assert torch.allclose(got, want, rtol=tol, atol=tol * 10), (config, float((got - want).abs().max()))


GROUPED = [
    # Narrow groups (2 channels in, 2 out): every tile spans several, the weight block-diagonal.
    ([1, 8, 6, 6], [8, 2, 3, 3], [1, 8, 6, 6], {"pads": [1, 1, 1, 1], "group": 4}),
    # Wide groups (24 in, 40 out), strided: tiles within a group and across two; channels that
    # are no multiple of any block.
    ([2, 48, 9, 9], [80, 24, 3, 3], [2, 80, 5, 5], {"pads": [1, 1, 1, 1], "strides": [2, 2], "group": 2}),
    # ResNeXt's 32 groups of 4, a 1x1 conv of 6 groups of 3 in and 5 out.
    ([1, 128, 5, 5], [128, 4, 3, 3], [1, 128, 5, 5], {"pads": [1, 1, 1, 1], "group": 32}),
    ([2, 18, 4, 7], [30, 3, 1, 1], [2, 30, 4, 7], {"group": 6}),
]


@pytest.mark.parametrize("x, w, out, attrs", GROUPED)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_grouped_conv_runs_as_its_template_with_the_epilogue(
    x: list[int], w: list[int], out: list[int], attrs: dict[str, Any], precision: str
) -> None:
    m, inputs = conv_model(x, w, out, "silu", **attrs)
    # No tuning: on the GPU it measures the template against the library's conv and may keep either.
    cm = check_against_ort(m, inputs, precision, tune_budget_s=0)
    (g,) = cm.report["fusion"]["groups"]
    assert g["kind"] == "conv" and g["variant"] == "template", g
    assert cm.report["kernels"] == {"before": 3, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert f"{attrs['group']} groups" in k.source and "tl.dot(" in k.source


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_grouped_template_is_right_at_every_tuning_candidate(precision: str) -> None:
    """Each tile the tuner may pick (BLOCK_N of 16 to 128 against groups of 24 output channels:
    a tile within one group, across two, across several), against torch's convolution, every
    output element checked."""
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.candidates import candidates

    n, c, co, groups, size = 2, 36, 72, 3, 7
    m, inputs = conv_model(
        [n, c, size, size], [co, c // groups, 3, 3], [n, co, size, size], "relu", pads=[1] * 4, group=groups
    )
    cm = opfuse.compile(m, inputs, precision=precision, device=TEST_DEVICE, verify=False, tune_budget_s=0)
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    weights = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, c, size, size, generator=gen)
    w, b = torch.tensor(weights["w"]).float(), torch.tensor(weights["b"]).float()
    want = torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1, groups=groups))
    dtype = torch.float32 if precision == "fp32" else torch.float16
    dev = torch.device(TEST_DEVICE)
    module = load_kernel_module(k.source, interpret=TEST_DEVICE == "cpu")
    tol = 1e-4 if precision == "fp32" else 2e-2
    xn = x.permute(0, 2, 3, 1).contiguous().to(dev, dtype)
    wn = w.permute(0, 2, 3, 1).contiguous().to(dev, dtype)
    want = want.permute(0, 2, 3, 1).contiguous()
    ran = 0
    for cand in candidates(k):
        config = {**k.config, **cand}
        got = torch.full(want.shape, float("nan"), device=dev, dtype=dtype)
        try:
            module.launch(xn, wn, b.to(dev, dtype), got, config=config)
        except Exception as exc:  # on the GPU, a tile over the shared memory: tuning drops it too
            if type(exc).__name__ != "OutOfResources":
                raise
            continue
        ran += 1
        assert torch.allclose(got.float().cpu(), want, rtol=tol, atol=tol * 10), (
            config,
            float((got.float().cpu() - want).abs().max()),
        )
    assert ran, "no candidate config compiled"


def test_conv_epilogue_may_read_the_conv_input() -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Add", ["c", "x"], ["y"]),
    ]
    m = make_model(nodes, {"x": [1, 4, 5, 5]}, {"y": [1, 4, 5, 5]}, {"w": RNG.standard_normal((4, 4, 1, 1))})
    cm = check_against_ort(m, {"x": [1, 4, 5, 5]})
    assert cm.report["kernels"] == {"before": 2, "after": 1}


def test_a_fused_plan_slower_than_the_unfused_one_says_where(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report keeps the convolutions' time before and after (with their fused ops); a fused
    plan measured slower than the unfused one gets a note naming that time and the switch."""
    from opfuse.bench import protocol
    from opfuse.report import slower_note

    m, inputs = conv_model([2, 8, 10, 10], [8, 8, 3, 3], [2, 8, 10, 10], "relu", pads=[1, 1, 1, 1])
    cm = check_against_ort(m, inputs, fusion_disable=NHWC_ALWAYS)  # channels-last on either device
    conv = cm.report["profile"]["convolutions_ms"]
    assert conv["before"] > 0 and conv["after"] > 0
    assert "speedup_note" not in cm.report

    calls: list[int] = []

    def measure(*args: Any, **kwargs: Any) -> dict[str, Any]:
        # Before (the first call) 2 ms; every fused measurement (on the GPU: step by step and
        # as a CUDA graph) 3 ms, so the fused plan is the slower one.
        calls.append(1)
        return {"latency_ms": {"p50": 2.0 if len(calls) == 1 else 3.0}}

    monkeypatch.setattr(protocol, "measure", measure)
    cm.report["profile"]["convolutions_ms"] = {"before": 1.0, "after": 1.5}
    report = cm.benchmark(iters=2, warmup=1)
    assert report["speedup"] == pytest.approx(2 / 3)
    note = report["speedup_note"]
    assert "3.000 ms against 2.000 ms" in note and "took 1.500 ms against 1.000 ms" in note
    assert 'fusion.disable ["channels_last"]' in note  # the conv ran channels-last

    # Convolutions no slower, or no channels-last region: no advice about either.
    assert "convolutions" not in slower_note(2.0, 3.0, {"before": 1.0, "after": 1.0}, True)
    assert "channels_last" not in slower_note(2.0, 3.0, {"before": 1.0, "after": 2.0}, False)
    assert "convolutions" not in slower_note(2.0, 3.0, None, True)


def test_a_model_without_convolutions_has_no_conv_times() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    cm = check_against_ort(make_model(nodes, {"x": [3, 4]}, {"y": [3, 4]}, {}), {"x": [3, 4]})
    assert "convolutions_ms" not in cm.report["profile"]


def concat_of_convs(
    x: list[int], branches: list[tuple[int, int, int, list[int]]], act: list[str | None]
) -> tuple[Any, dict[str, np.ndarray]]:
    """Convolutions of one input, each (out channels, kh, kw, pads) with its activation (or None),
    concatenated along channels: SqueezeNet's fire-module expand."""
    nodes, inits, concat_in = [], {}, []
    for i, ((co, kh, kw, pads), a) in enumerate(zip(branches, act, strict=True)):
        inits[f"w{i}"] = RNG.standard_normal((co, x[1], kh, kw)) * 0.2
        inits[f"b{i}"] = RNG.standard_normal(co) * 0.1
        nodes.append(helper.make_node("Conv", ["x", f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=pads))
        if a is not None:
            nodes.append(helper.make_node(a, [f"c{i}"], [f"a{i}"], name=f"act{i}"))
        concat_in.append(f"a{i}" if a is not None else f"c{i}")
    nodes.append(helper.make_node("Concat", concat_in, ["y"], name="cat", axis=1))
    out = [x[0], sum(b[0] for b in branches), x[2], x[3]]
    return make_model(nodes, {"x": x}, {"y": out}, inits), inits


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_convs_of_one_input_concatenated_become_one_conv_that_skips_the_taps_a_branch_lacks(
    precision: str,
) -> None:
    import torch

    shape = [2, 16, 9, 9]
    m, w = concat_of_convs(shape, [(24, 1, 1, [0, 0, 0, 0]), (40, 3, 3, [1, 1, 1, 1])], ["Relu", "Relu"])
    cm = check_against_ort(m, {"x": shape}, precision, fusion_disable=NHWC_ALWAYS)
    assert cm.report["fusion"]["passes"]["fired"]["merge_concat_convs"] == 1
    assert cm.report["kernels"] == {"before": 5, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert k.kind == "conv" and "for th in range(th0, th1):" in k.source
    (g,) = cm.report["fusion"]["groups"]
    assert {"conv0", "conv1", "act0", "act1"} <= set("+".join(g["nodes"]).split("+"))

    # Every tile the tuner may pick, against torch: tiles inside the 1x1 branch's 24 channels run
    # one window position, tiles across the boundary the union of both windows.
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=gen)
    w0, w1 = (torch.from_numpy(w[f"w{i}"]).float() for i in (0, 1))
    b0, b1 = (torch.from_numpy(w[f"b{i}"]).float() for i in (0, 1))
    conv = torch.nn.functional.conv2d
    want = torch.cat([conv(x, w0, b0).relu(), conv(x, w1, b1, padding=1).relu()], 1).permute(0, 2, 3, 1)
    merged = torch.zeros(64, 16, 3, 3)
    merged[:24, :, 1:2, 1:2], merged[24:] = w0, w1
    dtype = torch.float32 if precision == "fp32" else torch.float16
    dev = torch.device(TEST_DEVICE)
    args = [
        x.permute(0, 2, 3, 1).contiguous().to(dev, dtype),
        merged.permute(0, 2, 3, 1).contiguous().to(dev, dtype),
        torch.cat([b0, b1]).to(dev, dtype),
    ]
    launch_at_every_config(k, args, [want], precision, [{"BLOCK_N": 16, "BLOCK_M": 32}])


def test_concatenated_convs_of_different_windows_merge_into_their_bounding_window() -> None:
    shape = [1, 16, 8, 10]
    branches = [(32, 3, 3, [1, 1, 1, 1]), (16, 5, 5, [2, 2, 2, 2]), (8, 1, 3, [0, 1, 0, 1])]
    m, _ = concat_of_convs(shape, branches, ["LeakyRelu"] * 3)
    cm = check_against_ort(m, {"x": shape}, fusion_disable=NHWC_ALWAYS)
    assert cm.report["kernels"] == {"before": 7, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert "w [56, 5, 5, 16]" in k.source and "for th in range(th0, th1):" in k.source


def test_concatenated_convs_that_cannot_share_a_conv_say_why() -> None:
    shape = [1, 16, 6, 6]
    m, _ = concat_of_convs(shape, [(8, 1, 1, [0] * 4), (8, 3, 3, [1] * 4)], ["Relu", "Sigmoid"])
    cm = check_against_ort(m, {"x": shape}, fusion_disable=NHWC_ALWAYS)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "merge_concat_convs"]
    assert nf["reason"] == "the branches end in different activations"
    assert nf["nodes"] == ["conv0", "act0", "conv1", "act1", "cat"]
    # A 1x1 beside a wide 5x5: the vendor convolution would do 4.3x the work.
    m, _ = concat_of_convs(shape, [(16, 1, 1, [0] * 4), (4, 5, 5, [2] * 4)], [None, None])
    cm = check_against_ort(m, {"x": shape}, fusion_disable=NHWC_ALWAYS)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "merge_concat_convs"]
    assert "would do over 2.0x the branches' multiply-adds" in nf["reason"]
    # Disabled, the branches stay apart: two conv kernels, the second writing the Concat
    # (`concat_epilogue`), or the Concat's copy too without that rule.
    # (merge_sibling_convs off too, which would make them one conv again, writing a Split.)
    m, _ = concat_of_convs(shape, [(8, 1, 1, [0] * 4), (8, 3, 3, [1] * 4)], ["Relu", "Relu"])
    off = (*NHWC_ALWAYS, "merge_concat_convs", "merge_sibling_convs")
    cm = check_against_ort(m, {"x": shape}, fusion_disable=off)
    assert "merge_concat_convs" not in cm.report["fusion"]["passes"]["fired"]
    assert cm.report["kernels"]["after"] == 2
    off = (*off, "concat_epilogue")
    assert check_against_ort(m, {"x": shape}, fusion_disable=off).report["kernels"]["after"] == 3


def squeeze_excite(n: int, c: int, hidden: int, size: int = 5) -> tuple[Any, dict[str, np.ndarray]]:
    """x * HardSigmoid(W2 Relu(W1 mean(x) + b1) + b2), then a 1x1 conv: MobileNetV3's block tail."""
    inits = {
        "w1": RNG.standard_normal((hidden, c, 1, 1)) * 0.3,
        "b1": RNG.standard_normal(hidden) * 0.1,
        "w2": RNG.standard_normal((c, hidden, 1, 1)) * 0.3,
        "b2": RNG.standard_normal(c) * 0.1,
        "wp": RNG.standard_normal((8, c, 1, 1)) * 0.2,
    }
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["p"], name="pool"),
        helper.make_node("Conv", ["p", "w1", "b1"], ["f1"], name="fc1"),
        helper.make_node("Relu", ["f1"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2", "b2"], ["f2"], name="fc2"),
        helper.make_node("HardSigmoid", ["f2"], ["s"], name="gate", alpha=1 / 6),
        helper.make_node("Mul", ["x", "s"], ["xs"], name="scale"),
        helper.make_node("Conv", ["xs", "wp"], ["y"], name="project"),
    ]
    shape = [n, c, size, size]
    return make_model(nodes, {"x": shape}, {"y": [n, 8, size, size]}, inits), inits


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_squeeze_excite_mlp_runs_as_one_chained_gemv_kernel(precision: str, layout: str) -> None:
    import torch

    from opfuse.tuning.candidates import candidates

    n, c, hidden = 3, 40, 24
    m, w = squeeze_excite(n, c, hidden)
    off = ("channels_last",) if layout == "nchw" else NHWC_ALWAYS
    # With pooled_gemm the pool is computed on the chain's input tiles (tests/unit/
    # test_pooled_excitation.py): one kernel fewer.
    # tune_budget_s=0: the planned kernels (on the GPU, tuning may give the 1x1 conv to the library).
    pooled = check_against_ort(m, {"x": [n, c, 5, 5]}, precision, fusion_disable=off, tune_budget_s=0)
    (g,) = [g for g in pooled.report["fusion"]["groups"] if g["kind"] == "chain"]
    assert g["rule"] == "gemv_chain+pooled_gemm" and g["nodes"] == ["pool", "fc1", "relu", "fc2", "gate"]
    assert pooled.report["kernels"] == {"before": 7, "after": 2 if layout == "nhwc" else 3}
    # The chain of its own, reading the stored pool.
    cm = check_against_ort(m, {"x": [n, c, 5, 5]}, precision, fusion_disable=(*off, "pooled_gemm"))
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "chain"]
    assert g["rule"] == "gemv_chain" and g["nodes"] == ["fc1", "relu", "fc2", "gate"]
    # The pool, the chained GEMVs, the project conv with the scale as its prologue (NHWC) or the
    # scale as a kernel of its own (NCHW: the input-scale prologue is the NHWC template's).
    assert cm.report["kernels"] == {"before": 7, "after": 3 if layout == "nhwc" else 4}
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "chain"]

    # Every tile the tuner may pick (rows and columns no multiple of any tile), against torch.
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, c, generator=gen)
    t = {name: torch.from_numpy(v).float() for name, v in w.items()}
    h = torch.relu(p @ t["w1"].reshape(hidden, c).T + t["b1"])
    dtype = torch.float32 if precision == "fp32" else torch.float16
    h = h.to(dtype).float()  # the hidden vector is rounded to the model's type, as if stored
    want = torch.nn.functional.hardsigmoid(h @ t["w2"].reshape(c, hidden).T + t["b2"])
    dev = torch.device(TEST_DEVICE)
    args = [p, t["w1"].reshape(hidden, c), t["w2"].reshape(c, hidden), t["b1"], t["b2"]]
    args = [a.contiguous().to(dev, dtype) for a in args]
    assert len(candidates(k)) > 1
    launch_at_every_config(k, args, [want], precision, atol_scale=1.0)


def test_squeeze_excite_mlp_with_a_large_first_weight_stays_two_kernels_and_says_why() -> None:
    m, _ = squeeze_excite(2, 320, 240, size=3)  # 76800 weights: each program would read them again
    cm = check_against_ort(m, {"x": [2, 320, 3, 3]}, fusion_disable=NHWC_ALWAYS)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "gemv_chain"]
    assert nf["nodes"] == ["fc1", "fc2"] and "76800 elements (over 65536)" in nf["reason"]
    # fc1 computes the pool on its tiles (pooled_gemm: the GEMM template's GEMV), then fc2, then
    # the project conv with the scale.
    assert cm.report["kernels"]["after"] == 3
    assert [g["nodes"] for g in cm.report["fusion"]["groups"] if g["kind"] == "gemm"] == [
        ["pool", "fc1", "relu"]
    ]
    m, _ = squeeze_excite(2, 16, 8)
    off = (*NHWC_ALWAYS, "gemv_chain", "pooled_gemm")
    cm = check_against_ort(m, {"x": [2, 16, 5, 5]}, fusion_disable=off)
    assert not any(g["kind"] == "chain" for g in cm.report["fusion"]["groups"])
    assert cm.report["kernels"]["after"] == 4


def separable(
    n: int, c: int, out: int, size: int, stride: int = 1, act: str | None = "Clip", dw_reads: int = 1
) -> tuple[Any, dict[str, np.ndarray]]:
    """A depthwise 3x3 (bias: a folded BatchNorm), an activation, then a 1x1 conv with bias: the
    depthwise-separable pair of MobileNet and ShuffleNet. `dw_reads` 2: the activation's output is
    also a graph output."""
    inits = {
        "wd": RNG.standard_normal((c, 1, 3, 3)) * 0.4,
        "bd": RNG.standard_normal(c) * 0.1,
        "wp": RNG.standard_normal((out, c, 1, 1)) * 0.3,
        "bp": RNG.standard_normal(out) * 0.1,
    }
    nodes = [
        helper.make_node(
            "Conv", ["x", "wd", "bd"], ["d"], name="dw", group=c, pads=[1, 1, 1, 1], strides=[stride, stride]
        )
    ]
    if act == "Clip":
        inits.update(lo=np.array(0.0), hi=np.array(6.0))
        nodes.append(helper.make_node("Clip", ["d", "lo", "hi"], ["a"], name="relu6"))
    elif act is not None:
        nodes.append(helper.make_node(act, ["d"], ["a"], name="act"))
    nodes.append(helper.make_node("Conv", ["a" if act else "d", "wp", "bp"], ["y"], name="pw"))
    o = (size - 1) // stride + 1
    outputs = {"y": [n, out, o, o]}
    if dw_reads == 2:
        outputs["a" if act else "d"] = [n, c, o, o]
    return make_model(nodes, {"x": [n, c, size, size]}, outputs, inits), inits


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("stride, act", [(1, "Clip"), (2, None), (1, "HardSwish")])
def test_depthwise_conv_runs_inside_the_pointwise_conv_that_reads_it(
    precision: str, stride: int, act: str
) -> None:
    import torch

    n, c, out, size = 2, 24, 40, 9
    m, w = separable(n, c, out, size, stride, act)
    # With forward_conv_bias on, the depthwise conv read by the 1x1 conv alone hands its bias
    # on (tests/unit/passes/test_conv_bias.py); here its bias stays, for the prologue to add.
    cm = check_against_ort(m, {"x": [n, c, size, size]}, precision, fusion_disable=("forward_conv_bias",))
    (g,) = cm.report["fusion"]["groups"]
    assert g["rule"] == "conv_epilogue+depthwise_prologue"
    assert g["nodes"] == ["dw", *({"Clip": ["relu6"], "HardSwish": ["act"]}.get(act, [])), "pw"]
    assert cm.report["kernels"]["after"] == 1
    (k,) = cm.plan.kernels.values()
    assert "prologue: depthwise conv on the input tiles" in k.source and "dacc" in k.source

    # Every tile the tuner may pick, against torch (channels no multiple of the K tile).
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, c, size, size, generator=gen)
    t = {name: torch.from_numpy(v).float() for name, v in w.items()}
    dtype = torch.float32 if precision == "fp32" else torch.float16
    d = torch.nn.functional.conv2d(x, t["wd"], t["bd"], stride=stride, padding=1, groups=c)
    d = {"Clip": lambda v: v.clamp(0, 6), "HardSwish": torch.nn.functional.hardswish}.get(act, lambda v: v)(d)
    d = d.to(dtype).float()  # rounded as the stored depthwise output would be
    want = torch.nn.functional.conv2d(d, t["wp"], t["bp"]).permute(0, 2, 3, 1)
    dev = torch.device(TEST_DEVICE)
    args = [
        x.permute(0, 2, 3, 1).contiguous(),
        t["wp"].reshape(out, c),
        t["wd"].reshape(c, 9),
        t["bd"],
        t["bp"],
    ]
    args = [a.contiguous().to(dev, dtype) for a in args]
    launch_at_every_config(k, args, [want], precision, [{"BLOCK_K": 16}])


def test_depthwise_conv_stays_its_own_kernel_where_the_pointwise_conv_is_wide_or_others_read_it() -> None:
    m, _ = separable(1, 16, 160, 6)
    cm = check_against_ort(m, {"x": [1, 16, 6, 6]})
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "depthwise_prologue"]
    assert nf["nodes"] == ["dw", "pw"] and "160 output channels (over 128)" in nf["reason"]
    assert cm.report["kernels"]["after"] == 2
    m, _ = separable(1, 16, 32, 6, dw_reads=2)  # the activation is a graph output too
    assert check_against_ort(m, {"x": [1, 16, 6, 6]}).report["kernels"]["after"] == 2
    m, _ = separable(1, 16, 32, 6)
    cm = check_against_ort(m, {"x": [1, 16, 6, 6]}, fusion_disable=("depthwise_prologue",))
    assert cm.report["kernels"]["after"] == 2


def conv_pool(shape: list[int], out: list[int], epilogue: bool = True, **pool: Any) -> Any:
    """Conv + Relu, a MaxPool, then (with `epilogue`) x * 0.5 + a per-channel bias."""
    c = shape[1]
    inits = {"w": RNG.standard_normal((c, c, 3, 3)) * 0.3, "b": RNG.standard_normal(c) * 0.1}
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p" if epilogue else "y"], name="pool", **pool),
    ]
    if epilogue:
        inits.update(half=np.array(0.5), shift=RNG.standard_normal((c, 1, 1)))
        nodes += [
            helper.make_node("Mul", ["p", "half"], ["h"], name="scale"),
            helper.make_node("Add", ["h", "shift"], ["y"], name="shift"),
        ]
    return make_model(nodes, {"x": shape}, {"y": out}, inits)


POOLS = [
    ([2, 24, 9, 9], [2, 24, 5, 5], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (
        [1, 16, 8, 8],
        [1, 16, 4, 4],
        {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    ),  # past the edge
    ([1, 20, 7, 6], [1, 20, 3, 2], {"kernel_shape": [2, 3], "strides": [2, 2], "dilations": [2, 1]}),
]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("shape, out, pool", POOLS)
def test_max_pool_runs_as_its_template_with_the_epilogue(
    precision: str, shape: list[int], out: list[int], pool: dict[str, Any]
) -> None:
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.candidates import candidates

    cm = check_against_ort(conv_pool(shape, out, **pool), {"x": shape}, precision, fusion_disable=NHWC_ALWAYS)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "pool"]
    assert g["rule"] == "pool_epilogue" and g["nodes"] == ["pool", "scale", "shift"]
    assert cm.report["kernels"] == {"before": 5, "after": 2}
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "pool"]

    # Every tile the tuner may pick, against torch's pool, every element checked.
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(*shape, generator=gen)
    padding = [p for p in pool.get("pads", [0, 0, 0, 0])[:2]]
    want = torch.nn.functional.max_pool2d(
        x,
        pool["kernel_shape"],
        pool["strides"],
        padding,
        pool.get("dilations", [1, 1]),
        bool(pool.get("ceil_mode")),
    )
    assert list(want.shape) == out
    dtype = torch.float32 if precision == "fp32" else torch.float16
    dev = torch.device(TEST_DEVICE)
    xn = x.permute(0, 2, 3, 1).contiguous().to(dev, dtype)
    shift = torch.from_numpy(conv_pool_shift(cm)).to(dev, dtype)
    want = (want.to(dtype).float() * 0.5 + shift.float().cpu().reshape(1, -1, 1, 1)).permute(0, 2, 3, 1)
    module = load_kernel_module(k.source, interpret=TEST_DEVICE == "cpu")
    tol = 1e-5 if precision == "fp32" else 1e-2
    assert len(candidates(k)) > 1
    for cand in candidates(k):
        config = {**k.config, **cand}
        y = torch.full(want.shape, float("nan"), device=dev, dtype=dtype)
        module.launch(xn, shift, y, config=config)
        got = y.float().cpu()
        assert torch.allclose(got, want, rtol=tol, atol=tol), (config, float((got - want).abs().max()))


def conv_pool_shift(cm: Any) -> np.ndarray:
    """The per-channel shift as the pool kernel reads it (NHWC: [1, 1, 1, C])."""
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "pool"]
    return np.asarray(cm.plan.constants[k.inputs[1]], dtype=np.float32)


def test_a_max_pool_alone_stays_the_library_pool_unless_measured_faster() -> None:
    cm = check_against_ort(
        conv_pool([1, 8, 6, 6], [1, 8, 3, 3], epilogue=False, kernel_shape=[2, 2], strides=[2, 2]),
        {"x": [1, 8, 6, 6]},
        fusion_disable=(*NHWC_ALWAYS, "pool_tail"),  # with it, the conv's kernel pools its tile
    )
    assert not any(g["kind"] == "pool" for g in cm.report["fusion"]["groups"])
    assert [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches] == ["opfuse.MaxPoolNHWC"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("shape, out, pool", POOLS)
def test_max_pool_runs_inside_the_1x1_conv_that_reads_it(
    precision: str, shape: list[int], out: list[int], pool: dict[str, Any]
) -> None:
    """SqueezeNet's pool before each squeeze conv: the window's maximum on the conv's input tiles."""
    import torch

    c, co = shape[1], 12
    inits = {"wp": RNG.standard_normal((co, c, 1, 1)) * 0.3, "bp": RNG.standard_normal(co) * 0.1}
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p"], name="pool", **pool),
        helper.make_node("Conv", ["p", "wp", "bp"], ["q"], name="squeeze"),
        helper.make_node("Relu", ["q"], ["y"], name="relu"),
    ]
    # The model's first conv puts the pool in the channels-last region.
    inits["w0"] = np.eye(c).reshape(c, c, 1, 1)
    nodes.insert(0, helper.make_node("Conv", ["x0", "w0"], ["x"], name="stem"))
    m = make_model(nodes, {"x0": shape}, {"y": [out[0], co, *out[2:]]}, inits)
    cm = check_against_ort(m, {"x0": shape}, precision, fusion_disable=NHWC_ALWAYS)
    (g,) = [g for g in cm.report["fusion"]["groups"] if "pool_prologue" in g["rule"]]
    assert g["rule"] == "conv_epilogue+pool_prologue" and g["nodes"] == ["pool", "squeeze", "relu"]
    (k,) = [k for k in cm.plan.kernels.values() if "prologue: max pool on the input tiles" in k.source]

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(*shape, generator=gen)
    w, b = torch.from_numpy(inits["wp"]).float(), torch.from_numpy(inits["bp"]).float()
    dtype = torch.float32 if precision == "fp32" else torch.float16
    pooled = torch.nn.functional.max_pool2d(
        x, pool["kernel_shape"], pool["strides"], pool.get("pads", [0, 0])[:2], pool.get("dilations", [1, 1]),
        bool(pool.get("ceil_mode")),
    )  # fmt: skip
    want = torch.relu(torch.nn.functional.conv2d(pooled.to(dtype).float(), w, b)).permute(0, 2, 3, 1)
    dev = torch.device(TEST_DEVICE)
    args = [x.permute(0, 2, 3, 1).contiguous(), w.reshape(co, c), b]
    args = [a.contiguous().to(dev, dtype) for a in args]
    launch_at_every_config(k, args, [want], precision, [{"BLOCK_K": 16}])


def prologue_alternative(m: Any, shape: list[int]) -> tuple[Any, Any, list[str]]:
    """The model's fused plan, the plan with its one prologue group in the form tuning measures
    it against (variant "vendor"), each checked against onnxruntime on random input, and what
    that group launches in the second: kernel kinds and op types, in order."""
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor

    p = plan_model(m, {"x": shape}, "fp32")
    (g,) = [g for g in p.fusion.groups if g.prologue and g.prologue[0].op_type != "Transpose"]
    alt = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    x = RNG.standard_normal(shape).astype(np.float32)
    want = ort_run(m, {"x": x})[0]
    name = m.graph.output[0].name
    for plan in (p.plan, alt):
        got = Executor(plan, TEST_DEVICE).run({"x": x})[name]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    launched = [s.op_type or alt.kernels[s.kernel].kind for s in alt.steps if s.group == g.id and s.launches]
    return p.plan, alt, launched


@pytest.mark.parametrize("head", ["depthwise", "pool"])
def test_the_split_form_of_a_window_prologue_computes_the_same(head: str) -> None:
    """What tuning measures against a depthwise or pool prologue: its own kernel, then the 1x1
    conv's template (two kernels, no library op)."""
    if head == "depthwise":
        m, _ = separable(2, 16, 24, 7, act="HardSwish")
        shape = [2, 16, 7, 7]
    else:
        c = 16
        inits = {"w0": np.eye(c).reshape(c, c, 1, 1), "wp": RNG.standard_normal((8, c, 1, 1)) * 0.3}
        nodes = [
            helper.make_node("Conv", ["x", "w0"], ["s"], name="stem"),
            helper.make_node(
                "MaxPool", ["s"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1
            ),
            helper.make_node("Conv", ["p", "wp"], ["y"], name="squeeze"),
        ]
        shape = [1, c, 8, 8]
        m = make_model(nodes, {"x": shape}, {"y": [1, 8, 4, 4]}, inits)
    _, _, launched = prologue_alternative(m, shape)
    assert launched == (["conv", "conv"] if head == "depthwise" else ["pool", "conv"])


def depthwise_squeeze_excite(
    n: int, c: int, size: int, stride: int = 1, k: int = 3, dw_reads: int = 1
) -> Any:
    """MobileNetV3's squeeze-excitation after a depthwise conv: dw -> HardSwish -> global pool ->
    two 1x1 convs -> HardSigmoid -> x * gate -> a 1x1 projection. `dw_reads` 2: the depthwise
    conv's output is also a graph output."""
    hidden, out = 8, 12
    inits = {
        "wd": RNG.standard_normal((c, 1, k, k)) * 0.4,
        "bd": RNG.standard_normal(c) * 0.1,
        "w1": RNG.standard_normal((hidden, c, 1, 1)) * 0.3,
        "b1": RNG.standard_normal(hidden) * 0.1,
        "w2": RNG.standard_normal((c, hidden, 1, 1)) * 0.3,
        "b2": RNG.standard_normal(c) * 0.1,
        "wp": RNG.standard_normal((out, c, 1, 1)) * 0.3,
    }
    pad = k // 2
    nodes = [
        helper.make_node(
            "Conv", ["x", "wd", "bd"], ["d"], name="dw", group=c, pads=[pad] * 4, strides=[stride] * 2
        ),
        helper.make_node("HardSwish", ["d"], ["a"], name="act"),
        helper.make_node("GlobalAveragePool", ["a"], ["p"], name="squeeze"),
        helper.make_node("Conv", ["p", "w1", "b1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["hr"], name="relu"),
        helper.make_node("Conv", ["hr", "w2", "b2"], ["g"], name="fc2"),
        helper.make_node("HardSigmoid", ["g"], ["s"], name="gate", alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["a", "s"], ["e"], name="excite"),
        helper.make_node("Conv", ["e", "wp"], ["y"], name="proj"),
    ]
    o = (size - 1) // stride + 1
    outputs = {"y": [n, out, o, o]}
    if dw_reads == 2:
        outputs["d"] = [n, c, o, o]
    return make_model(nodes, {"x": [n, c, size, size]}, outputs, inits), inits


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("n, c, size, stride, k", [(2, 24, 9, 1, 3), (1, 40, 14, 2, 5), (3, 6, 5, 1, 3)])
def test_depthwise_conv_runs_inside_the_squeeze_kernel(
    precision: str, n: int, c: int, size: int, stride: int, k: int
) -> None:
    """Squeeze-excitation in three launches: the depthwise conv, its activation and the pool in
    one row kernel, the two GEMVs chained, the excitation on the projection's input tiles."""
    import torch

    from opfuse.tuning.candidates import candidates

    m, w = depthwise_squeeze_excite(n, c, size, stride, k)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, precision)
    assert cm.report["kernels"] == {"before": 9, "after": 3}
    rows = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert [(g["rule"], g["nodes"]) for g in rows] == [
        ("row_reduction+depthwise_reduction", ["dw", "act", "squeeze"])
    ]
    (kern,) = [x for x in cm.plan.kernels.values() if x.kind == "rowwise"]
    assert "prologue: depthwise conv on the tiles" in kern.source and "dacc" in kern.source

    # Every config the tuner may pick, against torch: both outputs, every element.
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, c, size, size, generator=gen)
    t = {name: torch.from_numpy(v).float() for name, v in w.items()}
    dtype = torch.float32 if precision == "fp32" else torch.float16
    d = torch.nn.functional.conv2d(x, t["wd"], t["bd"], stride=stride, padding=k // 2, groups=c)
    act = torch.nn.functional.hardswish(d.to(dtype).float()).permute(0, 2, 3, 1)  # NHWC
    pooled = act.mean(dim=(1, 2), keepdim=True)
    dev = torch.device(TEST_DEVICE)
    args = [x.permute(0, 2, 3, 1).contiguous(), t["wd"].reshape(c, k * k), t["bd"]]
    args = [a.contiguous().to(dev, dtype) for a in args]
    configs = [{**kern.config, **cand} for cand in candidates(kern)]
    assert any(cfg["BLOCK_I"] < kern.config["BLOCK_I"] for cfg in configs) or kern.config["BLOCK_I"] < 8
    launch_at_every_config(kern, args, [act, pooled], precision)


def test_depthwise_reduction_says_why_not() -> None:
    m, _ = depthwise_squeeze_excite(1, 16, 6, dw_reads=2)  # the depthwise output is a graph output too
    cm = check_against_ort(m, {"x": [1, 16, 6, 6]})
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "depthwise_reduction"]
    assert nf["nodes"] == ["dw", "squeeze"] and "read outside the row kernel" in nf["reason"]
    assert cm.report["kernels"]["after"] == 4
    m, _ = depthwise_squeeze_excite(1, 16, 6)
    cm = check_against_ort(m, {"x": [1, 16, 6, 6]}, fusion_disable=("depthwise_reduction", "pooled_gemm"))
    assert cm.report["kernels"]["after"] == 4
    assert all("depthwise_reduction" not in g["rule"] for g in cm.report["fusion"]["groups"])
    # Without depthwise_reduction but with pooled_gemm: the depthwise conv stores its activation,
    # the SE MLP pools it on its tiles; three kernels again.
    cm = check_against_ort(m, {"x": [1, 16, 6, 6]}, fusion_disable=("depthwise_reduction",))
    assert cm.report["kernels"]["after"] == 3
    assert [g["nodes"][0] for g in cm.report["fusion"]["groups"] if g["kind"] == "chain"] == ["squeeze"]


def test_the_split_form_of_a_depthwise_reduction_computes_the_same() -> None:
    """What tuning measures against a depthwise conv computed on a row kernel's tiles: the
    library's depthwise conv, then the row kernel reading its output."""
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor

    shape = [2, 16, 7, 7]
    m, _ = depthwise_squeeze_excite(2, 16, 7, stride=2)
    p = plan_model(m, {"x": shape}, "fp32")
    (g,) = [g for g in p.fusion.groups if g.kind == "rowwise" and g.prologue]
    split = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    mine = [s for s in split.steps if s.group == g.id]
    assert [(s.kind, s.op_type) for s in mine] == [("op", "opfuse.ConvNHWC"), ("kernel", "")]
    assert "dacc" not in split.kernels[mine[1].kernel].source
    x = RNG.standard_normal(shape).astype(np.float32)
    want = ort_run(m, {"x": x})[0]
    for plan in (p.plan, split):
        got = Executor(plan, TEST_DEVICE).run({"x": x})["y"]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def check_every_candidate(
    cm: Any, k: Any, model: Any, feeds: dict[str, np.ndarray], precision: str, extra: Any = ()
) -> None:
    """Run the compiled plan with kernel `k` at each tuning candidate config (and `extra`), every
    output element against onnxruntime at the precision's tolerance (relative L2)."""
    from opfuse.runtime.executor import Executor
    from opfuse.tuning.candidates import candidates

    want = ort_run(model, feeds)[0]
    tol = 1e-4 if precision == "fp32" else 2e-2
    ex = Executor(cm.plan, TEST_DEVICE)
    name = cm.plan.outputs[0].name
    ran = 0
    for cand in [*candidates(k), *extra]:
        ex.configs[k.id] = {**k.config, **cand}
        try:
            got = np.asarray(ex.run(feeds)[name], dtype=np.float32)
        except Exception as exc:  # on the GPU, a tile over the shared memory: tuning drops it too
            if type(exc).__name__ != "OutOfResources":
                raise
            continue
        ran += 1
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert err < tol, (cand, err)
    assert ran, "no candidate config compiled"


def concat_block(n: int, c: int, size: int, two_convs: bool) -> Any:
    """ShuffleNet's block ends: `two_convs` False, the input's first half passed through beside
    Relu(conv(second half)) (a stride-1 unit); True, Relu(conv_a(x)) beside Relu(conv_b(x)) (the
    stride-2 unit's two branches). Then the Concat goes on into a 3x3 conv."""
    half = c // 2
    inits = {
        "wa": RNG.standard_normal((half, half if not two_convs else c, 1, 1)) * 0.3,
        "ba": RNG.standard_normal(half) * 0.1,
        "wb": RNG.standard_normal((half, c, 3, 3)) * 0.2,
        "bb": RNG.standard_normal(half) * 0.1,
        "wh": RNG.standard_normal((6, c, 3, 3)) * 0.2,
        "split": np.array([half, half]),
    }
    if two_convs:
        nodes = [
            helper.make_node("Conv", ["x", "wa", "ba"], ["ca"], name="branch_a"),
            helper.make_node("Relu", ["ca"], ["p"], name="relu_a"),
            helper.make_node("Conv", ["x", "wb", "bb"], ["cb"], name="branch_b", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["cb"], ["b"], name="relu_b"),
        ]
    else:
        nodes = [
            helper.make_node("Split", ["x", "split"], ["p", "q"], name="halves", axis=1),
            helper.make_node("Conv", ["q", "wa", "ba"], ["cb"], name="branch_b"),
            helper.make_node("Relu", ["cb"], ["b"], name="relu_b"),
        ]
    nodes += [
        helper.make_node("Concat", ["p", "b"], ["cat"], name="cat", axis=1),
        helper.make_node("Conv", ["cat", "wh"], ["y"], name="head", pads=[1, 1, 1, 1]),
    ]
    m = make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, 6, size, size]}, inits)
    m.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array([half, half], np.int64), "split"))
    return m


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("two_convs", [False, True])
def test_a_conv_writes_the_concat_it_feeds(precision: str, two_convs: bool) -> None:
    """The Concat's copy kernel is gone: the branch's conv stores its channels at their offset of
    the Concat's output and copies the other input (a view of the block's input, or the other
    branch's output) into its own, at every launch config the tuner may pick."""

    n, c, size = 2, 24, 7
    m = concat_block(n, c, size, two_convs)
    # The rules that would make the two branches one conv.
    off = (*NHWC_ALWAYS, "merge_concat_convs", "merge_sibling_convs")
    cm = check_against_ort(m, {"x": [n, c, size, size]}, precision, fusion_disable=off)
    launched = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert "Concat" not in launched
    assert cm.report["kernels"]["after"] == (3 if two_convs else 2)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["rule"].endswith("+concat_epilogue")]
    assert g["nodes"] == ["branch_b", "relu_b", "cat"]
    (k,) = [k for k in cm.plan.kernels.values() if k.group == g["id"]]
    assert "(written in place, other inputs copied)" in k.source and "tl.num_programs(1)" in k.source
    if not two_convs:  # the half passed through is read from the block's input, not copied first
        assert g["layout_folded"] and "Split" not in launched

    x = RNG.standard_normal((n, c, size, size)).astype(np.float32)
    check_every_candidate(cm, k, m, {"x": x}, precision, [{"BLOCK_N": 16}])


def test_concat_epilogue_says_why_not() -> None:
    """A Concat with a constant input is no conv's epilogue, and the rule can be switched off (the
    Concat then joins the kernel of the pointwise op after it, `concat_select`, or with that rule
    off too is the library's copy)."""
    n, c, size = 1, 8, 5
    inits = {"w": RNG.standard_normal((c, c, 1, 1)) * 0.3, "k": RNG.standard_normal((n, 4, size, size))}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["a"], name="conv"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Concat", ["r", "k"], ["cat"], name="cat", axis=1),
        helper.make_node("Sigmoid", ["cat"], ["y"], name="after"),
    ]
    m = make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, c + 4, size, size]}, inits)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, fusion_disable=NHWC_ALWAYS)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "concat_epilogue"]
    assert nf["nodes"] == ["conv", "cat"] and "constant input" in nf["reason"]
    m = concat_block(1, 8, 5, two_convs=False)
    cm = check_against_ort(m, {"x": [1, 8, 5, 5]}, fusion_disable=(*NHWC_ALWAYS, "concat_epilogue"))
    assert [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches] == ["opfuse.ConvNHWC"]
    assert any("concat_select" in g["rule"] for g in cm.report["fusion"]["groups"])
    off = (*NHWC_ALWAYS, "concat_epilogue", "concat_select")
    cm = check_against_ort(m, {"x": [1, 8, 5, 5]}, fusion_disable=off)
    assert [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches] == [
        "Concat",
        "opfuse.ConvNHWC",
    ]


def test_the_vendor_variant_of_a_conv_writing_a_concat_runs_the_concat_as_its_own_copy() -> None:
    """The library's conv cannot write into the Concat: its variant runs the conv, the epilogue
    kernel, then the Concat op (the passed-through half's view ops before it), and computes the same."""
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor

    shape = [2, 16, 6, 6]
    m = concat_block(2, 16, 6, two_convs=False)
    p = plan_model(m, {"x": shape}, "fp32", NHWC_ALWAYS)
    (g,) = [g for g in p.fusion.groups if g.rule.endswith("+concat_epilogue")]
    vendor = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    mine = [(s.kind, s.op_type) for s in vendor.steps if s.group == g.id and s.launches]
    assert mine == [("op", "opfuse.ConvNHWC"), ("kernel", ""), ("op", "Concat")]
    x = RNG.standard_normal(shape).astype(np.float32)
    want = ort_run(m, {"x": x})[0]
    for plan in (p.plan, vendor):
        got = Executor(plan, TEST_DEVICE).run({"x": x})["y"]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_the_library_form_of_a_conv_adds_its_bias_in_the_epilogues_kernel(dims: int, precision: str) -> None:
    """torch runs a conv's bias as an add kernel of its own after the library's conv: the vendor
    variant runs the library's conv without its bias and adds it (along the channel axis: last in
    NHWC, axis 1 for a 3-D conv left channels-first) as the first op of the epilogue's kernel. The
    result is onnxruntime's, every element."""
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor

    shape = [2, 4, *[6] * dims]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1] * (2 * dims), name="conv"),
        helper.make_node("Sigmoid", ["c"], ["y"], name="act"),
    ]
    inits = {"w": RNG.standard_normal((8, 4, *[3] * dims)) * 0.3, "b": RNG.standard_normal(8)}
    m = make_model(nodes, {"x": shape}, {"y": [2, 8, *[6] * dims]}, inits)
    p = plan_model(m, {"x": shape}, precision, NHWC_ALWAYS)
    (g,) = p.fusion.groups
    vendor = build_plan(
        p.graph, p.fusion, precision, p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"}
    )
    conv, epilogue = [s for s in vendor.steps if s.launches]
    assert conv.op_type == ("Conv" if dims == 3 else "opfuse.ConvNHWC") and conv.inputs[2] == ""
    bias = vendor.kernels[epilogue.kernel].inputs[1]
    channels_last = dims != 3
    assert vendor.values[bias].shape == ((8,) if channels_last else (8, 1, 1, 1))
    x = RNG.standard_normal(shape).astype(np.float32)
    want = ort_run(m, {"x": x})[0]
    tol = 1e-5 if precision == "fp32" else 2e-3
    for plan in (p.plan, vendor):
        got = np.asarray(Executor(plan, TEST_DEVICE).run({"x": x})["y"], np.float32)
        np.testing.assert_allclose(got, want, rtol=10 * tol, atol=tol)


def depthwise_layernorm(n: int, c: int, size: int, k: int = 7) -> Any:
    """ConvNeXt's block head: a kxk depthwise conv, channels-last, then LayerNorm over the channels."""
    inits = {
        "wd": RNG.standard_normal((c, 1, k, k)) * 0.2,
        "bd": RNG.standard_normal(c) * 0.1,
        "g": 1.0 + RNG.standard_normal(c) * 0.1,
        "b": RNG.standard_normal(c) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "wd", "bd"], ["d"], name="dw", group=c, pads=[k // 2] * 4),
        helper.make_node("Transpose", ["d"], ["t"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["t", "g", "b"], ["y"], name="ln", axis=-1, epsilon=1e-6),
    ]
    return make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, size, size, c]}, inits), inits


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_depthwise_conv_runs_inside_the_layernorm_kernel(precision: str) -> None:
    """ConvNeXt's 7x7 depthwise conv computed on the rows of the LayerNorm over its channels that
    reads it: one launch, at every config the tuner may pick (rows per program)."""
    from opfuse.runtime.executor import Executor
    from opfuse.tuning.candidates import candidates

    n, c, size = 2, 16, 5
    m, _ = depthwise_layernorm(n, c, size)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, precision)
    assert cm.report["kernels"] == {"before": 2, "after": 1}  # the Transpose is a view
    (g,) = cm.report["fusion"]["groups"]
    assert g["rule"] == "row_reduction+depthwise_reduction" and g["nodes"] == ["dw", "ln"]
    (k,) = cm.plan.kernels.values()
    assert "prologue: depthwise conv on the tiles" in k.source and "BLOCK_M" in k.config
    x = RNG.standard_normal((n, c, size, size)).astype(np.float32)
    want = ort_run(m, {"x": x})[0]
    tol = 1e-4 if precision == "fp32" else 2e-2
    ex = Executor(cm.plan, TEST_DEVICE)
    blocks = sorted({int(cand.get("BLOCK_M", 1)) for cand in candidates(k)})
    assert len(blocks) > 1
    for block in blocks:  # warps change nothing in the interpreter: each tile once
        cand = {"BLOCK_M": block}
        ex.configs[k.id] = {**k.config, **cand}
        got = np.asarray(ex.run({"x": x})["y"], dtype=np.float32)
        assert np.abs(got - want).max() < tol * 10, (cand, float(np.abs(got - want).max()))


def test_a_conv_with_nothing_else_to_fuse_still_writes_its_concat() -> None:
    """A lone conv (no activation after it) joins a group of its own to write the Concat."""
    n, c, size = 2, 8, 5
    inits = {"w": RNG.standard_normal((c, c, 3, 3)) * 0.3, "b": RNG.standard_normal(c) * 0.1}
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["a"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["x", "a"], ["cat"], name="cat", axis=1),
        helper.make_node("Conv", ["cat", "w2"], ["y"], name="head"),
    ]
    inits["w2"] = RNG.standard_normal((4, 2 * c, 1, 1)) * 0.3
    m = make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, 4, size, size]}, inits)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, "fp16", fusion_disable=NHWC_ALWAYS)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["rule"].endswith("+concat_epilogue")]
    assert g["nodes"] == ["conv", "cat"] and "Concat" not in [s.op_type for s in cm.plan.steps]


def test_a_concat_input_repeated_is_copied_into_each_of_its_places() -> None:
    n, c, size = 1, 8, 4
    half = c // 2
    inits = {
        "w": RNG.standard_normal((half, half, 1, 1)) * 0.3,
        "wh": RNG.standard_normal((3, 3 * half, 1, 1)) * 0.3,
        "split": np.array([half, half]),
    }
    nodes = [
        helper.make_node("Split", ["x", "split"], ["p", "q"], name="halves", axis=1),
        helper.make_node("Conv", ["q", "w"], ["cq"], name="conv"),
        helper.make_node("Relu", ["cq"], ["b"], name="relu"),
        helper.make_node("Concat", ["p", "b", "p"], ["cat"], name="cat", axis=1),
        helper.make_node("Conv", ["cat", "wh"], ["y"], name="head"),
    ]
    m = make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, 3, size, size]}, inits)
    m.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array([half, half], np.int64), "split"))
    cm = check_against_ort(m, {"x": [n, c, size, size]}, fusion_disable=NHWC_ALWAYS)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["rule"].endswith("+concat_epilogue")]
    assert g["nodes"] == ["conv", "relu", "cat"]


def basic_block(
    n: int, c: int, co: int, size: int, stride: int = 2, shortcut_stride: int | None = None
) -> Any:
    """ResNet's basic block with a downsample shortcut: Relu(conv2(Relu(conv1(x))) + down(x)),
    conv1 3x3 and the 1x1 shortcut both at `stride` (the shortcut at `shortcut_stride` if given)."""
    inits = {
        "w1": RNG.standard_normal((co, c, 3, 3)) * 0.2,
        "b1": RNG.standard_normal(co) * 0.1,
        "w2": RNG.standard_normal((co, co, 3, 3)) * 0.2,
        "b2": RNG.standard_normal(co) * 0.1,
        "wd": RNG.standard_normal((co, c, 1, 1)) * 0.3,
        "bd": RNG.standard_normal(co) * 0.1,
    }
    s2 = shortcut_stride or stride
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4, strides=[stride] * 2),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1] * 4),
        helper.make_node("Conv", ["x", "wd", "bd"], ["d"], name="down", strides=[s2] * 2),
        helper.make_node("Add", ["c2", "d"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu2"),
    ]
    o = (size - 1) // stride + 1
    return make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, co, o, o]}, inits)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sibling_convs_reading_one_input_run_as_one_conv(precision: str) -> None:
    """ResNet's downsampling block: conv1 and the 1x1 shortcut read x at stride 2, so they are one
    implicit GEMM (the shortcut's channels on the centre tap only), whose kernel stores Relu(conv1)
    and the shortcut as two buffers. Two launches instead of three, at every tuning candidate."""

    n, c, co, size = 2, 16, 16, 9  # 16 input channels: the window loop, whose zero taps are skipped
    m = basic_block(n, c, co, size)
    # shortcut_conv, which runs first, would sum the shortcut into conv2 instead.
    off = (*NHWC_ALWAYS, "shortcut_conv")
    cm = check_against_ort(m, {"x": [n, c, size, size]}, precision, fusion_disable=off)
    assert cm.report["fusion"]["passes"]["fired"]["merge_sibling_convs"] == 1
    assert cm.report["kernels"] == {"before": 6, "after": 2}
    (g,) = [g for g in cm.report["fusion"]["groups"] if "conv1+down" in g["nodes"]]
    assert g["nodes"] == ["conv1+down", "conv1+down", "relu1"]  # the merged conv, the Split, the Relu
    (k,) = [k for k in cm.plan.kernels.values() if k.group == g["id"]]
    assert "(each part stored from its columns)" in k.source and "for th in range(th0, th1):" in k.source
    x = RNG.standard_normal((n, c, size, size)).astype(np.float32)
    check_every_candidate(cm, k, m, {"x": x}, precision, [{"BLOCK_N": 16}])


def test_sibling_convs_say_why_not() -> None:
    """ResNet-50's bottleneck: its 1x1 conv at stride 1 beside the shortcut at stride 2 cannot
    share a conv; and the rule can be switched off."""
    c = 8
    inits = {
        "wa": RNG.standard_normal((c, c, 1, 1)) * 0.3,
        "wb": RNG.standard_normal((c, c, 3, 3)) * 0.2,
        "wd": RNG.standard_normal((c, c, 1, 1)) * 0.3,
    }
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["a"], name="reduce"),
        helper.make_node("Relu", ["a"], ["ra"], name="relu"),
        helper.make_node("Conv", ["ra", "wb"], ["b"], name="conv3x3", pads=[1] * 4, strides=[2, 2]),
        helper.make_node("Conv", ["x", "wd"], ["d"], name="down", strides=[2, 2]),
        helper.make_node("Add", ["b", "d"], ["y"], name="add"),
    ]
    m = make_model(nodes, {"x": [1, c, 7, 7]}, {"y": [1, c, 4, 4]}, inits)
    # shortcut_conv, which runs first, would sum the shortcut into conv3x3 instead.
    cm = check_against_ort(m, {"x": [1, c, 7, 7]}, fusion_disable=(*NHWC_ALWAYS, "shortcut_conv"))
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "merge_sibling_convs"]
    assert nf["nodes"] == ["reduce", "down"] and "differ in strides" in nf["reason"]
    m = basic_block(1, 8, 8, 7)
    off = (*NHWC_ALWAYS, "merge_sibling_convs", "shortcut_conv")
    cm = check_against_ort(m, {"x": [1, 8, 7, 7]}, fusion_disable=off)
    assert "merge_sibling_convs" not in cm.report["fusion"]["passes"]["fired"]
    assert cm.report["kernels"]["after"] == 3


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_two_convs_of_one_input_added_are_one_conv(precision: str) -> None:
    """relu(conv3x3(x) + conv1x1(x)) at one stride (a downsampling path of one conv beside its
    projection shortcut) is one conv with the kernels summed: one launch, fewer multiply-adds."""
    n, c, co, size = 2, 8, 12, 9
    inits = {
        "wa": RNG.standard_normal((co, c, 3, 3)) * 0.2,
        "ba": RNG.standard_normal(co) * 0.1,
        "wb": RNG.standard_normal((co, c, 1, 1)) * 0.3,
        "bb": RNG.standard_normal(co) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="down", pads=[1] * 4, strides=[2, 2]),
        helper.make_node("Conv", ["x", "wb", "bb"], ["b"], name="skip", strides=[2, 2]),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    m = make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, co, 5, 5]}, inits)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, precision, fusion_disable=NHWC_ALWAYS)
    assert cm.report["fusion"]["passes"]["fired"]["sum_sibling_convs"] == 1
    assert cm.report["kernels"] == {"before": 4, "after": 1}
    (g,) = cm.report["fusion"]["groups"]
    assert g["nodes"] == ["Transpose#ncl1", "down+skip+add", "relu"]  # x read in place (layout_prologue)
    off = check_against_ort(m, {"x": [n, c, size, size]}, fusion_disable=(*NHWC_ALWAYS, "sum_sibling_convs"))
    assert "sum_sibling_convs" not in off.report["fusion"]["passes"]["fired"]
    # Without it the convs still share one implicit GEMM (merge_sibling_convs), then the Add.
    assert off.report["kernels"]["after"] == 2


def test_added_convs_of_different_dilations_stay_apart_and_say_why() -> None:
    n, c, size = 1, 8, 7
    inits = {"wa": RNG.standard_normal((c, c, 3, 3)) * 0.2, "wb": RNG.standard_normal((c, c, 3, 3)) * 0.2}
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["a"], name="near", pads=[1] * 4),
        helper.make_node("Conv", ["x", "wb"], ["b"], name="far", pads=[2] * 4, dilations=[2, 2]),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    m = make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, c, size, size]}, inits)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, fusion_disable=NHWC_ALWAYS)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "sum_sibling_convs"]
    assert nf["nodes"] == ["near", "far", "add"] and nf["reason"] == "the convolutions' dilations differ"


def bottleneck(n: int, c: int, mid: int, co: int, size: int, stride: int = 2) -> Any:
    """ResNet-50's downsampling bottleneck: x -> 1x1 conv -> Relu -> 3x3 conv at `stride` -> Relu
    -> 1x1 conv, plus the 1x1 shortcut of x at `stride`, then Relu."""
    inits = {
        "w1": RNG.standard_normal((mid, c, 1, 1)) * 0.3,
        "b1": RNG.standard_normal(mid) * 0.1,
        "w2": RNG.standard_normal((mid, mid, 3, 3)) * 0.2,
        "b2": RNG.standard_normal(mid) * 0.1,
        "w3": RNG.standard_normal((co, mid, 1, 1)) * 0.3,
        "b3": RNG.standard_normal(co) * 0.1,
        "wd": RNG.standard_normal((co, c, 1, 1)) * 0.3,
        "bd": RNG.standard_normal(co) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="reduce"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node(
            "Conv", ["r1", "w2", "b2"], ["c2"], name="conv3x3", pads=[1] * 4, strides=[stride] * 2
        ),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="expand"),
        helper.make_node("Conv", ["x", "wd", "bd"], ["d"], name="down", strides=[stride] * 2),
        helper.make_node("Add", ["c3", "d"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu3"),
    ]
    o = (size - 1) // stride + 1
    return make_model(nodes, {"x": [n, c, size, size]}, {"y": [n, co, o, o]}, inits)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("c", [8, 16])
def test_a_shortcut_summed_into_the_blocks_last_conv_is_one_gemm(precision: str, c: int) -> None:
    """relu(expand(h) + down(x)): the 1x1 shortcut of the block input at stride 2 is a second K loop
    of the expand conv's kernel (x at the strided pixel, its weight stacked below), so the block
    is three launches, not four, and the shortcut's output is never written. Few channels (the
    flat K loop) and more (the loop over window positions), at every tuning candidate."""
    n, size = 2, 9
    m = bottleneck(n, c, c, 2 * c, size)
    # Untuned: on the GPU, tuning may time the vendor's conv faster for one of the block's convs
    # (a fourth launch: that conv's epilogue on its own); this test is about the template's kernels.
    cm = check_against_ort(
        m, {"x": [n, c, size, size]}, precision, fusion_disable=NHWC_ALWAYS, tune_budget_s=0
    )
    assert cm.report["fusion"]["passes"]["fired"]["shortcut_conv"] == 1
    assert cm.report["kernels"] == {"before": 8, "after": 3}
    (g,) = [g for g in cm.report["fusion"]["groups"] if "expand+down+add" in g["nodes"]]
    assert g["nodes"] == ["expand+down+add", "relu3"] and g["rule"] == "conv_epilogue+shortcut_conv"
    (k,) = [k for k in cm.plan.kernels.values() if k.group == g["id"]]
    assert (
        "summed in a second K loop" in k.source
        and "tl.where(a_ok, s_base[:, None] + ci[None, :], 0)" in k.source
    )
    assert "oh * 2) * 9 + ow * 2)" in k.source  # the strided pixel of x
    assert ("for k0 in range(" in k.source) == (c < 16) and ("for t in range(" in k.source) == (c >= 16)
    assert not any(s.kind == "op" and s.op_type == "opfuse.ConvNHWC" for s in cm.plan.steps)
    x = RNG.standard_normal((n, c, size, size)).astype(np.float32)
    check_every_candidate(cm, k, m, {"x": x}, precision, [{"BLOCK_N": 16}, {"BLOCK_K": 16}])


def conv_and_shortcut(
    n: int, c: int, cz: int, co: int, size: int, shortcut_first: bool = True
) -> tuple[Any, dict[str, list[int]]]:
    """Relu(conv3x3(x) + conv1x1(z)), the Add's operands in either order: (model, input shapes)."""
    inits = {
        "wa": RNG.standard_normal((co, c, 3, 3)) / (3 * c**0.5),
        "ba": RNG.standard_normal(co) * 0.1,
        "wz": RNG.standard_normal((co, cz, 1, 1)) / cz**0.5,
    }
    nodes = [
        helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="main", pads=[1] * 4),
        helper.make_node("Conv", ["z", "wz"], ["b"], name="skip"),
        helper.make_node("Add", ["b", "a"] if shortcut_first else ["a", "b"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    shapes = {"x": [n, c, size, size], "z": [n, cz, size, size]}
    return make_model(nodes, shapes, {"y": [n, co, size, size]}, inits), shapes


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_3x3_conv_plus_a_stride_1_shortcut_of_another_input_is_one_kernel(precision: str) -> None:
    m, shapes = conv_and_shortcut(2, 6, 20, 12, 7)
    cm = check_against_ort(m, shapes, precision, fusion_disable=NHWC_ALWAYS)
    assert cm.report["fusion"]["passes"]["fired"]["shortcut_conv"] == 1
    assert cm.report["kernels"] == {"before": 4, "after": 1}
    (k,) = cm.plan.kernels.values()
    assert "at stride (1, 1), summed in a second K loop" in k.source
    feeds = {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    check_every_candidate(cm, k, m, feeds, precision, [{"BLOCK_K": 16}])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_conv_with_its_shortcut_splits_both_k_loops(precision: str) -> None:
    """Few output tiles (batch 1, 4x4): the 3x3 conv with its summed shortcut tries split-K, each
    program taking every SPLIT_K-th step of the conv's loop and every SPLIT_K-th channel block
    of the shortcut's. At every candidate, and at a split of 3 (uneven over both loops), every
    output element matches onnxruntime, twice in a row (the tile counters go back to 0)."""
    from opfuse.runtime.executor import Executor
    from opfuse.tuning.candidates import split_k_candidates

    m, shapes = conv_and_shortcut(1, 64, 40, 32, 4, shortcut_first=False)
    cm = check_against_ort(m, shapes, precision, fusion_disable=NHWC_ALWAYS)
    (k,) = cm.plan.kernels.values()
    assert "summed in a second K loop" in k.source and k.config["SPLIT_K"] == 1
    assert "range(tl.program_id(2) * BLOCK_K, 40, SPLIT_K * BLOCK_K)" in k.source
    assert {c["SPLIT_K"] for c in split_k_candidates(k)} == {2}
    feeds = {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    odd = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 3}
    check_every_candidate(cm, k, m, feeds, precision, [odd, {"SPLIT_K": 2, "BLOCK_K": 16}])
    ex = Executor(cm.plan, TEST_DEVICE)
    ex.configs[k.id] = {**k.config, **odd}
    want = ort_run(m, feeds)[0]
    for _ in range(2):
        got = np.asarray(ex.run(feeds)["y"], dtype=np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < (1e-4 if precision == "fp32" else 2e-2)


def test_the_shortcut_rule_switched_off_gives_the_old_plan() -> None:
    """Without it the shortcut is a conv of its own (the library's, nothing to fuse) and the Add
    and Relu the expand conv's epilogue: four launches."""
    n, c, size = 1, 8, 7
    m = bottleneck(n, c, c, 16, size)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, fusion_disable=(*NHWC_ALWAYS, "shortcut_conv"))
    assert "shortcut_conv" not in cm.report["fusion"]["passes"]["fired"]
    assert cm.report["kernels"] == {"before": 8, "after": 4}
    (g,) = [g for g in cm.report["fusion"]["groups"] if "expand" in g["nodes"]]
    assert g["nodes"] == ["expand", "add", "relu3"]


@pytest.mark.parametrize(
    "skip, why",
    [
        ({"group": 2}, "a grouped (or depthwise) convolution"),
        ({"kernel": 3, "pads": [1] * 4}, "neither convolution is a 1x1 shortcut"),
        ({"input": "p"}, "the convolutions' outputs differ in shape"),
    ],
)
def test_a_shortcut_that_cannot_be_summed_says_why(skip: dict[str, Any], why: str) -> None:
    n, c, size = 1, 8, 6
    k = int(skip.get("kernel", 1))
    group = int(skip.get("group", 1))
    inits = {
        "wa": RNG.standard_normal((c, c, 3, 3)) * 0.2,
        "wb": RNG.standard_normal((c, c // group, k, k)) * 0.3,
    }
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["a"], name="main", pads=[1] * 4),
        helper.make_node("GlobalAveragePool", ["z"], ["p"], name="pool"),
        helper.make_node(
            "Conv",
            [str(skip.get("input", "z")), "wb"],
            ["b"],
            name="skip",
            group=group,
            pads=list(skip.get("pads", [0] * 4)),
        ),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    shapes = {"x": [n, c, size, size], "z": [n, c, size, size]}
    m = make_model(nodes, shapes, {"y": [n, c, size, size]}, inits)
    cm = check_against_ort(m, shapes, fusion_disable=NHWC_ALWAYS)
    assert "shortcut_conv" not in cm.report["fusion"]["passes"]["fired"]
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "shortcut_conv"]
    assert nf["nodes"] == ["main", "skip", "add"] and nf["reason"].startswith(why)


def test_a_shortcut_conv_left_unfused_runs_both_library_convs_and_their_sum() -> None:
    """Rolled back (its group not enabled), the merged conv is a per-op step: the library's two
    convolutions and their sum, three launches. Its vendor variant is that step, then the
    epilogue's kernel. All three compute what onnxruntime does."""
    from bench.kernels import plan_model
    from opfuse.lowering import build_plan
    from opfuse.runtime.executor import Executor

    n, c, size = 2, 8, 9
    m = bottleneck(n, c, c, 16, size)
    p = plan_model(m, {"x": [n, c, size, size]}, "fp32", NHWC_ALWAYS)
    (g,) = [g for g in p.fusion.groups if len(g.nodes[0].inputs) > 3]
    others = [x.id for x in p.fusion.groups if x.id != g.id]
    unfused = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, enabled=others)
    (step,) = [s for s in unfused.steps if s.kind == "op" and s.op_type == "opfuse.ConvNHWC"]
    assert step.launches == 3 and unfused.launches == p.plan.launches + 3
    vendor = build_plan(p.graph, p.fusion, "fp32", p.plan.inputs, p.plan.outputs, variants={g.id: "vendor"})
    assert [(s.kind, s.op_type) for s in vendor.steps if s.group == g.id] == [
        ("op", "opfuse.ConvNHWC"),
        ("kernel", ""),
    ]
    x = RNG.standard_normal((n, c, size, size)).astype(np.float32)
    want = ort_run(m, {"x": x})[0]
    for plan in (p.plan, unfused, vendor):
        got = Executor(plan, TEST_DEVICE).run({"x": x})["y"]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def stem_pool_block(c: int, size: int, conv: dict[str, Any], residual: bool) -> tuple[Any, list[int]]:
    """A ResNet stem's end and first block: conv -> Relu -> MaxPool(3, 2, 1) -> conv (`conv`'s
    attributes) -> Relu, and, `residual`, a second 3x3 conv plus the pool's output (the block's
    residual Add)."""
    co = c
    k = conv.get("kernel_shape", [3, 3])
    inits = {
        "w0": RNG.standard_normal((c, 3, 3, 3)) * 0.3,
        "wb": RNG.standard_normal((co, c, *k)) * 0.2,
        "bb": RNG.standard_normal(co) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["s"], name="stem", pads=[1] * 4),
        helper.make_node("Relu", ["s"], ["sr"], name="stem_relu"),
        helper.make_node(
            "MaxPool", ["sr"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
        ),
        helper.make_node("Conv", ["p", "wb", "bb"], ["q"], name="conv", **conv),
        helper.make_node("Relu", ["q"], ["r" if residual else "y"], name="relu"),
    ]
    pooled = (size + 1) // 2
    stride = conv.get("strides", [1, 1])[0]
    pad = conv.get("pads", [0] * 4)[0]
    out = (pooled + 2 * pad - k[0]) // stride + 1
    if residual:  # the block's second conv takes the Add in its epilogue
        inits["wc"] = RNG.standard_normal((co, co, 3, 3)) * 0.2
        nodes += [
            helper.make_node("Conv", ["r", "wc"], ["t"], name="conv2", pads=[1] * 4),
            helper.make_node("Add", ["t", "p"], ["y"], name="add"),
        ]
    m = make_model(nodes, {"x": [2, 3, size, size]}, {"y": [2, co, out, out]}, inits)
    return m, [2, 3, size, size]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("channels", [8, 24])
def test_a_stem_pool_runs_inside_the_3x3_conv_that_also_stores_it_for_the_residual_add(
    precision: str, channels: int
) -> None:
    """ResNet's stem pool, read by the first block's 3x3 conv and by the block's residual Add:
    the conv computes the pool on its input tiles at every window position and stores the tile
    it loads at the centre one (first column tile only) for the Add. Three kernels, not four."""
    m, shape = stem_pool_block(channels, 11, {"pads": [1] * 4}, residual=True)
    cm = check_against_ort(m, {"x": shape}, precision, fusion_disable=NHWC_ALWAYS)
    (g,) = [g for g in cm.report["fusion"]["groups"] if "pool_prologue" in g["rule"]]
    assert g["nodes"] == ["pool", "conv", "relu"]
    assert cm.report["kernels"] == {"before": 7, "after": 3}
    (k,) = [k for k in cm.plan.kernels.values() if "prologue: max pool on the input tiles" in k.source]
    assert "pv = tl.maximum(pv, tl.load(x + " in k.source and "if t == 4:" in k.source
    assert len(k.outputs) == 2  # the conv's Relu and the pooled tensor
    check_every_candidate(cm, k, m, {"x": RNG.standard_normal(shape).astype(np.float32)}, precision)
    off = check_against_ort(m, {"x": shape}, precision, fusion_disable=(*NHWC_ALWAYS, "pool_prologue"))
    assert off.report["kernels"]["after"] == 4


@pytest.mark.parametrize("conv", [{"pads": [1] * 4}, {"kernel_shape": [3, 3], "strides": [2, 2]}])
def test_a_max_pool_runs_inside_a_wider_conv_that_alone_reads_it(conv: dict[str, Any]) -> None:
    """A pool read by one 3x3 conv (stride 1 padded, or stride 2 unpadded) is computed on its tiles
    at every window position, and never stored."""
    m, shape = stem_pool_block(16, 12, conv, residual=False)
    cm = check_against_ort(m, {"x": shape}, fusion_disable=NHWC_ALWAYS)
    assert cm.report["kernels"] == {"before": 5, "after": 2}
    (k,) = [k for k in cm.plan.kernels.values() if "prologue: max pool on the input tiles" in k.source]
    assert len(k.outputs) == 1 and "if t ==" not in k.source


def test_a_pool_others_read_stays_its_own_kernel_where_the_conv_cannot_store_it() -> None:
    """Read by a stride-2 conv and by another op, the pool's output would have pixels the conv
    never loads at one window position: the pool keeps its kernel, and says why."""
    m, shape = stem_pool_block(8, 12, {"kernel_shape": [1, 1], "strides": [2, 2]}, residual=False)
    m.graph.output.append(helper.make_tensor_value_info("p", 1, [2, 8, 6, 6]))
    cm = check_against_ort(m, {"x": shape}, fusion_disable=NHWC_ALWAYS)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "pool_prologue"]
    assert nf["nodes"] == ["pool", "conv"] and "stride 1, same size" in nf["reason"]


def test_the_split_form_of_a_stored_pool_prologue_computes_the_same() -> None:
    """Tuning's alternative for a conv storing its pool prologue: the pool's own kernel (which
    writes the pooled tensor for the Add), then the conv's template."""
    m, shape = stem_pool_block(16, 11, {"pads": [1] * 4}, residual=True)
    assert prologue_alternative(m, shape)[2] == ["pool", "conv"]


def padded_conv(
    c: int, mode: str, pads: list[int], conv: dict[str, Any] | None = None, value: float | None = None
) -> tuple[Any, list[int], list[int]]:
    """norm -> Relu -> Pad(`mode`, `pads` over H and W: top, left, bottom, right) -> 3x3 conv
    (`conv`'s attributes). The InstanceNorm keeps the Pad outside the channels-last region, as in
    a segmentation head or an image-to-image generator's blocks."""
    n, size, co = 2, 7, 6
    conv = conv or {}
    inits: dict[str, Any] = {
        "scale": RNG.uniform(0.5, 1.5, c),
        "shift": RNG.standard_normal(c) * 0.1,
        "w": RNG.standard_normal((co, c // int(conv.get("group", 1)), 3, 3)) * 0.2,
        "b": RNG.standard_normal(co) * 0.1,
        "pads": np.array([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]]),
    }
    pad_inputs = ["r", "pads"]
    if value is not None:
        inits["value"] = np.array(value)
        pad_inputs.append("value")
    nodes = [
        helper.make_node("InstanceNormalization", ["x", "scale", "shift"], ["h"], name="norm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Pad", pad_inputs, ["p"], name="pad", mode=mode),
        helper.make_node("Conv", ["p", "w", "b"], ["y"], name="conv", **conv),
    ]
    hp, wp = size + pads[0] + pads[2], size + pads[1] + pads[3]
    s, cp = conv.get("strides", [1, 1])[0], conv.get("pads", [0] * 4)[0]
    out = [n, co, (hp + 2 * cp - 3) // s + 1, (wp + 2 * cp - 3) // s + 1]
    m = make_model(nodes, {"x": [n, c, size, size]}, {"y": out}, inits)
    for init in m.graph.initializer:
        if init.name == "pads":
            init.CopyFrom(numpy_helper.from_array(inits["pads"].astype(np.int64), "pads"))
    return m, [n, c, size, size], out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    "mode, pads, conv, value",
    [
        ("reflect", [1, 1, 1, 1], {}, None),
        ("reflect", [2, 1, 0, 3], {"strides": [2, 2], "pads": [1, 1, 1, 1]}, None),
        ("edge", [1, 2, 2, 1], {}, None),
        ("constant", [1, 1, 2, 2], {}, None),
        ("constant", [2, 0, 1, 1], {"pads": [1, 1, 1, 1]}, 0.75),
        ("reflect", [1, 2, 1, 0], {"group": 3}, None),  # a grouped conv's K loop
        ("constant", [1, 1, 0, 2], {"group": 6, "pads": [1, 1, 1, 1]}, 0.5),
    ],
)
@pytest.mark.parametrize("channels", [12, 24])
def test_a_conv_reads_its_input_through_the_pad_before_it(
    precision: str, mode: str, pads: list[int], conv: dict[str, Any], value: float | None, channels: int
) -> None:
    """The Pad's copy is gone: the conv template reads the unpadded NCHW tensor, each padded pixel
    mapped to the pixel it copies (reflect, edge) or filled with the Pad's value, inside the
    conv's own zero padding. Few channels (one flat K loop) and more (a loop per window position).
    (A zero constant Pad is the conv's own padding by default, fold_pad_into_conv; switched off
    here, the template reads through it like any other.)"""
    m, shape, _ = padded_conv(channels, mode, pads, conv, value)
    keep = (*NHWC_ALWAYS, "fold_pad_into_conv")
    cm = check_against_ort(m, {"x": shape}, precision, fusion_disable=keep)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "conv"]
    assert g["rule"] == "conv_epilogue+pad_prologue" and g["nodes"][0] == "pad" and g["nodes"][-1] == "conv"
    assert cm.report["kernels"] == {"before": 4, "after": 2}
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    assert "sh = " in k.source and ("tl.where(sh < 0, -sh, sh)" in k.source) == (mode == "reflect")
    assert ("tl.maximum(sh, 0)" in k.source) == (mode == "edge")
    check_every_candidate(cm, k, m, {"x": RNG.standard_normal(shape).astype(np.float32)}, precision)
    off = check_against_ort(m, {"x": shape}, precision, fusion_disable=(*keep, "pad_prologue"))
    assert off.report["kernels"]["after"] == 3
    # Without the rule: the Pad's copy, then the conv alone (the library's).
    assert [s.op_type for s in off.plan.steps if s.kind == "op" and s.launches] == ["Pad", "opfuse.ConvNHWC"]


def blur_pool_block(c: int, mode: str, pads: list[int], group: int, stride: int, value: float | None) -> Any:
    """conv -> LeakyRelu -> Pad(`mode`, `pads`: top, left, bottom, right) -> 3x3 conv of `group`
    groups at `stride` -> Relu: the Pad inside the channels-last region, as TResNet's
    anti-aliasing blur pool (a reflect Pad, then a depthwise blur at stride 2) after a conv."""
    n, size = 2, 7
    inits: dict[str, Any] = {
        "w0": RNG.standard_normal((c, 5, 1, 1)) * 0.3,
        "w1": RNG.standard_normal((c, c // group, 3, 3)) * 0.2,
        "b1": RNG.standard_normal(c) * 0.1,
        "pads": np.array([0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]]),
    }
    pad_inputs = ["a", "pads"]
    if value is not None:
        inits["value"] = np.array(value)
        pad_inputs.append("value")
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0"),
        helper.make_node("LeakyRelu", ["c0"], ["a"], name="act", alpha=0.01),
        helper.make_node("Pad", pad_inputs, ["p"], name="pad", mode=mode),
        helper.make_node("Conv", ["p", "w1", "b1"], ["c1"], name="conv", group=group, strides=[stride] * 2),
        helper.make_node("Relu", ["c1"], ["y"], name="relu"),
    ]
    hp, wp = size + pads[0] + pads[2], size + pads[1] + pads[3]
    out = [n, c, (hp - 3) // stride + 1, (wp - 3) // stride + 1]
    m = make_model(nodes, {"x": [n, 5, size, size]}, {"y": out}, inits)
    for init in m.graph.initializer:
        if init.name == "pads":
            init.CopyFrom(numpy_helper.from_array(inits["pads"].astype(np.int64), "pads"))
    return m, [n, 5, size, size]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(
    "mode, pads, group, stride, value",
    [
        ("reflect", [1, 1, 1, 1], 16, 2, None),  # the blur pool: depthwise at stride 2
        ("edge", [2, 1, 0, 1], 16, 1, None),
        ("constant", [1, 0, 2, 1], 16, 2, 0.5),
        ("reflect", [1, 2, 1, 0], 1, 1, None),  # a dense conv's K loop
        ("constant", [0, 1, 1, 2], 4, 1, -0.25),  # a grouped conv's
    ],
)
def test_a_pad_inside_the_channels_last_region_is_read_through_by_the_conv_after_it(
    precision: str, mode: str, pads: list[int], group: int, stride: int, value: float | None
) -> None:
    """A Pad of a conv's output pads the NHWC twin (passes/layout.py): no Transpose back to NCHW
    for it and none into the region after it, and the conv after it, depthwise, dense or grouped,
    reads the unpadded NHWC tensor through it (pad_prologue): two kernels where the Pad was a
    launch of its own between them."""
    m, shape = blur_pool_block(16, mode, pads, group, stride, value)
    cm = check_against_ort(m, {"x": shape}, precision, fusion_disable=NHWC_ALWAYS)
    assert not [s for s in cm.plan.steps if s.op_type == "Transpose" and s.launches]
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["nodes"][0] == "pad"]
    assert g["rule"] == "conv_epilogue+pad_prologue" and g["nodes"] == ["pad", "conv", "relu"]
    assert cm.report["kernels"]["after"] == 2
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv" and "sh = " in k.source]
    assert ("depthwise" in k.source) == (group == 16)
    assert ("tl.where(sh < 0, -sh, sh)" in k.source) == (mode == "reflect")
    check_every_candidate(cm, k, m, {"x": RNG.standard_normal(shape).astype(np.float32)}, precision)
    off = check_against_ort(m, {"x": shape}, precision, fusion_disable=(*NHWC_ALWAYS, "pad_prologue"))
    # Without the rule the Pad runs on its own, still on the NHWC twin.
    assert next(s.op_type for s in off.plan.steps if s.kind == "op" and s.launches) == "Pad"
    assert not [s for s in off.plan.steps if s.op_type == "Transpose" and s.launches]


@pytest.mark.parametrize(
    "mode, pads, why",
    [
        ("wrap", [1, 1, 1, 1], "Pad mode 'wrap'"),
        ("constant", [-1, 1, 1, 1], "negative pads (a crop)"),
    ],
)
def test_a_pad_the_conv_cannot_read_through_stays_and_says_why(mode: str, pads: list[int], why: str) -> None:
    m, shape, _ = padded_conv(8, mode, pads)
    cm = check_against_ort(m, {"x": shape}, fusion_disable=NHWC_ALWAYS)
    (nf,) = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "pad_prologue"]
    assert nf["nodes"] == ["pad", "conv"] and nf["reason"].startswith(why)
    assert "Pad" in [s.op_type for s in cm.plan.steps if s.kind == "op"]


def test_the_library_form_of_a_padded_conv_runs_the_pad_then_the_library_conv() -> None:
    """What tuning measures against the template reading through the Pad: the Pad's own copy,
    then the library's conv with the epilogue after it."""
    m, shape, _ = padded_conv(16, "reflect", [1, 1, 1, 1])
    m.graph.node.append(helper.make_node("Relu", ["y"], ["z"], name="act"))
    m.graph.output[0].name = "z"
    assert prologue_alternative(m, shape)[2] == ["Pad", "opfuse.ConvNHWC", "pointwise"]


def residual_conv(cin: int, cout: int, size: int, kernel: int = 3, groups: int = 1) -> Any:
    """Relu(conv(x) + bias + r): a bottleneck's last conv with its residual Add, at one image."""
    rng = np.random.default_rng(17)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[kernel // 2] * 4, group=groups),
        helper.make_node("Add", ["c", "r"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    shapes = {"x": [1, cin, size, size], "r": [1, cout, size, size]}
    weights = rng.standard_normal((cout, cin // groups, kernel, kernel)) / (cin * kernel) ** 0.5
    return make_model(
        nodes, shapes, {"y": [1, cout, size, size]}, {"w": weights, "b": rng.standard_normal(cout)}
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_split_k_conv_is_right_at_every_split_and_leaves_its_counters_at_zero(precision: str) -> None:
    """A conv whose tiles are too few for the GPU (batch 1, 7×7) tries split-K. At every candidate,
    and at a split of 3 over 16×16 tiles (uneven: 36 steps of K over 12 tiles), every output
    element matches onnxruntime, the grid has SPLIT_K programs per tile, and every tile's counter
    is back at 0 after each run (the next launch, or a CUDA graph's replay, starts clean)."""
    from opfuse.runtime.executor import Executor
    from opfuse.tuning.candidates import candidates, split_k_candidates

    model = residual_conv(64, 48, 7)
    shapes = {"x": [1, 64, 7, 7], "r": [1, 48, 7, 7]}
    cm = opfuse.compile(
        model, shapes, precision, device=TEST_DEVICE, tune_budget_s=0, fusion_disable=NHWC_ALWAYS
    )
    assert cm.report["kernels"] == {"before": 3, "after": 1}
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    assert k.config["SPLIT_K"] == 1 and "tl.atomic_add(lock" in k.source and "if last:" in k.source
    assert cm.report["memory"]["scratch_bytes"] > 0  # its counters, made by the compile's own run
    splits = split_k_candidates(k)
    assert splits and {c["SPLIT_K"] for c in splits} == {2} and all(c in candidates(k) for c in splits)
    feeds = {n: RNG.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    odd = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 3}
    check_every_candidate(cm, k, model, feeds, precision, extra=[odd])
    ex = Executor(cm.plan, TEST_DEVICE)
    want = ort_run(model, feeds)[0]
    for config in [*splits, odd]:
        ex.configs[k.id] = {**k.config, **config}
        for _ in range(2):
            got = np.asarray(ex.run(feeds)[cm.plan.outputs[0].name], dtype=np.float32)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < (1e-4 if precision == "fp32" else 2e-2)
        assert ex.modules[k.id].SCRATCH == {}  # the executor's own, never the module's
        scratch = ex.scratch
        (ws, lock) = next(
            v
            for key, v in scratch.items()
            if key[1][2] == config["SPLIT_K"]
            and key[2] == config.get("BLOCK_M", 64) * config.get("BLOCK_N", 64)
        )
        bm, bn = config.get("BLOCK_M", 64), config.get("BLOCK_N", 64)
        tiles = -(-49 // bm) * -(-48 // bn)
        assert lock.numel() == tiles and int(lock.abs().sum()) == 0, lock
        assert ws.numel() == tiles * config["SPLIT_K"] * bm * bn
        assert ex.scratch_bytes() >= ws.numel() * 4 + lock.numel() * 4


def test_split_k_is_offered_only_where_the_tiles_are_few_and_can_be_switched_off() -> None:
    """Batch 1 at 7×7 tries split-K; at 56×56 (147 tiles of 64×64) it does not; a
    depthwise conv has no K to split; fusion.disable ["split_k"] leaves the template without it."""
    from opfuse.tuning.candidates import split_k_candidates

    def conv_kernel(model: Any, shapes: dict[str, list[int]], disable: tuple[str, ...] = ()) -> Any:
        from bench.kernels import plan_model  # the compile's plans, without running them

        planned = plan_model(model, shapes, "fp16", (*NHWC_ALWAYS, *disable))
        return next(k for k in planned.plan.kernels.values() if k.kind == "conv")

    small = {"x": [1, 256, 7, 7], "r": [1, 256, 7, 7]}
    assert split_k_candidates(conv_kernel(residual_conv(256, 256, 7), small))
    big = {"x": [1, 64, 56, 56], "r": [1, 192, 56, 56]}
    k = conv_kernel(residual_conv(64, 192, 56), big)
    assert k.config["SPLIT_K"] == 1 and split_k_candidates(k) == []
    dw = {"x": [1, 256, 7, 7], "r": [1, 256, 7, 7]}
    k = conv_kernel(residual_conv(256, 256, 7, groups=256), dw)
    assert "SPLIT_K" not in k.config and "atomic_add" not in k.source
    k = conv_kernel(residual_conv(256, 256, 7), small, ("split_k",))
    assert "SPLIT_K" not in k.config and "atomic_add" not in k.source and split_k_candidates(k) == []


def dense_depthwise_norm(n: int, c: int, size: int, parts: int) -> Any:
    """RDNet's block head: the block's features, the Concat of `parts` earlier feature maps (each
    a conv's output that another Concat reads too, as the next block's features do, so no conv
    writes its part in place), a 7x7 depthwise conv of it, channels-last, then LayerNorm over the
    channels."""
    widths = [c + 4 * i for i in range(parts)]
    total = sum(widths)
    inits: dict[str, Any] = {
        "wd": RNG.standard_normal((total, 1, 7, 7)) * 0.2,
        "bd": RNG.standard_normal(total) * 0.1,
        "g": 1.0 + RNG.standard_normal(total) * 0.1,
        "b": RNG.standard_normal(total) * 0.1,
    }
    nodes = []
    for i, width in enumerate(widths):
        inits[f"w{i}"] = RNG.standard_normal((width, c, 3, 3)) * 0.3
        nodes.append(helper.make_node("Conv", ["x", f"w{i}"], [f"f{i}"], name=f"conv{i}", pads=[1] * 4))
    nodes += [
        helper.make_node("Concat", [f"f{i}" for i in range(parts)], ["cat"], name="cat", axis=1),
        helper.make_node("Conv", ["cat", "wd", "bd"], ["d"], name="dw", group=total, pads=[3] * 4),
        helper.make_node("Transpose", ["d"], ["t"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["t", "g", "b"], ["y"], name="ln", axis=-1, epsilon=1e-6),
        helper.make_node(
            "Concat", [f"f{i}" for i in reversed(range(parts))], ["other"], name="other", axis=1
        ),
    ]
    outputs = {"y": [n, size, size, total], "other": [n, total, size, size]}
    return make_model(nodes, {"x": [n, c, size, size]}, outputs, inits)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("parts", [2, 3])
def test_a_depthwise_conv_in_the_layernorm_kernel_reads_its_concat_in_parts(
    precision: str, parts: int
) -> None:
    """The Concat of earlier features before the depthwise conv is no copy: the row kernel loads
    each channel of each tap from the Concat input that holds it, every output element against
    onnxruntime; without `concat_select` the Concat runs as its own copy."""
    n, c, size = 2, 6, 5
    m = dense_depthwise_norm(n, c, size, parts)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, precision)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert g["rule"] == "row_reduction+depthwise_reduction+concat_select" and g["nodes"] == [
        "cat",
        "dw",
        "ln",
    ]
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "rowwise"]
    assert "the depthwise conv's input read from its parts" in k.source
    off = check_against_ort(m, {"x": [n, c, size, size]}, precision, fusion_disable=("concat_select",))
    assert off.report["kernels"]["after"] == cm.report["kernels"]["after"] + 1
    assert [s.op_type for s in off.plan.steps if s.kind == "op" and s.launches].count("Concat") == 2


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_depthwise_conv_in_the_pooling_kernel_reads_its_concat_in_parts(precision: str) -> None:
    """The strided row kernel (a global pool over the depthwise conv's pixels, channels across
    the tile) loads each channel of the Concat before the conv from its part as well."""
    n, c, size = 2, 6, 7
    inits: dict[str, Any] = {
        "w0": RNG.standard_normal((5, c, 3, 3)) * 0.3,
        "w1": RNG.standard_normal((11, c, 1, 1)) * 0.3,
        "wd": RNG.standard_normal((16, 1, 3, 3)) * 0.3,
        "bd": RNG.standard_normal(16) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["f0"], name="conv0", pads=[1] * 4),
        helper.make_node("Conv", ["x", "w1"], ["f1"], name="conv1"),
        helper.make_node("Concat", ["f0", "f1"], ["cat"], name="cat", axis=1),
        helper.make_node("Conv", ["cat", "wd", "bd"], ["d"], name="dw", group=16, pads=[1] * 4),
        helper.make_node("HardSwish", ["d"], ["a"], name="act"),
        helper.make_node("GlobalAveragePool", ["a"], ["y"], name="squeeze"),
        helper.make_node("Concat", ["f1", "f0"], ["other"], name="other", axis=1),
    ]
    outputs = {"y": [n, 16, 1, 1], "other": [n, 16, size, size]}
    m = make_model(nodes, {"x": [n, c, size, size]}, outputs, inits)
    cm = check_against_ort(m, {"x": [n, c, size, size]}, precision)
    (g,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert g["rule"] == "row_reduction+depthwise_reduction+concat_select" and g["nodes"][:2] == ["cat", "dw"]
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "rowwise"]
    assert "BLOCK_I" in k.config and "the depthwise conv's input read from its parts" in k.source


# (input spatial size, first conv's kernel, strides, dilations, pads, second conv's kernel and
# pads, output spatial size): every axis with its own stride, dilation and asymmetric padding.
CHANNELS_FIRST = {
    3: (
        [5, 6, 7],
        [3, 3, 3],
        [1, 2, 1],
        [1, 1, 2],
        [1, 1, 0, 1, 0, 1],
        [3, 1, 3],
        [1, 0, 1, 1, 0, 1],
        [5, 3, 4],
    ),
    1: ([11], [3], [2], [2], [3, 1], [3], [1, 1], [6]),
}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("axes", [3, 1])
def test_channels_first_convs_of_one_to_three_axes_run_as_the_template_with_their_epilogue(
    precision: str, axes: int
) -> None:
    """A 3-D conv (video: R3D, MC3, R(2+1)D) and a 1-D conv left channels-first run as the
    channels-first template with the bias, the ReLU and the residual Add in its epilogue: two
    kernels for the two convs, where the library's conv ran and its epilogue was a kernel of its
    own."""
    size, k1, strides, dilations, pads, k2, pads2, out = CHANNELS_FIRST[axes]
    nodes = [
        helper.make_node(
            "Conv", ["x", "w1", "b1"], ["c1"], strides=strides, dilations=dilations, pads=pads, name="conv1"
        ),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=pads2, name="conv2"),
        helper.make_node("Add", ["c2", "r1"], ["s"], name="residual"),
        helper.make_node("Relu", ["s"], ["y"], name="relu2"),
    ]
    inits = {
        "w1": RNG.standard_normal((8, 3, *k1)) * 0.3,
        "b1": RNG.standard_normal(8) * 0.1,
        "w2": RNG.standard_normal((8, 8, *k2)) * 0.2,
        "b2": RNG.standard_normal(8) * 0.1,
    }
    shape = [2, 3, *size]
    model = make_model(nodes, {"x": shape}, {"y": [2, 8, *out]}, inits)
    cm = check_against_ort(model, {"x": shape}, precision, fusion_disable=("channels_last",), tune_budget_s=0)
    assert cm.report["kernels"] == {"before": 5, "after": 2}, cm.report["fusion"]
    groups = cm.report["fusion"]["groups"]
    assert [g["nodes"] for g in groups if g["kind"] == "conv"] == [
        ["conv1", "relu1"],
        ["conv2", "residual", "relu2"],
    ], groups
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.launches]
    sources = [k.source for k in cm.plan.kernels.values() if k.kind == "conv"]
    assert all(("od = " in src) == (axes == 3) for src in sources)
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    (ref,) = ort_run(model, feeds)
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


def test_a_3d_conv_kernel_is_right_at_every_tuning_candidate() -> None:
    """The 3-D conv of the test above with its ReLU, launched at every launch config tuning may
    pick (its M, N and K no multiple of any tile), against torch's conv3d."""
    import torch

    size, k1, strides, dilations, pads, *_ = CHANNELS_FIRST[3]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=strides, dilations=dilations, pads=pads),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    w, b = RNG.standard_normal((10, 3, *k1)) * 0.3, RNG.standard_normal(10) * 0.1
    model = make_model(nodes, {"x": [2, 3, *size]}, {"y": [2, 10, 5, 3, 4]}, {"w": w, "b": b})
    cm = check_against_ort(model, {"x": [2, 3, *size]}, fusion_disable=("channels_last",), tune_budget_s=0)
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, *size, generator=gen)
    wt, bt = torch.from_numpy(w).float(), torch.from_numpy(b).float()
    # The ONNX pads [D, H, W begin, D, H, W end], applied as F.pad's (last axis first).
    padded = torch.nn.functional.pad(x, [pads[2], pads[5], pads[1], pads[4], pads[0], pads[3]])
    want = torch.relu(torch.nn.functional.conv3d(padded, wt, bt, stride=strides, dilation=dilations))
    dev = torch.device(TEST_DEVICE)
    launch_at_every_config(k, [x.to(dev), wt.to(dev), bt.to(dev)], [want], "fp32")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_gemv_shaped_3d_conv_splits_its_k_loop_and_is_right_at_every_split(precision: str) -> None:
    """A video network's last-stage (1, 3, 3) conv at batch 1: 4 output pixels, K = 512 x 9. Its
    one output tile starts split among 16 programs (start_split: short of an SM each, 288 of K
    each; untuned, one program would stream all of K), tries split-K up to 16 programs (tiles of
    16 rows: the pixels are 4), and at every candidate, the start included, and at a split of 3
    (uneven), every output element matches torch's conv3d; each tile's counter is back at 0 after
    every launch."""
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.candidates import split_k_candidates

    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[0, 1, 1, 0, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    w, b = RNG.standard_normal((24, 512, 1, 3, 3)) * 0.05, RNG.standard_normal(24) * 0.1
    shape = [1, 512, 1, 2, 2]
    model = make_model(nodes, {"x": shape}, {"y": [1, 24, 1, 2, 2]}, {"w": w, "b": b})
    cm = check_against_ort(model, {"x": shape}, precision, fusion_disable=("channels_last",), tune_budget_s=0)
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    assert (
        k.config["SPLIT_K"] == 16 and "range(tl.program_id(2) * BLOCK_K, 4608, SPLIT_K * BLOCK_K)" in k.source
    )
    assert "INTERPRETER_CONFIG = {" in k.source and "'SPLIT_K': 1}" in k.source  # the CPU's one pass
    splits = split_k_candidates(k)
    assert {c["SPLIT_K"] for c in splits} == {2, 4, 8, 16} and {c["BLOCK_M"] for c in splits} == {16}
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(*shape, generator=gen)
    wt, bt = torch.from_numpy(w).float(), torch.from_numpy(b).float()
    want = torch.relu(torch.nn.functional.conv3d(x, wt, bt, padding=(0, 1, 1)))
    dev, dtype = torch.device(TEST_DEVICE), torch.float32 if precision == "fp32" else torch.float16
    args = [x.to(dev, dtype), wt.to(dev, dtype), bt.to(dev, dtype)]
    odd = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3}
    launch_at_every_config(k, args, [want], precision, extra=[odd])
    module = load_kernel_module(k.source, interpret=TEST_DEVICE == "cpu")
    for config in [*splits, odd]:
        scratch: dict[Any, Any] = {}
        out = torch.empty(want.shape, device=dev, dtype=dtype)
        module.launch(*args, out, config={**k.config, **config}, scratch=scratch)
        (_, lock) = next(iter(scratch.values()))
        assert int(lock.abs().sum()) == 0, config


def dual_path(side_is_view: bool = False) -> Any:
    """DPN's block end: a conv's output channels cut into the residual part (12) and the dense
    part (8), here two convs of x that merge_sibling_convs makes one conv and a Split; the residual
    part added to the running residual r (a 1x1 conv of y and its Relu), the
    dense part through a Sigmoid; 1x1 convs after each (channels-last throughout), the residual
    sum read twice. With `side_is_view`, r is a Slice of the Relu's channels: a strided view
    the kernel would be handed as a copy, so the Add stays apart."""
    nodes = [
        helper.make_node("Conv", ["x", "wa", "ba"], ["p0"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "wb", "bb"], ["p1"], name="conv_b", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["y", "wr"], ["yc"], name="conv_r"),
        helper.make_node("Relu", ["yc"], ["r" if not side_is_view else "rc"], name="relu_r"),
        helper.make_node("Add", ["p0", "r"], ["a0"], name="resid"),
        helper.make_node("Sigmoid", ["p1"], ["a1"], name="dense"),
        helper.make_node("Conv", ["a0", "w0"], ["out0"], name="next0"),
        helper.make_node("Conv", ["a1", "w1"], ["out1"], name="next1"),
        helper.make_node("Tanh", ["a0"], ["t0"], name="tanh"),
        helper.make_node("Conv", ["t0", "w2"], ["out2"], name="next2"),
    ]
    if side_is_view:
        nodes.insert(4, helper.make_node("Slice", ["rc", "s", "e", "ax"], ["r"], name="slice_r"))

    def w(*shape: int) -> np.ndarray:
        return (RNG.standard_normal(shape) * 0.3).astype(np.float32)

    inits = {
        "wa": w(12, 8, 3, 3), "ba": w(12), "wb": w(8, 8, 3, 3), "bb": w(8),
        "wr": w(16 if side_is_view else 12, 4, 1, 1), "w0": w(4, 12, 1, 1), "w1": w(4, 8, 1, 1),
        "w2": w(4, 12, 1, 1), "s": np.array([2]), "e": np.array([14]), "ax": np.array([1]),
    }  # fmt: skip
    outputs = {"out0": [2, 4, 6, 6], "out1": [2, 4, 6, 6], "out2": [2, 4, 6, 6]}
    return tiny_model(nodes, {"x": [2, 8, 6, 6], "y": [2, 4, 6, 6]}, outputs, inits)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_split_parts_chain_adds_a_residual_in_the_conv_kernel(precision: str) -> None:
    """The Add of the residual part and r is the conv's epilogue: r is loaded at the part's own
    elements (its columns less the part's first), and every element matches onnxruntime."""
    model = dual_path()
    shapes = {"x": [2, 8, 6, 6], "y": [2, 4, 6, 6]}
    cm = opfuse.compile(
        model, shapes, precision=precision, device=TEST_DEVICE, tune_budget_s=0, fusion_disable=NHWC_ALWAYS
    )
    assert cm.report["verification"]["passed"] is True
    groups = {_anchor(g): g["nodes"] for g in cm.report["fusion"]["groups"]}
    assert {"resid", "dense"} <= set(groups["conv+conv_b"]), groups
    assert "Add" not in [s.op_type for s in cm.plan.steps if s.launches]
    feeds = {k: RNG.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    outs, refs = cm.run(feeds), ort_run(model, feeds)
    tol = 1e-4 if precision == "fp32" else 2e-2
    for name, ref in zip(("out0", "out1", "out2"), refs, strict=True):
        np.testing.assert_allclose(outs[name], ref, rtol=tol, atol=tol)


def test_a_residual_that_is_a_strided_view_stays_out_of_the_split_parts_chain() -> None:
    model = dual_path(side_is_view=True)
    cm = check_against_ort(
        model, {"x": [2, 8, 6, 6], "y": [2, 4, 6, 6]}, fusion_disable=NHWC_ALWAYS, tune_budget_s=0
    )
    groups = {_anchor(g): g["nodes"] for g in cm.report["fusion"]["groups"]}
    assert "dense" in groups["conv+conv_b"] and "resid" not in groups["conv+conv_b"], groups
    assert "Add" in [s.op_type for s in cm.plan.steps if s.launches]


def test_a_constant_residual_on_the_second_part_is_loaded_at_that_parts_elements() -> None:
    """The side input of the second part (columns 12..19 of the merged conv) is a constant of the
    part's shape: loaded at the part's own elements like a computed one, not at the tile's
    columns (which verification then caught, and rolled the group back)."""

    def w(*shape: int) -> np.ndarray:
        return (RNG.standard_normal(shape) * 0.3).astype(np.float32)

    nodes = [
        helper.make_node("Conv", ["x", "wa", "ba"], ["p0"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "wb", "bb"], ["p1"], name="conv_b", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["p0"], ["a0"], name="dense"),
        helper.make_node("Add", ["p1", "r"], ["a1"], name="resid"),
        helper.make_node("Conv", ["a0", "w0"], ["out0"], name="next0"),
        helper.make_node("Conv", ["a1", "w1"], ["out1"], name="next1"),
        helper.make_node("Tanh", ["a1"], ["t1"], name="tanh"),
        helper.make_node("Conv", ["t1", "w2"], ["out2"], name="next2"),
    ]
    inits = {
        "wa": w(12, 8, 3, 3), "ba": w(12), "wb": w(8, 8, 3, 3), "bb": w(8), "r": w(2, 8, 6, 6),
        "w0": w(4, 12, 1, 1), "w1": w(4, 8, 1, 1), "w2": w(4, 8, 1, 1),
    }  # fmt: skip
    outputs = {"out0": [2, 4, 6, 6], "out1": [2, 4, 6, 6], "out2": [2, 4, 6, 6]}
    model = tiny_model(nodes, {"x": [2, 8, 6, 6]}, outputs, inits)
    cm = opfuse.compile(
        model, {"x": [2, 8, 6, 6]}, device=TEST_DEVICE, tune_budget_s=0, fusion_disable=NHWC_ALWAYS
    )
    assert cm.report["verification"]["passed"] is True
    assert cm.report["verification"]["rolled_back"] == []
    groups = {_anchor(g): g["nodes"] for g in cm.report["fusion"]["groups"]}
    assert {"resid", "dense"} <= set(groups["conv+conv_b"]), groups
    feeds = {"x": RNG.standard_normal((2, 8, 6, 6)).astype(np.float32)}
    outs, refs = cm.run(feeds), ort_run(model, feeds)
    for name, ref in zip(outputs, refs, strict=True):
        np.testing.assert_allclose(outs[name], ref, rtol=1e-4, atol=1e-4)


def scales_block(width: int):  # type: ignore[no-untyped-def]
    """Res2Net's scales: a 1x1 conv, its output split in three along the channels (NCHW, between
    the channels-last region's Transposes), the second part's 3x3 conv, the third part added to
    that conv's output before its own 3x3 conv, the first part passed through; concatenated."""
    c = 3 * width
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="reduce"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Split", ["r", "parts"], ["p0", "p1", "p2"], name="split", axis=1),
        helper.make_node("Conv", ["p1", "wa"], ["c0"], name="scale0", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c0", "p2"], ["s1"], name="running_sum"),
        helper.make_node("Conv", ["s1", "wb"], ["c1"], name="scale1", pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["c0", "c1", "p0"], ["y"], name="cat", axis=1),
    ]
    inits = {
        "w0": RNG.standard_normal((c, 8, 1, 1)) * 0.4,
        "wa": RNG.standard_normal((width, width, 3, 3)) * 0.2,
        "wb": RNG.standard_normal((width, width, 3, 3)) * 0.2,
    }
    m = make_model(nodes, {"x": [2, 8, 6, 5]}, {"y": [2, c, 6, 5]}, inits)
    m.graph.initializer.append(numpy_helper.from_array(np.array([width] * 3, dtype=np.int64), "parts"))
    return m


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("width", [8, 16])  # the flat K loop (under 16 channels), the window loop
def test_a_channel_split_is_read_in_place_by_the_convs_and_the_epilogue(width: int, precision: str) -> None:
    """Each part of the Split is a window of the 1x1 conv's NHWC output: the 3x3 conv reading
    one part, and its epilogue adding another, load them in place (each pixel
    at the buffer's 3 * width channels, from the part's first channel), where the runtime would
    first copy each strided view into a buffer of its own."""
    cm = check_against_ort(scales_block(width), {"x": [2, 8, 6, 5]}, precision, fusion_disable=NHWC_ALWAYS)
    (first,) = [k for k in cm.plan.kernels.values() if "x read in place" in k.source]
    reduce_out = {o for s in cm.plan.steps if s.kind == "kernel" and "reduce" in s.label for o in s.outputs}
    # The 3x3 conv's x (the second part) and its epilogue's third part: the 1x1 conv's buffer
    # itself, each pixel at its 3 * width channels, from channels `width` and 2 * `width`.
    assert first.inputs[0] in reduce_out and first.inputs[2] in reduce_out
    assert f"x += {width}" in first.source and f"iw) * {3 * width}" in first.source
    assert f"ow[:, None] * {3 * width} + cols + {2 * width}, mask=mask" in first.source
    assert not [s for s in cm.plan.steps if s.op_type in ("Split", "Transpose") and s.inputs[0] in reduce_out]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_depthwise_conv_reads_its_channel_window_in_place(precision: str) -> None:
    """FocalNet's focal level: a 1x1 conv's output split along the channels, one part through a
    depthwise 3x3 conv and a Relu, gating another part. The depthwise template loads its part
    from the 1x1 conv's NHWC buffer at that buffer's channel stride."""
    width = 16
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], name="project"),
        helper.make_node("Split", ["a", "parts"], ["q", "ctx", "gate"], name="split", axis=1),
        helper.make_node("Conv", ["ctx", "wd"], ["d"], name="focal", pads=[1, 1, 1, 1], group=width),
        helper.make_node("Relu", ["d"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "gate"], ["g"], name="gated"),
        helper.make_node("Add", ["g", "q"], ["y"], name="modulate"),
    ]
    inits = {
        "w0": RNG.standard_normal((3 * width, 8, 1, 1)) * 0.4,
        "wd": RNG.standard_normal((width, 1, 3, 3)) * 0.3,
    }
    m = make_model(nodes, {"x": [2, 8, 5, 6]}, {"y": [2, width, 5, 6]}, inits)
    m.graph.initializer.append(numpy_helper.from_array(np.array([width] * 3, dtype=np.int64), "parts"))
    cm = check_against_ort(m, {"x": [2, 8, 5, 6]}, precision, fusion_disable=NHWC_ALWAYS)
    (k,) = [k for k in cm.plan.kernels.values() if "x read in place" in k.source]
    assert "depthwise conv kernel" in k.source and f"x += {width}" in k.source
    assert f"iw) * {3 * width}" in k.source
    assert cm.plan.kernels[k.id].inputs[0] in {
        o for s in cm.plan.steps if "project" in s.label for o in s.outputs
    }


def _anchor(group: dict[str, Any]) -> str:
    """A report group's anchor: its first node after the region's Transpose it reads through."""
    return next(x for x in group["nodes"] if not x.startswith("Transpose#"))
