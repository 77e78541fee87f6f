"""A CUDA graph kept alive replays correctly after other graphs are captured and let go.

torch caches cuBLAS workspaces per capture stream and clears them when any graph captured on
that stream is let go (pytorch/pytorch#193402); runtime/graph_capture.py gives each capture a
workspace of its own. The compiled plan's graph lives while the profile and the tuning stage of
another compile capture and drop theirs: these tests hold it to that.
"""

from __future__ import annotations

import gc

import numpy as np
import onnxruntime as ort
import pytest
import torch

import opfuse
from opfuse.runtime.graph_capture import graph_capture
from tests.builders import residual_mlp

pytestmark = pytest.mark.gpu


def _churn() -> None:
    """Reuse freed device memory with values no GEMM of the tests produces."""
    gc.collect()
    torch.cuda.empty_cache()
    fill = [torch.full((1 << n,), float("nan"), device="cuda") for n in range(16, 27)]
    torch.cuda.synchronize()
    del fill


def test_a_kept_graph_survives_another_graph_let_go() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    # A tall-skinny GEMM with a long reduction: cuBLAS picks split-K, which needs a workspace.
    x = torch.randn(64, 16384, device="cuda", generator=gen)
    w = torch.randn(16384, 64, device="cuda", generator=gen)
    x @ w  # warm
    torch.cuda.synchronize()
    kept = torch.cuda.CUDAGraph()
    with graph_capture(kept):
        y = x @ w
    for _ in range(3):
        other = torch.cuda.CUDAGraph()
        a = torch.randn(32, 32768, device="cuda", generator=gen)
        b = torch.randn(32768, 128, device="cuda", generator=gen)
        with graph_capture(other):
            a @ b
        other.replay()
        del other, a, b
        _churn()
    kept.replay()
    torch.cuda.synchronize()
    ref = (x.double() @ w.double()).float()
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, rtol=1e-3, atol=1e-2)


def test_a_compiled_model_runs_right_after_another_compile() -> None:
    """The bench keeps batch 1's compiled model while batch 32's compile profiles and tunes."""
    model = residual_mlp(hidden=512, ffn=2048)
    # Left to the library, the GEMMs run in cuBLAS inside the plan's graph.
    library = ["gemm_epilogue", "split_k"]
    first = opfuse.compile(model, input_shapes={"x": [64, 512]}, device="cuda", fusion_disable=library)
    assert first.cuda_graph_error is None
    rng = np.random.default_rng()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((64, 512)).astype(np.float32)
    before = first.run({"x": x})["y"]
    second = opfuse.compile(model, input_shapes={"x": [256, 512]}, device="cuda", fusion_disable=library)
    assert second.report["verification"]["passed"] is True
    _churn()
    after = first.run({"x": x})["y"]
    ref = sess.run(None, {"x": x})[0]
    assert np.all(np.isfinite(after))
    np.testing.assert_allclose(after, before, rtol=0, atol=0)
    assert float(np.linalg.norm(after - ref) / np.linalg.norm(ref)) <= 1e-4
