"""Models as real exporters write them: small torch.nn models defined here (random weights), exported
with torch.onnx, compiled by opfuse on the CPU and compared with onnxruntime on the same inputs.

fp32 must match to a relative L2 error of 1e-4, fp16 to 2e-2. The families are those of issue 3:
ResNet-style CNNs, MobileNet v3 blocks, ConvNeXt, ShuffleNet/DenseNet wiring, a segmentation decoder,
a BERT/ViT encoder block, a GPT-2 block and a LLaMA-style decoder block written by hand; then
torchvision's and transformers' own models (both pinned in the dev extra that `make test` installs).
"""

from __future__ import annotations

import importlib.util
import io
import math
import warnings
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opfuse
from tests.builders import TEST_DEVICE

torch.manual_seed(0)


def export(
    model: nn.Module,
    args: tuple[torch.Tensor, ...],
    names: list[str],
    dynamo: bool = False,
    dynamic: dict[str, dict[int, str]] | None = None,
    keep_batchnorm: bool = False,
) -> onnx.ModelProto:
    """torch.onnx.export at opset 18: the TorchScript exporter, or the torch.export-based one.
    `keep_batchnorm`: BatchNormalization stays a node of its own (the TorchScript exporter folds it
    into the convolution before; ONNX Model Zoo models and other exporters keep it)."""
    model.eval()
    f = io.BytesIO()
    kwargs: dict[str, object] = {"dynamo": dynamo, "opset_version": 18, "input_names": names}
    if keep_batchnorm:
        kwargs.update(training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)
    if dynamic and dynamo:
        dims = {d: torch.export.Dim(d) for axes in dynamic.values() for d in axes.values()}
        kwargs["dynamic_shapes"] = {k: {i: dims[d] for i, d in axes.items()} for k, axes in dynamic.items()}
    elif dynamic:
        kwargs["dynamic_axes"] = dynamic
    if dynamo:
        kwargs["verbose"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, f, output_names=["y"], **kwargs)  # type: ignore[arg-type]
    return onnx.load_from_string(f.getvalue())


def check(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    precision: str = "fp32",
    disable: tuple[str, ...] = (),
) -> opfuse.CompiledModel:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    shapes = {k: list(v.shape) for k, v in feeds.items()}
    cm = opfuse.compile(
        model,
        input_shapes=shapes,
        precision=precision,
        device=TEST_DEVICE,
        verify=False,
        fusion_disable=disable,
    )
    ids = [g["id"] for g in cm.report["fusion"]["groups"]]
    assert len(ids) == len(set(ids)), f"group ids are not unique: {sorted(ids)}"
    got = cm.run(feeds)
    limit = 1e-4 if precision == "fp32" else 2e-2
    for vi, w in zip(model.graph.output, want, strict=True):
        g = np.asarray(got[vi.name], dtype=np.float64)
        err = np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-12)
        assert g.shape == w.shape and err <= limit, f"{vi.name}: relative L2 error {err:.2e} > {limit}"
    return cm


