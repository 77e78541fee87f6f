"""Models as `torch.onnx.export` writes them with its defaults (the dynamo exporter: opset 20,
external data beside the model, Reshape for flatten, Gelu-20, ReduceMean with an axes input), and
with the TorchScript exporter (dynamo=False) where its spelling differs: each compiles, matches
onnxruntime on every output element, fuses like the older spelling, and its bundle's model.onnx
passes onnx.checker."""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opfuse
from bench.corpus.run import ANCHOR_OPS
from opfuse.runtime.bundle import default_domain_opset
from tests.builders import TEST_DEVICE


def export(
    model: nn.Module, args: tuple[torch.Tensor, ...], path: Path, dynamo: bool = True, **kwargs: Any
) -> onnx.ModelProto:
    """torch.onnx.export with its defaults (dynamo=True: external data in `path.data`), loaded the
    way a user loads it: onnx.load(path) reads the data file beside it."""
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, args, str(path), verbose=False, **kwargs)
        else:
            torch.onnx.export(model, args, str(path), dynamo=False, **kwargs)
    return onnx.load(str(path))


def check(
    model: onnx.ModelProto, args: tuple[torch.Tensor, ...], tmp_path: Path, **kwargs: Any
) -> opfuse.CompiledModel:
    """Compile, compare every output element with onnxruntime, and check the saved bundle's
    fused graph with onnx.checker (full_check: shape inference as well)."""
    feeds = {vi.name: a.numpy() for vi, a in zip(model.graph.input, args, strict=True)}
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    cm = opfuse.compile(model, device=TEST_DEVICE, verify=False, **kwargs)
    got = cm.run(feeds)
    for vi, w in zip(model.graph.output, want, strict=True):
        np.testing.assert_allclose(np.asarray(got[vi.name]), w, rtol=1e-4, atol=1e-5, err_msg=vi.name)
    bundle = tmp_path / "bundle.zip"
    cm.save(bundle)
    fused = onnx.load_from_string(zipfile.ZipFile(bundle).read("model.onnx"))
    onnx.checker.check_model(fused, full_check=True)
    return cm


def ops(cm: opfuse.CompiledModel, tmp_path: Path) -> tuple[int, list[str]]:
    """The saved fused graph's default-domain opset and its nodes' op types."""
    fused = onnx.load_from_string(zipfile.ZipFile(tmp_path / "bundle.zip").read("model.onnx"))
    opset = next(o.version for o in fused.opset_import if o.domain in ("", "ai.onnx"))
    return opset, [n.op_type for n in fused.graph.node]


def rules(cm: opfuse.CompiledModel) -> list[str]:
    return [g["rule"] for g in cm.report["fusion"]["groups"]]


class SmallCNN(nn.Module):
    """The simplest classifier: Conv -> Relu -> AdaptiveAvgPool2d(1) -> flatten -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1), 1))


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_cnn_classifier_of_the_default_exporter_compiles_and_matches(batch: int, tmp_path: Path) -> None:
    """The default exporter writes the flatten as a Reshape with a shape operand and the pool as
    ReduceMean with an axes input: neither is taken for data by the pooled GEMM (it crashed the
    compiler); at batch up to 4 the pool runs in the GEMM's A tiles (pooled_gemm)."""
    torch.manual_seed(batch)
    x = torch.randn(batch, 3, 8, 8)
    path = tmp_path / "cnn.onnx"
    model = export(SmallCNN(), (x,), path)
    assert os.path.exists(f"{path}.data")  # the default: weights beside the model
    assert "ReduceMean" in [n.op_type for n in model.graph.node]
    cm = check(model, (x,), tmp_path)
    pooled = batch <= 4  # conv + ReLU, then pool + GEMM; over 4 images the pool is its own kernel
    assert cm.report["kernels"]["after"] == (2 if pooled else 3), cm.report["fusion"]
    assert any(r.endswith("pooled_gemm") for r in rules(cm)) == pooled


def test_cnn_classifier_of_the_torchscript_exporter(tmp_path: Path) -> None:
    torch.manual_seed(3)
    x = torch.randn(2, 3, 8, 8)
    model = export(SmallCNN(), (x,), tmp_path / "cnn.onnx", dynamo=False)
    cm = check(model, (x,), tmp_path)
    assert cm.report["kernels"]["after"] == 2, cm.report["fusion"]


