"""The benchmark zoo on the GPU: each model compiled in fp16 and checked against onnxruntime (fp32,
CPU) on inputs opfuse never saw, relative L2 <= 2e-2 on every output. Every model verifies; one
that PyTorch itself cannot run in fp16 within 2e-2 (ResNet-50 with random weights: 3.0%) verifies
against the unfused plan's own fp16 error (verification.basis), and is held here to 1.25 times
PyTorch's fp16 error.

    OPFUSE_ZOO=resnet50,bert-base python -m pytest tests/gpu/test_zoo.py   # a subset
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opfuse

pytestmark = pytest.mark.gpu
if importlib.util.find_spec("torchvision") is None:  # its import may fail: bench.zoo gets around that
    pytest.skip("torchvision is not installed", allow_module_level=True)
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
    verification = cm.report["verification"]
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
    limit = 2e-2
    assert verification["passed"] is True, verification
    if verification.get("basis") == "unfused_precision":
        # Only for a model too sensitive for fp16: the unfused plan missed 2e-2 as well (the compile
        # held fusion to its error), and the source module in fp16 (PyTorch eager) misses the bar
        # too. opfuse is then held to that.
        assert "unfused plan" in verification.get("note", ""), verification
        torch_err = _torch_fp16_error(zm, feeds, want[0])
        assert torch_err > 2e-2, f"{name}: PyTorch fp16 is within 2e-2 ({torch_err:.2e}); opfuse is not"
        limit = 1.25 * torch_err
    # The plan replayed as a CUDA graph (what run() does on the GPU) and step by step.
    for path_name, got in (("graph", cm.run(feeds)), ("steps", cm.executor.run(feeds))):
        for out, ref in zip(sess.get_outputs(), want, strict=True):
            g = np.asarray(got[out.name], dtype=np.float64)
            assert g.shape == ref.shape and np.all(np.isfinite(g))
            err = np.linalg.norm(g - ref) / max(float(np.linalg.norm(ref)), 1e-12)
            assert err <= limit, f"{name} {out.name} ({path_name}): relative L2 {err:.2e} > {limit:.2e}"
            assert float(np.linalg.norm(ref)) > 1e-3 * ref.size**0.5, "the reference output is ~0: vacuous"


def _torch_fp16_error(zm: Any, feeds: dict[str, np.ndarray], ref: np.ndarray) -> float:
    """Relative L2 error of the source module itself in fp16 on the GPU (eager PyTorch)."""
    import torch

    module = zm.module.cuda().half().eval()
    args = [torch.from_numpy(v).cuda() for v in feeds.values()]
    args = [a.half() if a.is_floating_point() else a for a in args]
    with torch.no_grad():
        out = module(*args)
    zm.module.float()
    got = (out if torch.is_tensor(out) else out[0]).float().cpu().numpy().astype(np.float64)
    return float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-12))