def image(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# --- CNNs -------------------------------------------------------------------------------------------


class ResNetish(nn.Module):
    """Stem conv/BN/ReLU/MaxPool, a basic residual block, a downsampling block, global pool, FC."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8))  # fmt: skip
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.BatchNorm2d(16))
        self.skip = nn.Conv2d(8, 16, 1, 2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = F.relu(x + self.block(x))
        x = F.relu(self.down(x) + self.skip(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MobileNetV3ish(nn.Module):
    """Inverted residual with depthwise conv, HardSwish, a squeeze-excite with HardSigmoid, ReLU6."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(8, 24, 1), nn.BatchNorm2d(24), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(24, 24, 3, 1, 1, groups=24), nn.BatchNorm2d(24), nn.ReLU6())
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(24, 6, 1), nn.ReLU(), nn.Conv2d(6, 24, 1), nn.Hardsigmoid()
        )
        self.project = nn.Sequential(nn.Conv2d(24, 8, 1), nn.BatchNorm2d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dw(self.expand(x))
        return x + self.project(h * self.se(h))


class EfficientNetish(nn.Module):
    """MBConv: SiLU everywhere, squeeze-excite with sigmoid gating."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 5, 1, 2, groups=8)
        self.bn = nn.BatchNorm2d(8)
        self.se1, self.se2 = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.bn(self.dw(x)))
        s = torch.sigmoid(self.se2(F.silu(self.se1(h.mean((2, 3), keepdim=True)))))
        return x + h * s


class ConvNeXtish(nn.Module):
    """Depthwise 7x7, LayerNorm over channels-last (permute), pointwise MLP with GELU, layer scale."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.norm = nn.LayerNorm(8, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.gamma = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.gamma * self.fc2(F.gelu(self.fc1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


class ShuffleDense(nn.Module):
    """ShuffleNet's channel split and shuffle (Reshape/Transpose), DenseNet's concatenation,
    SqueezeNet's fire module, AlexNet's LRN and an average pool."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
        self.dense = nn.Conv2d(8, 4, 3, padding=1)
        self.squeeze = nn.Conv2d(12, 4, 1)
        self.e1, self.e3 = nn.Conv2d(4, 6, 1), nn.Conv2d(4, 6, 3, padding=1)
        self.lrn = nn.LocalResponseNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=1)
        x = torch.cat([a, self.branch(b)], 1)
        n, c, h, w = x.shape
        x = x.reshape(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        x = torch.cat([x, F.relu(self.dense(x))], 1)
        s = F.relu(self.squeeze(x))
        x = torch.cat([F.relu(self.e1(s)), F.relu(self.e3(s))], 1)
        return F.avg_pool2d(self.lrn(x), 2)


class SegDecoder(nn.Module):
    """U-Net-style decoder: ConvTranspose, bilinear and nearest upsampling, reflect padding,
    InstanceNorm and GroupNorm, a skip concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 8, 3, 2, 1)
        self.up = nn.ConvTranspose2d(8, 8, 2, 2)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.gnorm = nn.GroupNorm(4, 16)
        self.head = nn.Conv2d(16, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = F.relu(self.enc(x))
        u = self.inorm(self.up(e))
        b = F.interpolate(e, scale_factor=2.0, mode="bilinear", align_corners=False)
        h = self.gnorm(torch.cat([u, b], 1))
        h = F.pad(F.relu(h), (1, 1, 1, 1), mode="reflect")
        y = self.head(h)
        return F.interpolate(y, size=(20, 24), mode="nearest") + F.interpolate(y, scale_factor=2.5, mode="bilinear", align_corners=True)[..., :20, :24]  # fmt: skip


CNNS = {
    "resnet": (ResNetish, (1, 3, 32, 32)),
    "mobilenet_v3": (MobileNetV3ish, (2, 8, 10, 10)),
    "efficientnet": (EfficientNetish, (2, 8, 9, 9)),
    "convnext": (ConvNeXtish, (1, 8, 12, 12)),
    "shuffle_dense_squeeze": (ShuffleDense, (1, 8, 8, 8)),
    "segmentation": (SegDecoder, (1, 3, 20, 24)),
}


@pytest.mark.parametrize("name", list(CNNS))
def test_cnn_export(name: str) -> None:
    cls, shape = CNNS[name]
    torch.manual_seed(1)
    model = cls()
    for m in model.modules():  # trained-looking BatchNorm statistics, not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    onnx_model = export(model, (torch.from_numpy(image(*shape)),), ["x"])
    cm = check(onnx_model, {"x": image(*shape)})
    if TEST_DEVICE == "cpu":
        # At most 40% as many launches as compute nodes, the plan as the interpreter runs it
        # (channels-last; on the GPU in fp32 a dense CNN stays NCHW, fp32_dense_nchw). ShuffleDense:
        # the written-out LocalResponseNorm is one LRN kernel reading the conv's concatenated NHWC
        # output. ResNetish: the stem pool runs on the first block's conv tiles (pool_prologue).
        assert cm.report["kernels"]["after"] <= 0.4 * cm.report["compute_nodes"], cm.report["kernels"]
    if name == "segmentation":
        # The head's two Resizes (one through a Slice) are gathered by the Add's kernel
        # (`resize_gather`); the GroupNorm's row kernel loads its rows through the skip Concat
        # (`concat_select`), the Resize before it gathered there, so neither runs as its own op.
        # The head conv reads through the reflection Pad (`pad_prologue`).
        launched = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
        assert "Resize" not in launched and "Concat" not in launched
        (g,) = [g for g in cm.report["fusion"]["groups"] if g["rule"] == "pointwise+resize_gather"]
        assert g["nodes"] == ["/Add"] and g["resize_gathered"] == ["/Resize_1", "/Resize_2"]
        (g,) = [g for g in cm.report["fusion"]["groups"] if "concat_select" in g["rule"]]
        assert g["rule"] == "row_reduction+concat_select+resize_gather"
        assert g["nodes"] == ["/Concat", "/gnorm/InstanceNormalization", "/Relu_1"]
        assert g["resize_gathered"] == ["/Resize"]
        if TEST_DEVICE == "cpu":  # on the GPU the fp32 dense convs stay NCHW (fp32_dense_nchw)
            assert cm.report["kernels"] == {"before": 15, "after": 6}


def test_cnn_fp16() -> None:
    torch.manual_seed(2)
    model = export(MobileNetV3ish(), (torch.from_numpy(image(2, 8, 10, 10)),), ["x"])
    check(model, {"x": image(2, 8, 10, 10)}, precision="fp16")


def channel_shuffle(x: torch.Tensor, groups: int = 2) -> torch.Tensor:
    n, c, h, w = x.shape
    return x.reshape(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)


class ShuffleUnits(nn.Module):
    """ShuffleNetV2: a stride-2 unit (two branches), two stride-1 units (channel split, branch,
    concat, shuffle), then a 1x1 conv and global pooling."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()

        def bn_relu(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout), nn.ReLU())

        def dw(ch: int, stride: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(ch, ch, 3, stride, 1, groups=ch), nn.BatchNorm2d(ch))

        self.down1 = nn.Sequential(dw(c, 2), bn_relu(c, c))
        self.down2 = nn.Sequential(bn_relu(c, c), dw(c, 2), bn_relu(c, c))
        self.units = nn.ModuleList(nn.Sequential(bn_relu(c, c), dw(c, 1), bn_relu(c, c)) for _ in range(2))
        self.head = bn_relu(2 * c, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = channel_shuffle(torch.cat([self.down1(x), self.down2(x)], 1))
        for unit in self.units:
            a, b = x.chunk(2, dim=1)
            x = channel_shuffle(torch.cat([a, unit(b)], 1))
        return self.head(x).mean((2, 3))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_channel_shuffles_fold_into_the_convolutions_and_concats_around_them(precision: str) -> None:
    """No shuffled tensor is ever copied: each shuffle's permutation moves into the weights of the
    convolutions that read it, and through the Concats, where the channel split is a view."""
    from bench.kernels import view_copies

    torch.manual_seed(3)
    model = ShuffleUnits()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    x = image(2, 8, 12, 12)
    cm = check(export(model, (torch.from_numpy(x),), ["x"]), {"x": x}, precision)
    assert cm.report["fusion"]["passes"]["fired"]["fold_channel_shuffle"] == 3
    launched = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert "Gather" not in launched and "Concat" not in launched, launched
    # Each Concat is written by the last conv of its unit (`concat_epilogue`): its own channels in
    # place, the channels passed through (a view of the unit's input) copied by the same kernel.
    concats = [g for g in cm.report["fusion"]["groups"] if g["rule"].endswith("+concat_epilogue")]
    assert len(concats) == 3
    # The only copies left are of the graph input's layout change, one per kernel reading it (the
    # stride-2 unit's two branches); the unfused plan (NCHW) copies each shuffle.
    assert view_copies(cm.plan) == 2 and view_copies(cm.base_plan) == 3
    # 12 convolutions, 4 of them depthwise inside the 1x1 conv after each; the head's conv, its
    # Relu and the mean in one row kernel (gemm_reduction).
    assert cm.report["kernels"]["after"] == 8
    cm = check(export(model, (torch.from_numpy(x),), ["x"]), {"x": x}, precision, ("concat_epilogue",))
    assert cm.report["kernels"]["after"] == 8 + 3  # the Concats as copies


def test_a_shuffled_graph_output_is_still_the_shuffled_tensor() -> None:
    class Shuffle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 6, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return channel_shuffle(torch.relu(self.conv(x)), 3)

    x = image(1, 4, 5, 5)
    cm = check(export(Shuffle(), (torch.from_numpy(x),), ["x"]), {"x": x})
    assert cm.report["fusion"]["passes"]["fired"]["fold_channel_shuffle"] == 1


# --- transformers -----------------------------------------------------------------------------------


class EncoderBlock(nn.Module):
    """BERT/ViT block: nn.MultiheadAttention with a key padding mask, LayerNorm, GELU MLP."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT2Block(nn.Module):
    """Token and position embeddings (Gather, arange), a causal mask (tril, masked_fill), fused QKV
    projection split three ways, tanh-GELU, and a tied LM head."""

    def __init__(self, vocab: int = 50, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(32, d)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).unsqueeze(0)
        x = self.wte(ids) + self.wpe(pos)
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        hd = x.shape[-1] // self.heads
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=ids.device))
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        x = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return self.lnf(x) @ self.wte.weight.t()