@pytest.mark.parametrize("dynamo", [True, False])
def test_resnet18_of_both_exporters(dynamo: bool, tmp_path: Path) -> None:
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed")
    from bench.zoo import import_torchvision

    import_torchvision()
    import torchvision.models

    torch.manual_seed(6)
    net = torchvision.models.resnet18(weights=None, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    model = export(net, (x,), tmp_path / "resnet18.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path)
    kernels, compute = cm.report["kernels"]["after"], cm.report["compute_nodes"]
    # What the planner fused is held here; a step the runtime runs as several launches (a shortcut
    # conv left to the library: three, Step.launches) is counted as one.
    library = sum(s.launches - 1 for s in cm.plan.steps if s.kind == "op" and s.launches > 1)
    if TEST_DEVICE == "cpu":
        assert kernels - library <= 0.4 * compute, (kernels, library, compute)
    else:  # fp32 on the GPU keeps dense convolutions NCHW, in the library (passes/layout.py's
        # FP32_DENSE_RULE), and pools as their own kernels: the corpus's bound, anchors + 10%.
        anchors = sum(1 for op in cm.report["profile"]["ops"] if op.get("op_type") in ANCHOR_OPS)
        assert kernels - library <= anchors + 0.1 * compute, (kernels, library, anchors, compute)


class GeluMLP(nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(F.gelu(self.fc1(x), approximate=self.approximate)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dynamo", [True, False])
def test_gelu_fuses_into_the_gemm_epilogue_in_every_spelling(
    approximate: str, dynamo: bool, tmp_path: Path
) -> None:
    """Gelu-20 (the default exporter) and Gelu written out with Erf or Tanh (TorchScript, opset 18):
    the same two kernels (fc1 + bias + GELU; fc2 on the tiles of bias + residual + LayerNorm)."""
    torch.manual_seed(1)
    x = torch.randn(2, 5, 16) * 2.0
    # TorchScript at its own default opset (20) writes Gelu too; at 18 it writes it out.
    kwargs: dict[str, Any] = {} if dynamo else {"opset_version": 18}
    model = export(GeluMLP(approximate), (x,), tmp_path / "mlp.onnx", dynamo=dynamo, **kwargs)
    assert ("Gelu" in [n.op_type for n in model.graph.node]) == dynamo
    cm = check(model, (x,), tmp_path)
    assert cm.report["kernels"]["after"] == 2, cm.report["fusion"]
    gemm_groups = [g for g in cm.report["fusion"]["groups"] if g["rule"] == "gemm_epilogue"]
    assert any(len(g["nodes"]) >= 3 for g in gemm_groups), gemm_groups  # MatMul, bias, GELU
    assert "Gelu" not in ops(cm, tmp_path)[1]


def test_an_unfused_gelu_20_gives_a_bundle_of_opset_20(tmp_path: Path) -> None:
    """With its fusion rules off Gelu runs as its own op: the fused graph imports opset 20, where
    Gelu exists (it declared opset 18 and onnx.checker refused it)."""
    torch.manual_seed(2)
    x = torch.randn(2, 5, 16)
    model = export(GeluMLP("none"), (x,), tmp_path / "mlp.onnx", opset_version=18)
    assert next(o.version for o in model.opset_import if o.domain == "") == 18
    assert "Gelu" not in [n.op_type for n in model.graph.node]  # below 20 it is written out
    model = export(GeluMLP("none"), (x,), tmp_path / "mlp.onnx")
    cm = check(model, (x,), tmp_path, fusion_disable=("gemm_epilogue", "pointwise"))
    opset, op_types = ops(cm, tmp_path)
    assert "Gelu" in op_types and opset == 20


def test_bundle_opset_is_the_lowest_that_holds_every_op() -> None:
    assert default_domain_opset({"MatMul", "Relu"}) == 18
    assert default_domain_opset({"MatMul"}, source_opset=13) == 18  # converted up to 18
    assert default_domain_opset({"MatMul"}, source_opset=21) == 21  # kept at its own opset
    assert default_domain_opset({"Gelu", "MatMul"}) == 20
    assert default_domain_opset({"RMSNormalization"}, source_opset=20) == 23


class RMSNormLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.RMSNorm(16, eps=1e-6), nn.Linear(16, 16)
        nn.init.normal_(self.norm.weight, 1.0, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class LayerNormLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)
        nn.init.normal_(self.norm.weight, 1.0, 0.2)
        nn.init.normal_(self.norm.bias, 0.0, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class SDPA(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


@pytest.mark.parametrize("opset", [None, 23])
def test_layer_norm_as_exported_is_one_row_kernel(opset: int | None, tmp_path: Path) -> None:
    torch.manual_seed(4)
    x = torch.randn(2, 5, 16)
    kwargs: dict[str, Any] = {} if opset is None else {"opset_version": opset}
    model = export(LayerNormLinear(), (x,), tmp_path / "ln.onnx", **kwargs)
    assert "LayerNormalization" in [n.op_type for n in model.graph.node]
    cm = check(model, (x,), tmp_path)
    assert "row_reduction" in rules(cm) and cm.report["kernels"]["after"] == 2


@pytest.mark.parametrize("opset", [None, 23])
def test_rms_norm_as_exported(opset: int | None, tmp_path: Path) -> None:
    """The default opset (20) writes RMSNorm out (one row kernel); opset 23 writes
    RMSNormalization-23, which fuses the same way."""
    torch.manual_seed(5)
    x = torch.randn(2, 5, 16)
    kwargs: dict[str, Any] = {} if opset is None else {"opset_version": opset}
    model = export(RMSNormLinear(), (x,), tmp_path / "rms.onnx", **kwargs)
    assert ("RMSNormalization" in [n.op_type for n in model.graph.node]) == (opset == 23)
    cm = check(model, (x,), tmp_path)
    assert "row_reduction" in rules(cm) and cm.report["kernels"]["after"] == 2, cm.report["fusion"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("opset", [None, 23])
def test_scaled_dot_product_attention_as_exported(causal: bool, opset: int | None, tmp_path: Path) -> None:
    """The default opset writes SDPA out as MatMul/Softmax/MatMul (one attention kernel); opset 23
    writes Attention-23, which fuses the same way."""
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    kwargs: dict[str, Any] = {} if opset is None else {"opset_version": opset}
    model = export(SDPA(causal), (q, k, v), tmp_path / "sdpa.onnx", **kwargs)
    assert ("Attention" in [n.op_type for n in model.graph.node]) == (opset == 23)
    cm = check(model, (q, k, v), tmp_path)
    assert rules(cm) == ["attention"] and cm.report["kernels"]["after"] == 1, cm.report["fusion"]


class CosineScores(nn.Module):
    """Cosine attention scores (Swin V2, XCiT): F.normalize of q and k over `dim`, then q @ kᵀ."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, k = F.normalize(q, dim=self.dim), F.normalize(k, dim=self.dim)
        return q @ k.transpose(-2, -1) * 3.0


@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("dim", [-1, -2])
def test_l2_normalize_is_one_row_kernel(dynamo: bool, dim: int, tmp_path: Path) -> None:
    """F.normalize exports as ReduceL2, a Clip at eps (an Expand too) and a Div: one row kernel
    per normalized tensor, along the last axis or across rows, not three library ops."""
    torch.manual_seed(6)
    q, k = torch.randn(2, 3, 7, 24), torch.randn(2, 3, 7, 24)
    model = export(CosineScores(dim), (q, k), tmp_path / "cos.onnx", dynamo=dynamo)
    assert "ReduceL2" in [n.op_type for n in model.graph.node]
    cm = check(model, (q, k), tmp_path)
    groups = [g for g in cm.report["fusion"]["groups"] if g["rule"].startswith("row_reduction")]
    assert len(groups) == 2 and all(any("ReduceL2" in n or "norm" in n for n in g["nodes"]) for g in groups)
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type in ("ReduceL2", "Clip", "Div")]


class InterleavedRotary(nn.Module):
    """GPT-J / CodeGen / EVA-02 rotary embeddings: pairs (2i, 2i + 1) rotated, rotate_every_two
    written as stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2)."""

    def __init__(self, t: int, d: int) -> None:
        super().__init__()
        angles = torch.outer(torch.arange(t).float(), 1.0 / (100 ** (torch.arange(0, d, 2).float() / d)))
        self.register_buffer("cos", angles.cos().repeat_interleave(2, -1))
        self.register_buffer("sin", angles.sin().repeat_interleave(2, -1))

    @staticmethod
    def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q = q * self.cos + self.rotate_every_two(q) * self.sin
        k = k * self.cos + self.rotate_every_two(k) * self.sin
        return q @ k.transpose(-2, -1)


@pytest.mark.parametrize("dynamo", [True, False])
def test_interleaved_rotary_is_a_signed_permutation_gemm(dynamo: bool, tmp_path: Path) -> None:
    """Each rotate_every_two (two strided Slices, a Neg, two Unsqueezes, a Concat, a Reshape: six
    copies and kernels) becomes x @ R, whose epilogue takes the rest of the rotation: no Neg,
    Slice or Concat is left to run."""
    torch.manual_seed(7)
    q, k = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 16)
    model = export(InterleavedRotary(7, 16), (q, k), tmp_path / "rot.onnx", dynamo=dynamo)
    assert "Neg" in [n.op_type for n in model.graph.node]
    cm = check(model, (q, k), tmp_path)
    assert cm.report["fusion"]["passes"]["fired"]["rotate_half"] == 2
    left = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert not {"Neg", "Slice", "Concat", "Unsqueeze"} & set(left), left


class HeadScaledAttention(nn.Module):
    """Swin V2's cosine attention (normalized q and k, scores times exp(logit_scale) per head, a
    position bias) or, `bias` False, XCiT's (scores times a temperature per head)."""

    def __init__(self, heads: int, n: int, bias: bool) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(heads, 1, 1) + 1))
        self.bias = nn.Parameter(torch.randn(heads, n, n)) if bias else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * self.logit_scale.exp()
        if self.bias is not None:
            scores = scores + self.bias
        return scores.softmax(-1) @ v


@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_a_per_head_score_scale_moves_onto_the_query_and_attention_fuses(
    dynamo: bool, bias: bool, tmp_path: Path
) -> None:
    """The scale is constant [H, 1, 1]: it moves onto q (head_scale), where the normalize row
    kernel takes it, and the attention rule makes the rest one kernel: no MatMul runs alone."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(2, 3, 10, 16) for _ in range(3))
    model = export(HeadScaledAttention(3, 10, bias), (q, k, v), tmp_path / "att.onnx", dynamo=dynamo)
    cm = check(model, (q, k, v), tmp_path)
    assert cm.report["fusion"]["passes"]["fired"]["head_scale"] == 1
    assert rules(cm).count("attention") == 1, cm.report["fusion"]
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type == "MatMul"]


class DenseLayers(nn.Module):
    """Three of torchvision's DenseNet layers: cat(features) -> BN -> ReLU -> 1x1 conv -> BN -> ReLU
    -> 3x3 conv, each layer's output appended to the features (BN statistics calibrated). The
    first layer's Concat is of one tensor: the exporters write none."""

    def __init__(self, c: int, growth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(3):
            cin = c + i * growth
            self.layers.append(
                nn.Sequential(
                    nn.BatchNorm2d(cin),
                    nn.ReLU(),
                    nn.Conv2d(cin, width, 1, bias=False),
                    nn.BatchNorm2d(width),
                    nn.ReLU(),
                    nn.Conv2d(width, growth, 3, padding=1, bias=False),
                )
            )
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.data.uniform_(0.5, 1.5)
                m.bias.data.uniform_(-0.2, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


@pytest.mark.parametrize("dynamo", [True, False])
def test_dense_layers_read_the_concat_in_their_1x1_convs(dynamo: bool, tmp_path: Path) -> None:
    """Each layer's BN + ReLU of the Concat is applied on the 1x1 conv's input tiles, read from
    the Concat's inputs in turn (concat_prologue): no Concat runs before the second and third
    layers. The first layer's BN + ReLU of the input, which only its 1x1 conv reads, runs
    channels-last and on that conv's tiles too (operand_prologue): the launches are the six
    convolutions."""
    torch.manual_seed(9)
    x = torch.randn(2, 16, 6, 6)
    model = export(DenseLayers(16, 8, 16), (x,), tmp_path / "dense.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path, fusion_disable=("fp32_dense_nchw",))
    assert sum("concat_prologue" in r for r in rules(cm)) == 2, cm.report["fusion"]
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type == "Concat"]
    assert sum("operand_prologue" in r for r in rules(cm)) == 1, cm.report["fusion"]
    assert cm.report["kernels"]["after"] == 6


class PoolFormerBlocks(nn.Module):
    """Two of PoolFormer's blocks after a conv stem: norm -> pool(x) - x, scaled, residual; norm
    -> 1x1 conv -> GELU -> 1x1 conv, scaled, residual. The norms are GroupNorm with one group:
    timm's v1 (weight and bias) in the first block, v2's (no bias, F.group_norm) in the second."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, 2 * c, 1), nn.GELU(), nn.Conv2d(2 * c, c, 1)) for _ in range(2)
        )
        self.norm_w = nn.Parameter(torch.rand(4, c) + 0.5)
        self.norm_b = nn.Parameter(torch.rand(4, c) - 0.5)
        self.scale = nn.Parameter(torch.rand(4, c, 1, 1) + 0.5)

    def norm(self, x: torch.Tensor, i: int) -> torch.Tensor:
        bias = self.norm_b[i] if i < 2 else None  # the second block's norms have no bias
        return F.group_norm(x, 1, self.norm_w[i], bias, 1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in range(2):
            y = self.norm(x, 2 * b)
            x = x + self.scale[2 * b] * (self.pool(y) - y)
            x = x + self.scale[2 * b + 1] * self.mlps[b](self.norm(x, 2 * b + 1))
        return x


@pytest.mark.parametrize("dynamo", [True, False])
def test_one_group_norms_run_channels_last_with_the_pool(dynamo: bool, tmp_path: Path) -> None:
    """A GroupNorm of one group normalizes each image over all its elements, so in the
    channels-last region it is LayerNormalization over (H, W, C), with the per-channel scale
    read at `cols % C`: the pool runs channels-last, nothing is transposed back to NCHW between
    the stem and the output, and each norm is one row kernel with what comes before it (the
    pool, its Sub, the scale, the residual; or the conv before it). Both exporters: the TorchScript one writes
    Reshape -> InstanceNormalization -> Reshape -> Mul [-> Add], which group_norm makes one
    GroupNormalization first, the bias-less one too (its Add after it is the residual's)."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, 6, 5)
    model = export(PoolFormerBlocks(8), (x,), tmp_path / "poolformer.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path, fusion_disable=("fp32_dense_nchw",))
    steps = [s for s in cm.plan.steps if s.launches]
    assert "AveragePool" not in [s.op_type for s in steps]
    back = [s for s in cm.plan.steps if s.op_type == "Transpose" and s.attrs.get("perm") == [0, 3, 1, 2]]
    assert len(back) <= 1, [s.op_type for s in cm.plan.steps]  # only the output's, if not folded
    norms = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "rowwise"]
    assert len(norms) == 4, cm.report["fusion"]["groups"]
    # Each norm computes on its tiles what comes before it: the stem's conv (gemm_reduction's
    # item form), the pool with its Sub, the scale and the residual Add (depthwise_reduction), or
    # the first MLP's second conv with its scale and residual Add (the item form again).
    rules = sorted(g["rule"] for g in norms)
    assert rules == ["row_reduction+depthwise_reduction"] * 2 + ["row_reduction+gemm_reduction"] * 2, norms
    assert sorted(len(g["nodes"]) for g in norms) == [2, 4, 5, 5], norms
    # Four norms and the MLPs' three other convs (31 launches unfused).
    assert cm.report["kernels"]["after"] == 7
    assert cm.report["verification"]["passed"] is not False
    assert all("LayerNormalization" in k.source for k in cm.plan.kernels.values() if k.kind == "rowwise")


class GridAttention(nn.Module):
    """MaxViT's attention as torchvision writes it: windows [B, G, P, C], heads split out as
    [B, G, H, P, D], scores and output by einsum, a relative position bias [1, 1, H, P, P]."""

    def __init__(self, c: int, heads: int, p: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(c, 3 * c)
        self.bias = nn.Parameter(torch.randn(1, 1, heads, p, p) * 0.5)  # rank 5, broadcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, g, p, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q * d**-0.5
        q, k, v = (t.reshape(b, g, p, self.heads, d).permute(0, 1, 3, 2, 4) for t in (q, k, v))
        scores = torch.einsum("B G H I D, B G H J D -> B G H I J", q, k)
        probs = F.softmax(scores + self.bias, dim=-1)
        out = torch.einsum("B G H I J, B G H J D -> B G H I D", probs, v)
        return out.permute(0, 1, 3, 2, 4).reshape(b, g, p, c)


@pytest.mark.parametrize("dynamo", [True, False])
def test_einsum_attention_of_rank_5_is_one_attention_kernel(dynamo: bool, tmp_path: Path) -> None:
    """The two einsums become MatMuls (einsum_matmul), and the attention over [B, G, H, P, D],
    whose batch and window dims lie as one strided run in every operand, is one flash-attention
    kernel over [B*G, H, P, D] with the bias broadcast along both: the launches are the QKV
    projection and the attention."""
    torch.manual_seed(5)
    x = torch.randn(2, 3, 7, 16)
    model = export(GridAttention(16, 2, 7), (x,), tmp_path / "grid.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path)
    assert "attention" in rules(cm), cm.report["fusion"]
    assert cm.report["kernels"]["after"] == 2, [s.op_type for s in cm.plan.steps if s.launches]


def rel_logits_1d(q: torch.Tensor, rel_k: torch.Tensor, permute_mask: tuple[int, ...]) -> torch.Tensor:
    """timm's relative to absolute position logits (byobnet's BoTNet and HaloNet attention)."""
    b, h, w, _ = q.shape
    x = (q @ rel_k.transpose(-1, -2)).reshape(-1, w, 2 * w - 1)
    x_pad = F.pad(F.pad(x, [0, 1]).flatten(1), [0, w - 1]).reshape(-1, w + 1, 2 * w - 1)
    x = x_pad[:, :w, w - 1 :].reshape(b, h, 1, w, w).expand(-1, -1, h, -1, -1)
    return x.permute(permute_mask)


class RelPosAttention(nn.Module):
    """BoTNet's self-attention over a [B, H*W, D] query/key/value with timm's relative position
    logits for height and width added to the scores."""

    def __init__(self, h: int, w: int, dim: int) -> None:
        super().__init__()
        self.h, self.w = h, w
        self.qkv = nn.Linear(dim, 3 * dim)
        self.rel_h = nn.Parameter(torch.randn(2 * h - 1, dim) * 0.5)
        self.rel_w = nn.Parameter(torch.randn(2 * w - 1, dim) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        grid = q.reshape(b, self.h, self.w, d)
        rel = rel_logits_1d(grid.transpose(1, 2), self.rel_h, (0, 3, 1, 4, 2)) + rel_logits_1d(
            grid, self.rel_w, (0, 1, 3, 2, 4)
        )
        scores = q @ k.transpose(-1, -2) * d**-0.5 + rel.reshape(b, n, n)
        return scores.softmax(-1) @ v


@pytest.mark.parametrize("dynamo", [True, False])
def test_relative_position_shifts_are_gathered_by_the_add(dynamo: bool, tmp_path: Path) -> None:
    """Each shift (pad a column, flatten, pad, reshape, slice, expand, permute) is read by the
    kernel of the Add of the height and width logits through index arithmetic (pad_gather): no
    Pad runs, and the launches are the QKV projection, the two position GEMMs, that Add and the
    attention."""
    torch.manual_seed(6)
    x = torch.randn(2, 20, 8)
    model = export(RelPosAttention(4, 5, 8), (x,), tmp_path / "relpos.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path)
    assert any("pad_gather" in r for r in rules(cm)), cm.report["fusion"]
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type == "Pad"]
    assert cm.report["kernels"]["after"] == 5, [s.op_type or s.kernel for s in cm.plan.steps if s.launches]


class _Recurrent(nn.Module):
    """A bidirectional two-layer LSTM over a projected sequence, a GRU after it, and a
    classifier: the recurrent ops as the exporters write them (LSTM and GRU nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 16)
        self.lstm = nn.LSTM(16, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(16, 8, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(torch.relu(self.proj(x)))
        g, last = self.gru(h)
        return self.head(g[:, -1] + last[0])


@pytest.mark.parametrize("dynamo", [True, False])
def test_recurrent_layers_run_as_library_ops(dynamo: bool, tmp_path: Path) -> None:
    """An LSTM and a GRU (torch.nn, both exporters) compile and match onnxruntime: they run as
    opfuse's per-op kernels (runtime/ops_recurrent.py), the ops around them fused as usual."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 12)
    model = export(_Recurrent(), (x,), tmp_path / "m.onnx", dynamo=dynamo)
    ops = {n.op_type for n in model.graph.node}
    assert {"LSTM", "GRU"} <= ops, ops
    cm = check(model, (x,), tmp_path)
    steps = [s.op_type for s in cm.plan.steps if s.kind == "op"]
    assert "LSTM" in steps and "GRU" in steps


class FourierMixing(nn.Module):
    """FNet's token mixing: the real part of a 2-D FFT over the sequence and hidden axes, between
    a projection and a layer norm (the exporter writes a DFT per axis and a Gather of the real part)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.norm(h + torch.fft.fftn(h, dim=(1, 2)).real)


def test_fourier_mixing_runs_its_dfts_and_matches(tmp_path: Path) -> None:
    """Two DFTs over different axes of a real signal (real and imaginary pairs in between) match
    onnxruntime in every element: the transform reads and writes the pairs in place."""
    torch.manual_seed(0)
    x = torch.randn(2, 12, 16)
    model = export(FourierMixing(), (x,), tmp_path / "m.onnx")
    assert [n.op_type for n in model.graph.node].count("DFT") == 2
    cm = check(model, (x,), tmp_path)
    assert [s.op_type for s in cm.plan.steps if s.kind == "op" and "DFT" in s.op_type] == ["opfuse.DFTN"]


class PartialRotaryAttention(nn.Module):
    """GPT-J's and GPT-NeoX's attention: a rotary embedding on the first `rot` dims of each head,
    the rest passed through, joined by a Concat before Q @ Kᵀ."""

    def __init__(self, dim: int = 32, heads: int = 4, rot: int = 4) -> None:
        super().__init__()
        self.heads, self.rot = heads, rot
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        angle = torch.arange(16)[:, None] * torch.rand(rot // 2)[None, :]
        self.register_buffer("cos", torch.cat([angle.cos(), angle.cos()], -1)[:, None, :])
        self.register_buffer("sin", torch.cat([angle.sin(), angle.sin()], -1)[:, None, :])

    def _rotary(self, t: torch.Tensor) -> torch.Tensor:
        r, p = t[..., : self.rot], t[..., self.rot :]
        half = torch.cat([-r[..., self.rot // 2 :], r[..., : self.rot // 2]], -1)
        s = t.shape[1]
        return torch.cat([r * self.cos[:s] + half * self.sin[:s], p], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        split = lambda t: t.view(b, s, self.heads, dim // self.heads)  # noqa: E731
        q = self._rotary(split(self.q(x))).transpose(1, 2)
        k = self._rotary(split(self.k(x))).transpose(1, 2)
        v = split(self.v(x)).transpose(1, 2)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads), -1) @ v
        return self.o(a.transpose(1, 2).reshape(b, s, dim))


@pytest.mark.parametrize("dynamo", [True, False])
def test_partial_rotary_attention_reads_the_concats_inputs(dynamo: bool, tmp_path: Path) -> None:
    """Q and K are the Concats of their rotated and passed-through parts: the attention kernel
    reads each part where its producer wrote it, and no kernel copies the Concat; every output
    element matches onnxruntime."""
    torch.manual_seed(0)
    x = torch.randn(2, 12, 32)
    model = export(PartialRotaryAttention(), (x,), tmp_path / "m.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path)
    (att,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "attention"]
    assert sum(1 for n in att["nodes"] if "cat" in n.lower() or "concat" in n.lower()) >= 2, att["nodes"]
    assert not [g for g in cm.report["fusion"]["groups"] if "concat_select" in g["rule"]]


class ConvFrontEndAndTokenConvs(nn.Module):
    """wav2vec2's feature extractor (strided 1-D convs over raw audio, each with its GELU) and
    SqueezeBERT's block (tokens transposed into grouped and 3-tap 1-D convs, the residual added
    on [N, C, L], transposed back to tokens for the LayerNorm)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.extract = nn.Sequential(
            nn.Conv1d(1, c, 10, stride=5), nn.GELU(), nn.Conv1d(c, c, 3, stride=2, bias=False), nn.GELU()
        )
        self.mix = nn.Conv1d(c, 2 * c, 1, groups=2)
        self.out = nn.Conv1d(2 * c, c, 3, padding=2, dilation=2)
        self.norm = nn.LayerNorm(c)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        tokens = self.extract(audio).transpose(1, 2)
        x = tokens.transpose(1, 2)
        x = x + self.out(F.gelu(self.mix(x)))
        return self.norm(x.transpose(1, 2))


@pytest.mark.parametrize("dynamo", [True, False])
def test_1d_convolutions_run_as_the_conv_template_with_their_epilogues(dynamo: bool, tmp_path: Path) -> None:
    """Every 1-D conv runs as the conv template over one image row, channels-last, its GELU
    (and the last one's residual Add) in its epilogue: no library Conv, no Gelu of its own, and
    the model's transposes between tokens and [N, C, L] are views."""
    torch.manual_seed(6)
    audio = torch.randn(2, 1, 203)
    model = export(ConvFrontEndAndTokenConvs(8), (audio,), tmp_path / "audio.onnx", dynamo=dynamo)
    cm = check(model, (audio,), tmp_path, fusion_disable=("fp32_dense_nchw",))
    steps = [s for s in cm.plan.steps if s.launches]
    assert not [s for s in steps if s.kind == "op"], [(s.op_type, s.label) for s in steps]
    convs = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "conv"]
    assert len(convs) == 4, cm.report["fusion"]["groups"]
    assert all(len(g["nodes"]) >= 2 for g in convs), convs  # each with its GELU or residual
    assert cm.report["kernels"]["after"] == 5, [s.label for s in steps]  # four convs, the LayerNorm


class MixConv(nn.Module):
    """MixNet's MixConv as timm writes it: torch.split of the channels, a depthwise conv of its
    own kernel size on each part, torch.cat, then the activation."""

    def __init__(self, splits: list[int], kernels: list[int]) -> None:
        super().__init__()
        self.splits = splits
        self.convs = nn.ModuleList(
            nn.Conv2d(c, c, k, padding=k // 2, groups=c) for c, k in zip(splits, kernels, strict=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.splits, 1)
        return F.relu(torch.cat([conv(p) for conv, p in zip(self.convs, parts, strict=True)], 1))


@pytest.mark.parametrize("dynamo", [True, False])
def test_mixconv_is_one_depthwise_conv_kernel(dynamo: bool, tmp_path: Path) -> None:
    """The Split, the three depthwise convs (3x3, 5x5, 7x7), the Concat and the ReLU: one kernel,
    each channel's kernel in one 7x7 window."""
    torch.manual_seed(3)
    x = torch.randn(2, 16, 9, 8)
    model = export(MixConv([4, 4, 8], [3, 5, 7]), (x,), tmp_path / "mixconv.onnx", dynamo=dynamo)
    cm = check(model, (x,), tmp_path, fusion_disable=("fp32_dense_nchw",))
    assert cm.report["fusion"]["passes"]["fired"].get("merge_concat_convs") == 1
    assert cm.report["kernels"]["after"] == 1, [s.label for s in cm.plan.steps if s.launches]


def test_1d_convolutions_in_fp16_verify_and_match(tmp_path: Path) -> None:
    """The same model in fp16: the 1-D convs' template kernels pass verification, and every
    output element is within fp16's tolerance of onnxruntime's fp32 result."""
    torch.manual_seed(7)
    audio = torch.randn(2, 1, 203)
    model = export(ConvFrontEndAndTokenConvs(8), (audio,), tmp_path / "audio.onnx")
    cm = opfuse.compile(model, device=TEST_DEVICE, precision="fp16", fusion_disable=("fp32_dense_nchw",))
    assert cm.report["verification"]["passed"] is True, cm.report["verification"]
    assert len([g for g in cm.report["fusion"]["groups"] if g["kind"] == "conv"]) == 4
    feeds = {model.graph.input[0].name: torch.randn(2, 1, 203).numpy()}
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, feeds)
    got = np.asarray(cm.run(feeds)[model.graph.output[0].name])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max()))


class AdaptivePoolHead(nn.Module):
    """VGG's and AlexNet's head on a small image: conv features pooled to a fixed grid larger than
    (or not dividing) the feature map, then a classifier."""

    def __init__(self, grid: tuple[int, int]) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(grid)
        self.fc = nn.Linear(8 * grid[0] * grid[1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(F.relu(self.conv(x))), 1))


@pytest.mark.parametrize(("size", "grid"), [((2, 2), (7, 7)), ((5, 7), (3, 4)), ((6, 5), (4, 3))])
def test_adaptive_pooling_gathers_its_windows_in_the_masking_kernel(
    size: tuple[int, int], grid: tuple[int, int], tmp_path: Path
) -> None:
    """The dynamo exporter writes an adaptive average pool whose windows differ in length as
    GatherND of each window's pixels, masks, a sum of the window's picks and a Div: the GatherND
    becomes a Gather (gathernd_as_gather) the masking kernel computes by its loads (pad_gather),
    so no Gather runs. Every output element matches onnxruntime."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, *size)
    model = export(AdaptivePoolHead(grid), (x,), tmp_path / "pool.onnx")
    assert "GatherND" in {n.op_type for n in model.graph.node}
    cm = check(model, (x,), tmp_path)
    assert not [s for s in cm.plan.steps if s.kind == "op" and s.op_type in ("Gather", "GatherND")]
    assert any("pad_gather" in r for r in rules(cm)), cm.report["fusion"]
