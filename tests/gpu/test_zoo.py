"""The benchmark zoo on the GPU: each model compiled in fp16 and checked against onnxruntime (fp32,
CPU) on inputs opfuse never saw, relative L2 <= 2e-2 on every output.

    OPFUSE_ZOO=resnet50,bert-base python -m pytest tests/gpu/test_zoo.py   # a subset
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import opfuse

pytestmark = pytest.mark.gpu
pytest.importorskip("torchvision")
pytest.importorskip("transformers")

from bench.zoo import ZOO, build, export_onnx  # noqa: E402

MODELS = [m for m in os.environ.get("OPFUSE_ZOO", ",".join(ZOO)).split(",") if m]


@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_fp16_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    import onnxruntime as ort
    import torch

    zm = build(name, batch=1)
    path = str(tmp_path / "m.onnx")
    export_onnx(zm, path)
    shapes = {k: list(v.shape) for k, v in zm.example.items()}
    cm = opfuse.compile(path, input_shapes=shapes, precision="fp16", device="cuda", tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True, cm.report["verification"]
    assert cm.report["kernels"]["after"] < cm.report["kernels"]["before"]
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(7)
    feeds = {
        k: (
            torch.randn(v.shape, generator=gen)
            if v.is_floating_point()
            else torch.randint(0, 1000, v.shape, generator=gen)
        ).numpy()
        for k, v in zm.example.items()
    }
    want = sess.run(None, feeds)
    # The plan replayed as a CUDA graph (what run() does on the GPU) and step by step.
    for path_name, got in (("graph", cm.run(feeds)), ("steps", cm.executor.run(feeds))):
        for out, ref in zip(sess.get_outputs(), want, strict=True):
            g = np.asarray(got[out.name], dtype=np.float64)
            assert g.shape == ref.shape and np.all(np.isfinite(g))
            err = np.linalg.norm(g - ref) / max(float(np.linalg.norm(ref)), 1e-12)
            assert err <= 2e-2, f"{name} {out.name} ({path_name}): relative L2 {err:.2e}"
            assert float(np.linalg.norm(ref)) > 1e-3 * ref.size**0.5, "the reference output is ~0: vacuous"