class LlamaBlock(nn.Module):
    """A LLaMA-style decoder block written by hand: RMSNorm, rotary embeddings by slicing, negation
    and concatenation, grouped-query attention with a causal mask built by triu/where, SiLU gate."""

    def __init__(self, d: int = 16, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate, self.up, self.down = nn.Linear(d, 32, bias=False), nn.Linear(d, 32, bias=False), nn.Linear(32, d, bias=False)  # fmt: skip
        self.w1, self.w2 = nn.Parameter(torch.ones(d) * 1.1), nn.Parameter(torch.ones(d) * 0.9)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(64).float(), inv)
        emb = torch.cat([freqs, freqs], -1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())

    @staticmethod
    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.rms(x, self.w1)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = self.cos[:t], self.sin[:t]
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        future = torch.triu(torch.ones(t, t, device=x.device), diagonal=1) == 1
        scores = torch.where(future, torch.full_like(scores, -1e9), scores)
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        h = self.rms(x, self.w2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def test_bert_vit_encoder_block_with_dynamic_batch_and_sequence() -> None:
    torch.manual_seed(3)
    x, mask = torch.randn(2, 6, 16), torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    # The torch.export-based exporter: the TorchScript one bakes nn.MultiheadAttention's traced
    # shapes into Reshape constants, so its "dynamic" model only runs at the traced shape.
    dynamic = {"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}
    model = export(EncoderBlock(), (x, mask), ["x", "mask"], dynamo=True, dynamic=dynamic)
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim][:2] == ["batch", "seq"]
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 5, 16)).astype(np.float32)}
    feeds["mask"] = np.array([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    check(model, feeds)


def test_gpt2_block() -> None:
    torch.manual_seed(4)
    ids = torch.randint(0, 50, (2, 7))
    model = export(GPT2Block(), (ids,), ["ids"])
    check(model, {"ids": ids.numpy()})


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_llama_block(dynamo: bool) -> None:
    torch.manual_seed(5)
    x = torch.randn(2, 6, 16)
    model = export(LlamaBlock(), (x,), ["x"], dynamo=dynamo)
    check(model, {"x": x.numpy()})


def test_llama_block_fp16() -> None:
    torch.manual_seed(5)
    x = torch.randn(2, 6, 16)
    cm = check(export(LlamaBlock(), (x,), ["x"]), {"x": x.numpy()}, precision="fp16")
    # The merged projections' Split outputs (q, k, v; gate, up) are read in place by the kernels
    # that take them: a Split output handed to a kernel would be a strided view, copied first.
    split_outputs = {o for s in cm.plan.steps if s.kind == "op" and s.op_type == "Split" for o in s.outputs}
    assert split_outputs  # q/kv and gate/up are merged projections here
    for k in cm.plan.kernels.values():
        assert not set(k.inputs) & split_outputs, (k.id, k.kind, k.inputs)


def test_llama_block_without_layout_views() -> None:
    # The same block with layout folding off: the per-op path on its own.
    torch.manual_seed(5)
    x = torch.randn(2, 6, 16)
    check(export(LlamaBlock(), (x,), ["x"]), {"x": x.numpy()}, disable=("layout_views",))


def test_t5_style_encoder_with_relative_bias() -> None:
    """T5's encoder: RMSNorm without mean, attention with an additive position bias (Gather from a
    bucket table), no scaling, ReLU MLP."""

    class T5ish(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.o = nn.Linear(16, 48, bias=False), nn.Linear(16, 16, bias=False)
            self.bias = nn.Embedding(8, 2)
            self.w = nn.Parameter(torch.ones(16))
            self.ff = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            h = self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            q, k, v = self.qkv(h).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
            rel = torch.arange(t)[None, :] - torch.arange(t)[:, None]
            buckets = torch.clamp(rel + 4, 0, 7)
            scores = q @ k.transpose(-1, -2) + self.bias(buckets).permute(2, 0, 1)
            x = x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.ff(x)

    x = torch.randn(2, 5, 16)
    check(export(T5ish(), (x,), ["x"]), {"x": x.numpy()})


# --- zoo models, when the packages are installed ----------------------------------------------------


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "squeezenet1_0", "shufflenet_v2_x0_5"])
def test_torchvision_models(name: str) -> None:
    """Each verifies, and launches at most 40% as many kernels as it has compute nodes, as the
    exporter writes it (BatchNormalization folded into the convolutions). Channels-last on every
    device (in fp32 on the GPU a dense CNN would stay NCHW: fp32_dense_nchw), so the count is the
    same everywhere."""
    models = torchvision_models()
    torch.manual_seed(6)
    model = getattr(models, name)(weights=None, num_classes=10)
    x = image(1, 3, 64, 64)
    cm = check(export(model, (torch.from_numpy(x),), ["x"]), {"x": x}, disable=("fp32_dense_nchw",))
    kernels, compute = cm.report["kernels"]["after"], cm.report["compute_nodes"]
    assert kernels <= 0.4 * compute, (kernels, compute)


def torchvision_models() -> Any:
    """torchvision.models, also where its C++ ops cannot load (a CUDA build of torchvision beside
    the CPU torch of CI): the models use none of them."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed")
    from bench.zoo import import_torchvision

    import_torchvision()
    import torchvision.models

    return torchvision.models


def test_resnet_with_batchnorm_nodes_launches_under_two_fifths_of_its_compute_nodes() -> None:
    """ResNet-18 as the ONNX Model Zoo ships ResNets: Conv, BatchNormalization, Relu and Add as
    separate nodes. opfuse folds each BatchNormalization into its convolution and the Relu and the
    residual Add into the convolution's epilogue: at most 40% as many launches as compute nodes (the
    same network exported with BN already folded: test_torchvision_models)."""
    models = torchvision_models()
    torch.manual_seed(8)
    model = models.resnet18(weights=None, num_classes=10)
    x = image(1, 3, 64, 64)
    onnx_model = export(model, (torch.from_numpy(x),), ["x"], keep_batchnorm=True)
    assert sum(n.op_type == "BatchNormalization" for n in onnx_model.graph.node) == 20
    cm = check(onnx_model, {"x": x})
    kernels, compute = cm.report["kernels"]["after"], cm.report["compute_nodes"]
    assert compute == 68 and kernels <= 0.4 * compute, (kernels, compute)


@pytest.mark.parametrize("family", ["bert", "gpt2", "vit", "t5", "llama"])
def test_transformers_models(family: str) -> None:
    if importlib.util.find_spec("torchvision") is not None:
        # transformers imports torchvision where it is installed: get through a build whose C++
        # ops cannot load (as test_torchvision_models does), whichever test runs first.
        from bench.zoo import import_torchvision

        import_torchvision()
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    ids = torch.randint(0, 100, (1, 8))
    small = {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64}
    if family == "bert":
        model = transformers.BertModel(transformers.BertConfig(vocab_size=100, **small))
    elif family == "gpt2":
        model = transformers.GPT2Model(
            transformers.GPT2Config(vocab_size=100, n_embd=32, n_head=2, n_layer=2)
        )
    elif family == "vit":
        cfg = transformers.ViTConfig(image_size=32, patch_size=8, **small)
        model = transformers.ViTModel(cfg)
        x = image(1, 3, 32, 32)
        cm = check(export(_first_output(model), (torch.from_numpy(x),), ["x"]), {"x": x})
        assert cm.report["kernels"]["after"] <= 0.4 * cm.report["compute_nodes"]
        return
    elif family == "t5":
        cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
        model = transformers.T5EncoderModel(cfg)
    else:
        # num_key_value_heads = heads: the TorchScript exporter cannot convert SDPA with enable_gqa
        # (grouped-query attention is covered by the hand-written LLaMA block above).
        cfg = transformers.LlamaConfig(vocab_size=100, num_key_value_heads=2, **small)
        model = transformers.LlamaModel(cfg)
    cm = check(export(_first_output(model), (ids,), ["ids"]), {"ids": ids.numpy()})
    # At most 40% as many launches as compute nodes (the fusion compiler's bar for encoders).
    assert cm.report["kernels"]["after"] <= 0.4 * cm.report["compute_nodes"]


def _first_output(model: nn.Module) -> nn.Module:
    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)[0]

    return First()


class GroupNormSiLU(nn.Module):
    """A diffusion-UNet block's normalization: nn.GroupNorm (exported written out) then SiLU."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, 16)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(x))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_written_out_group_norm_is_one_row_kernel(precision: str) -> None:
    torch.manual_seed(3)
    shape = (2, 16, 6, 5)
    model = export(GroupNormSiLU(), (torch.from_numpy(image(*shape)),), ["x"])
    assert "InstanceNormalization" in {n.op_type for n in model.graph.node}
    cm = check(model, {"x": image(*shape) * 3 + 1}, precision=precision)
    assert cm.report["fusion"]["passes"]["fired"].get("group_norm") == 1
    assert cm.report["kernels"]["after"] == 1
    (g,) = cm.report["fusion"]["groups"]
    assert g["kind"] == "rowwise"


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_rotary_rotate_half_becomes_one_gemm_with_the_rotation_in_its_epilogue(dynamo: bool) -> None:
    torch.manual_seed(5)
    x = torch.randn(2, 6, 16)
    model = export(LlamaBlock(), (x,), ["x"], dynamo=dynamo)
    cm = check(model, {"x": x.numpy()})
    assert cm.report["fusion"]["passes"]["fired"].get("rotate_half") == 2  # q and k
    # No Neg, no Concat, and x * cos computed inside the rotation's GEMM epilogue: no Mul alone.
    assert not any(s.op_type in ("Neg", "Concat", "Mul") for s in cm.plan.steps)
    off = check(model, {"x": x.numpy()}, disable=("rotate_half",))
    # Without the rule each of q and k is rotated by the Neg's kernel and one kernel that selects
    # the Concat with `* sin + x * cos` after it (concat_select); with it, by the GEMM's epilogue.
    assert cm.report["kernels"]["after"] == off.report["kernels"]["after"] - 2
    assert any("concat_select" in g["rule"] for g in off.report["fusion"]["groups"])


