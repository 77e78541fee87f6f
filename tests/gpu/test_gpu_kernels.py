"""Generated kernels compiled for the GPU: the same models as the CPU tests, against onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import opfuse
from tests.builders import conv_bn_relu, residual_mlp

pytestmark = pytest.mark.gpu


def _rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64)))


@pytest.mark.parametrize("precision, tol", [("fp32", 1e-4), ("tf32", 2e-3), ("fp16", 2e-2), ("bf16", 2e-2)])
@pytest.mark.parametrize("which", ["mlp", "conv"])
def test_models_on_gpu(which: str, precision: str, tol: float, tmp_path: Path) -> None:
    model, shapes = (
        (residual_mlp(hidden=256, ffn=1024), {"x": [64, 256]})
        if which == "mlp"
        else (conv_bn_relu(16, 32, 32), {"x": [8, 16, 32, 32]})
    )
    cm = opfuse.compile(model, input_shapes=shapes, precision=precision, device="cuda")
    assert cm.report["device"]["kind"] == "cuda"
    assert cm.report["verification"]["passed"] is True
    assert cm.report["kernels"]["after"] < cm.report["kernels"]["before"]
    cm.save(tmp_path / "m.zip")
    loaded = opfuse.load(tmp_path / "m.zip", device="cuda")
    rng = np.random.default_rng()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        x = rng.standard_normal(shapes["x"]).astype(np.float32)
        out = loaded.run({"x": x})["y"]
        ref = sess.run(None, {"x": x})[0]
        assert np.all(np.isfinite(out))
        assert _rel_l2(out, ref) <= tol


def test_benchmark_fills_the_report() -> None:
    cm = opfuse.compile(residual_mlp(hidden=512, ffn=2048), input_shapes={"x": [256, 512]}, device="cuda")
    r = cm.benchmark(iters=20, warmup=3)
    for side in ("before", "after"):
        assert r[side]["latency_ms"]["p50"] > 0
        assert r[side]["peak_memory_bytes"] is not None
    assert r["speedup"] is not None
