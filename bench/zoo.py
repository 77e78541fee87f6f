"""The benchmark zoo: torchvision and transformers models with random weights, exported to ONNX."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ZooModel:
    name: str
    module: torch.nn.Module
    example: dict[str, torch.Tensor]  # input name -> example tensor (batch filled in)
    kind: str  # "cnn" | "transformer"


def _randomize_zero_init(module: torch.nn.Module) -> torch.nn.Module:
    """Random weights where the library initializes to zero (ViT's head, some classifiers): a
    model whose output is identically zero makes verification say nothing."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2 and float(p.abs().max()) == 0.0:
                p.copy_(torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)
    return module


def _calibrate_batchnorm(module: torch.nn.Module, size: int) -> torch.nn.Module:
    """BatchNorm statistics measured on random images, as training would leave them. With the
    default statistics (mean 0, variance 1) activations of an untrained deep CNN shrink layer by
    layer (MobileNetV3-L's logits are ~1e-10, zero in fp16) and the comparison says nothing."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return module
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the calibration batches
    module.train()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(2):
            module(torch.randn(8, 3, size, size, generator=gen))
    return module


def _vision(name: str, ctor: Callable[[], torch.nn.Module], batch: int, size: int = 224) -> ZooModel:
    module = _calibrate_batchnorm(_randomize_zero_init(ctor()), size)
    return ZooModel(name, module.eval(), {"x": torch.randn(batch, 3, size, size)}, "cnn")


def _hf(name: str, batch: int, seq: int) -> ZooModel:
    import transformers as tf

    cfg: Any  # the family's config class
    if name == "bert-base":
        cfg = tf.BertConfig()
        model: torch.nn.Module = tf.BertModel(cfg)
    elif name == "gpt2":
        cfg = tf.GPT2Config()
        model = tf.GPT2Model(cfg)
    elif name == "llama-small":
        cfg = tf.LlamaConfig(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=32000,
        )
        model = tf.LlamaModel(cfg)
    else:
        raise KeyError(name)
    cfg.return_dict = False
    ids = torch.randint(0, 1000, (batch, seq))
    # eval() on the wrapper too: the exporter traces in the top module's mode, and a wrapper left in
    # training mode exports every Dropout with training_mode=true.
    return ZooModel(name, _FirstOutput(model).eval(), {"input_ids": ids}, "transformer")


class _FirstOutput(torch.nn.Module):
    """Exports and compiles the last hidden state only (no caches, no pooler tuple)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = (
            self.inner(input_ids=input_ids, use_cache=False)
            if _takes_cache(self.inner)
            else self.inner(input_ids)
        )
        return out[0]


def _takes_cache(m: torch.nn.Module) -> bool:
    return type(m).__name__ in ("GPT2Model", "LlamaModel")


def import_torchvision() -> None:
    """torchvision's models, even where its C++ ops cannot load (a CUDA build of torchvision beside
    a CPU torch): the models need none of them, only the import must get through."""
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        # The fake-kernel registrations are what fail without the ops; the models do not use them.
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision  # noqa: F401


def build(name: str, batch: int, seq: int = 128) -> ZooModel:
    import_torchvision()
    import torchvision.models as tv

    vision = {
        "resnet50": tv.resnet50,
        "mobilenet_v3_large": tv.mobilenet_v3_large,
        "efficientnet_b0": tv.efficientnet_b0,
        "convnext_tiny": tv.convnext_tiny,
        "vit_b_16": tv.vit_b_16,
        # Not in the zoo's timed rows; the CNNs of tests/unit/test_exports.py, for bench/kernels.py.
        "resnet18": tv.resnet18,
        "mobilenet_v3_small": tv.mobilenet_v3_small,
        "shufflenet_v2_x0_5": tv.shufflenet_v2_x0_5,
        "squeezenet1_0": tv.squeezenet1_0,
    }
    if name in vision:
        return _vision(name, vision[name], batch)
    return _hf(name, batch, seq)


def export_onnx(zm: ZooModel, path: str, keep_batchnorm: bool = False) -> None:
    """`keep_batchnorm`: BatchNormalization stays a node (as in the ONNX Model Zoo's CNNs); by
    default the TorchScript exporter folds it into the convolution before it."""
    common: dict[str, Any] = {"input_names": list(zm.example), "output_names": ["y"], "opset_version": 18}
    torchscript: dict[str, Any] = {"dynamo": False}
    if keep_batchnorm:
        torchscript.update(training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)
    args = tuple(zm.example.values())
    with torch.no_grad():
        try:
            torch.onnx.export(zm.module, args, path, **common, **torchscript)
        except Exception:  # some modules only export through the dynamo exporter
            torch.onnx.export(zm.module, args, path, **common, dynamo=True, external_data=False)
    assert os.path.getsize(path) > 0


ZOO = [
    "resnet50",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
    "vit_b_16",
    "bert-base",
    "gpt2",
    "llama-small",
]