class WindowsThenMBConv(nn.Module):
    """MaxViT's seam: window-attention tokens [B * windows, 16, C] reversed into an image, then
    the MBConv's pre-norm (BatchNorm) and its first 1x1 conv, the image also the shortcut."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.mix = nn.Linear(c, c)
        self.norm = nn.BatchNorm2d(c)
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, ws, c, h = 1, 4, tokens.shape[-1], 8
        t = self.mix(tokens)  # [4, 16, C]: 2 x 2 windows of 4 x 4 tokens
        img = t.view(b, h // ws, h // ws, ws, ws, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, h)
        return self.conv(self.norm(img)) + img


@pytest.mark.parametrize("dynamo", [True, False])
def test_a_norm_between_reversed_windows_and_a_conv_writes_the_convs_layout(dynamo: bool) -> None:
    """The BatchNorm runs in NHWC, its kernel reading the windows in place and writing what the
    conv reads: no copy of the norm's output is left for the runtime to make (before, the norm
    wrote NCHW and the runtime copied it into NHWC for the conv: 3 copies a run). The two left
    are the shortcut's: the window reverse's Reshape of a permuted value, and the conv epilogue's
    read of it through the Transpose into NHWC."""
    from bench.kernels import view_copies

    torch.manual_seed(4)
    model = WindowsThenMBConv()
    model.norm.running_mean.uniform_(-0.5, 0.5)
    model.norm.running_var.uniform_(0.5, 2.0)
    model.norm.weight.data.uniform_(0.5, 1.5)
    tokens = image(4, 16, 8)
    cm = check(export(model, (torch.from_numpy(tokens),), ["tokens"], dynamo=dynamo), {"tokens": tokens})
    norm = next(s for s in cm.plan.steps if s.kind == "kernel" and "norm" in s.label.lower())
    assert cm.plan.values[norm.outputs[0]].shape == (1, 8, 8, 8)  # NHWC: the conv's input
    conv = next(s for s in cm.plan.steps if s.kind == "kernel" and cm.plan.kernels[s.kernel].kind == "conv")
    assert norm.outputs[0] in cm.plan.kernels[conv.kernel].inputs
    assert view_copies(cm.plan) == 2
