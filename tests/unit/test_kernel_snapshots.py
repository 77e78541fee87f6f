"""The generated kernel sources of a fixed set of models, every template kind among them, are
byte-identical to the recorded ones: a refactor of the compiler must not change what it generates.

A change that means to change kernels rewrites the record and says so in its commit:

    OPFUSE_UPDATE_SNAPSHOTS=1 TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/unit/test_kernel_snapshots.py

The record holds each kernel's sha256; `OPFUSE_SNAPSHOT_DIR=DIR` writes the sources themselves, so
that two commits' kernels can be compared with `diff -r`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch

from bench.kernels import plan_model
from tests.builders import conv_bn_relu, depthwise_conv_relu, excitation_block, residual_mlp
from tests.unit.test_exports import CNNS, GPT2Block, LlamaBlock, export

RECORD = Path(__file__).parent / "snapshots" / "kernel_sources.json"


def _cnn(name: str) -> Callable[[], tuple[onnx.ModelProto, dict[str, list[int]]]]:
    def build() -> tuple[onnx.ModelProto, dict[str, list[int]]]:
        torch.manual_seed(0)
        cls, shape = CNNS[name]
        return export(cls(), (torch.randn(*shape),), ["x"]), {}

    return build


def _gpt2() -> tuple[onnx.ModelProto, dict[str, list[int]]]:
    torch.manual_seed(4)
    return export(GPT2Block(), (torch.randint(0, 50, (2, 7)),), ["ids"]), {}


def _llama(dynamo: bool) -> Callable[[], tuple[onnx.ModelProto, dict[str, list[int]]]]:
    def build() -> tuple[onnx.ModelProto, dict[str, list[int]]]:
        torch.manual_seed(5)
        return export(LlamaBlock(), (torch.randn(2, 6, 16),), ["x"], dynamo=dynamo), {}

    return build


class _ScalesHead(torch.nn.Module):
    """Res2Net's scales (a channel Split's parts read in place by the 3x3 conv and its epilogue),
    then a bicubic upsampling that is the model's output (a gather kernel of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce = torch.nn.Conv2d(8, 48, 1)
        self.scale0 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.scale1 = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p0, p1, p2 = torch.relu(self.reduce(x)).split(16, dim=1)
        c0 = self.scale0(p1)
        c1 = self.scale1(c0 + p2)
        y = torch.cat([c0, c1, p0], dim=1)
        return torch.nn.functional.interpolate(y, scale_factor=2.0, mode="bicubic", align_corners=False)


def _scales_head() -> tuple[onnx.ModelProto, dict[str, list[int]]]:
    torch.manual_seed(6)
    return export(_ScalesHead(), (torch.randn(2, 8, 6, 5),), ["x"]), {}


# name -> (builder, precision, disabled rules): every kernel family (pointwise, row reductions,
# GEMM and conv templates with their epilogues, pooling, resize, attention, concat selection).
MODELS: dict[str, tuple[Callable[[], tuple[onnx.ModelProto, dict[str, list[int]]]], str, tuple[str, ...]]] = {
    "residual_mlp": (lambda: (residual_mlp(), {"x": [4, 32]}), "fp32", ()),
    "residual_mlp_fp16": (lambda: (residual_mlp(), {"x": [4, 32]}), "fp16", ()),
    "depthwise_conv_relu": (lambda: (depthwise_conv_relu(8), {"x": [2, 8, 10, 10]}), "fp32", ()),
    "conv_bn_relu": (lambda: (conv_bn_relu(), {"x": [2, 4, 8, 8]}), "fp32", ()),
    # The channels-first conv template (channels-last off).
    "conv_bn_relu_nchw": (lambda: (conv_bn_relu(), {"x": [2, 4, 8, 8]}), "fp32", ("channels_last",)),
    **{f"cnn_{name}": (_cnn(name), "fp32", ()) for name in CNNS},
    "cnn_resnet_no_split_k": (_cnn("resnet"), "fp32", ("split_k",)),
    # Squeeze-excitation's pool on the tiles of its MLP: a GEMV chain, and one GEMV (the GEMM's).
    "se_pooled_chain": (lambda: (excitation_block(2, "two"), {"x": [2, 24, 5, 5]}), "fp32", ()),
    "ese_pooled_gemv": (lambda: (excitation_block(1, "one"), {"x": [1, 24, 5, 5]}), "fp32", ()),
    "gpt2_block": (_gpt2, "fp32", ()),
    "llama_block": (_llama(False), "fp32", ()),
    "llama_block_dynamo_fp16": (_llama(True), "fp16", ()),
    "scales_bicubic_head": (_scales_head, "fp32", ("fp32_dense_nchw",)),
}


def kernel_sources(name: str) -> dict[str, str]:
    build, precision, disabled = MODELS[name]
    model, shapes = build()
    planned = plan_model(model, shapes or None, precision, disabled)
    return {k.id: k.source for k in planned.plan.kernels.values()}


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


@pytest.fixture(scope="module")
def record() -> dict[str, dict[str, str]]:
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {}


@pytest.mark.parametrize("name", list(MODELS))
def test_kernel_sources_are_unchanged(name: str, record: dict[str, dict[str, str]]) -> None:
    sources = kernel_sources(name)
    assert sources, f"{name} generates no kernel: the snapshot would guard nothing"
    dump = os.environ.get("OPFUSE_SNAPSHOT_DIR")
    if dump:
        folder = Path(dump) / name
        folder.mkdir(parents=True, exist_ok=True)
        for kid, source in sources.items():
            (folder / f"{kid}.py").write_text(source)
    digests = {kid: _digest(source) for kid, source in sorted(sources.items())}
    if os.environ.get("OPFUSE_UPDATE_SNAPSHOTS") == "1":
        current = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
        current[name] = digests
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(dict(sorted(current.items())), indent=1) + "\n")
        return
    assert name in record, (
        f"no record for {name}: run with OPFUSE_UPDATE_SNAPSHOTS=1 (see the module docstring)"
    )
    changed = sorted(k for k in set(digests) | set(record[name]) if digests.get(k) != record[name].get(k))
    assert not changed, (
        f"{name}: the sources of kernels {changed} differ from the record; compare them with "
        "OPFUSE_SNAPSHOT_DIR (module docstring), and rewrite the record only if the change is meant"
    )
